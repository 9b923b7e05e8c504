R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd scratch/new
export PYTHONPATH=$PWD:$R/.gpu-site
timeout 200 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=3 out_dir=$OUT/mem12 > $OUT/mem12.log 2>&1
grep "bench row" $OUT/mem12.log | cut -c1-1200
rm -f $OUT/*/results.png
timeout 150 python -m pytest -q -m gpu tests/modules/test_cuda_graphs.py 2>&1 | tail -2
