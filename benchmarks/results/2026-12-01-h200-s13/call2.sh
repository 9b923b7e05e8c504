# Session 13, call 2: GPU tests of the kept projections (LoRA linears + experts, computed into the buffers),
# A/B of model.cuda_graphs_keep_projections at 12 layers 8K, then the MoE issue's 8K rows (hf_peft 48 layers, Unsloth 12 layers).
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.gpu-site
S=benchmarks/results/2026-12-01-h200-s13
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run_bench() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  timeout $limit python -m lightning_ft bench "$@" out_dir=$OUT/b_$name > $OUT/b_$name.log 2>&1
  python benchmarks/results/2026-12-01-h200-s12/rows.py $OUT/b_$name/results.json
  cp $OUT/b_$name/results.json $OUT/$name.json 2>/dev/null; rm -rf $OUT/b_$name
  grep -h "cuda graphs:" $OUT/b_$name.log | tail -1 | cut -c1-300
  (echo "== $name"; grep -v "Warning\|warn(" $OUT/b_$name.log | tail -c 2500) >> $OUT/logs_tail.txt; rm -f $OUT/b_$name.log
}
timeout 200 python -m pytest -q -m gpu tests/kernels/test_lora.py tests/kernels/test_grouped_gemm.py tests/modules/test_moe.py tests/modules/test_cuda_graphs.py tests/modules/test_attention.py -k "kept or graphed or sync or two_forwards or accumulates or patch" 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
AB="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5"
run_bench ab_keep_on 110 $AB
run_bench ab_keep_off 110 $AB model.cuda_graphs_keep_projections=false
run_bench q48_8k 260 +bench=qwen3_moe seq_lens=[8192] systems=[hf_peft,lightning_ft] warmup_steps=2 timed_steps=5
run_bench u12_8k 230 +bench=unsloth_qwen3_moe systems=[unsloth,lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=3
