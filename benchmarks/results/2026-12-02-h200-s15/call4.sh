# Session 15, call 4: kept MoE routing (no top-k, no sort in the recompute). GPU tests; A/B at 12 layers 8K against 100ce16.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 120 python -m pytest -q -m gpu -p no:cacheprovider tests/modules/test_moe.py tests/modules/test_cuda_graphs.py -k "kept or topk_weights or step_after_step" > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
run_bench() {  # tree name timeout args...
  local tree=$1 name=$2 limit=$3; shift 3
  (cd $tree && PYTHONPATH=$tree:$ROOT/.gpu-site timeout $limit python -m lightning_ft bench "$@" out_dir=$OUT/b_$name > $OUT/b_$name.log 2>&1)
  python $ROOT/scratch/rows.py $OUT/b_$name/results.json
  cp $OUT/b_$name/results.json $OUT/$name.json 2>/dev/null; rm -rf $OUT/b_$name
  grep -v "Warning\|warn(" $OUT/b_$name.log | grep "Error\|error" | cut -c1-300 | tail -4; rm -f $OUT/b_$name.log
}
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5"
run_bench $ROOT new 90 $B
run_bench $ROOT/scratch/old old 90 $B
