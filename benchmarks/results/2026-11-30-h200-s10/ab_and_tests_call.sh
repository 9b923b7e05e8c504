R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
run_bench() {  # tree outname args...
  local tree=$1 name=$2; shift 2
  (cd $R/scratch/$tree && PYTHONPATH=${PREPATH:-}$PWD:$R/.gpu-site timeout 200 python -m lightning_ft bench "$@" out_dir=$OUT/$name > $OUT/$name.log 2>&1; grep -o "'ms_per_step': [0-9.]*\|'peak_mem_gib': [0-9.]*\|'peak_reserved_gib': [0-9.]*" $OUT/$name.log | tr '\n' ' '; echo " <- $name")
}
cd $R/scratch/new
PYTHONPATH=$PWD:$R/.gpu-site timeout 240 python -m pytest -q -m gpu tests/kernels/test_moe_lora_layout.py tests/kernels/test_grouped_gemm.py tests/modules/test_moe.py 2>&1 | tail -4 | tee $OUT/gpu_tests_moe.txt
AB="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5"
run_bench new ab_new1 $AB
run_bench old ab_old $AB
run_bench new ab_new2 $AB
export S10_SHAPES=1 S10_STACK=1 PREPATH=$R/scratch/prof_site:; run_bench new prof_stack +bench=qwen3_moe num_layers=2 seq_lens=[8192] systems=[lightning_ft] warmup_steps=2 timed_steps=1 profile=true model.cuda_graphs=false
