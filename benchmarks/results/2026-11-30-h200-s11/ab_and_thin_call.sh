R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
run_bench() {  # tree outname args...
  local tree=$1 name=$2; shift 2
  (cd $R/scratch/$tree && PYTHONPATH=$PWD:$R/.gpu-site timeout 200 python -m lightning_ft bench "$@" out_dir=$OUT/$name > $OUT/$name.log 2>&1; grep -o "'ms_per_step': [0-9.]*\|'peak_mem_gib': [0-9.]*\|'peak_reserved_gib': [0-9.]*\|'loss_last': [0-9.]*" $OUT/$name.log | tr '\n' ' '; echo " <- $name")
}
(cd scratch/new && PYTHONPATH=$PWD:$R/.gpu-site timeout 150 python $R/scratch/s11_thin.py) 2>&1 | tee $OUT/thin.txt | grep -v Warn
AB="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5"
run_bench new ab_new1 $AB
run_bench old ab_old $AB
run_bench new ab_new2 $AB
cd scratch/new && PYTHONPATH=$PWD:$R/.gpu-site timeout 200 python -m pytest -q -m gpu tests/kernels/test_lora.py tests/kernels/test_moe_routing.py tests/modules/test_attention_gpu.py tests/modules/test_cuda_graphs.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
