R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd scratch/new && export PYTHONPATH=$PWD:$R/.gpu-site
timeout 180 bash benchmarks/fit_smoke_gpu.sh $OUT/smoke qwen3_moe model.config.num_hidden_layers=4 trainer.max_steps=8 2>&1 | grep -v "^\s*$" | grep -i -E "error|status|steps\"|step_losses|stopped|Traceback|tokens_per_s|cuda_graphs|replayed" | head -20
