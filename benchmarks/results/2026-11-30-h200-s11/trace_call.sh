R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$R/scratch/prof_site:$R:$R/.gpu-site S11_TRACE=/tmp/trace.json
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 300 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=2 profile=true out_dir=$OUT/prof12 > $OUT/prof12.log 2>&1
tail -5 $OUT/prof12.log
python scratch/s11_gaps.py /tmp/trace.json > $OUT/gaps12.txt 2>&1
head -60 $OUT/gaps12.txt
gzip -c /tmp/trace.json > $OUT/trace12.json.gz; ls -la $OUT
