# Session 13, call 3: the GPU tests of the final code (call 2's were cut by their time limit), then the Unsloth row.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.gpu-site
S=benchmarks/results/2026-12-01-h200-s13
T=tests/modules
timeout 320 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_lora.py \
  tests/kernels/test_grouped_gemm.py::test_triton_grouped_gemm_accumulates_in_place \
  $T/test_moe.py::test_kept_experts_skip_the_gate_up_gemm_in_the_recompute \
  $T/test_attention.py::test_kept_attention_reuses_the_forward_output_and_gives_the_same_gradients \
  $T/test_cuda_graphs.py $T/test_attention_gpu.py::test_training_step_never_syncs > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt
timeout 215 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[unsloth,lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=3 out_dir=$OUT/u > $OUT/u12_8k.log 2>&1
python benchmarks/results/2026-12-01-h200-s12/rows.py $OUT/u/results.json; cp $OUT/u/results.json $OUT/u12_8k.json; rm -rf $OUT/u
