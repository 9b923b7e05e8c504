# Session 13, call 1: GPU tests of the kept experts, A/B of model.cuda_graphs_keep_experts at 12 layers 8K, ours at 48 layers 8K.
# (run on the code of that moment: the kept experts alone, copied into their buffers; the switch was then named
# model.cuda_graphs_keep_experts, later model.cuda_graphs_keep_projections when the LoRA linear layers joined)
R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.gpu-site
S=benchmarks/results/2026-12-01-h200-s13
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run_bench() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  timeout $limit python -m lightning_ft bench "$@" out_dir=$OUT/$name > $OUT/$name.log 2>&1
  python benchmarks/results/2026-12-01-h200-s12/rows.py $OUT/$name/results.json
  grep -h "cuda graphs:" $OUT/$name.log | tail -1 | cut -c1-300
}
timeout 170 python -m pytest -q -m gpu -x tests/modules/test_moe.py tests/modules/test_cuda_graphs.py tests/modules/test_attention.py tests/modules/test_attention_gpu.py -k "kept or graphed or sync or two_forwards" 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
AB="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5"
run_bench ab_keep_on1 110 $AB
run_bench ab_keep_off 110 $AB model.cuda_graphs_keep_experts=false
run_bench ab_keep_on2 110 $AB
run_bench q48_8k 200 +bench=qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5
rm -f $OUT/*/results.png $OUT/*/results.md
