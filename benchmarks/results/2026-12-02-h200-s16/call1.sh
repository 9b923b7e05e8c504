# Session 16, call 1: GPU tests of the changed paths; A/B at 12 layers 8K (new, old, new); keep-off new; profile new.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/modules/test_moe.py tests/kernels/test_grouped_gemm.py tests/kernels/test_swiglu.py tests/modules/test_cuda_graphs.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
grep -E "FAILED|Error" $OUT/gpu_tests.txt | head -20
rows() { python $ROOT/scratch/rows.py $1; }
run_bench() {  # tree name timeout args...
  local tree=$1 name=$2 limit=$3; shift 3
  (cd $tree && PYTHONPATH=$tree:$ROOT/.gpu-site timeout $limit python -m lightning_ft bench "$@" out_dir=$OUT/b_$name > $OUT/b_$name.log 2>&1)
  rows $OUT/b_$name/results.json
  cp $OUT/b_$name/results.json $OUT/$name.json 2>/dev/null
  cp $OUT/b_$name/profile_*.txt $OUT/ 2>/dev/null; rm -rf $OUT/b_$name
  (echo "== $name"; grep -v "Warning\|warn(" $OUT/b_$name.log | grep "cuda graphs\|Error\|error\|MoE LoRA\|moe:\|grouped_mm on" | cut -c1-300 | tail -14) >> $OUT/logs.txt; rm -f $OUT/b_$name.log
}
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5"
run_bench $ROOT new1 120 $B
run_bench $ROOT/scratch/old old 120 $B
run_bench $ROOT new2 120 $B
run_bench $ROOT newoff 120 $B model.cuda_graphs_keep_projections=false
run_bench $ROOT/scratch/old oldoff 120 $B model.cuda_graphs_keep_projections=false
cat $OUT/logs.txt
