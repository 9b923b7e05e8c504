# Session 19, call C: the full 48-layer Qwen3-30B-A3B shape, this session's code (lightning_ft only; hf_peft's anchors from earlier sessions).
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
for seq in 8192 1024 4096; do
  PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 110 python -m lightning_ft bench +bench=qwen3_moe systems=[lightning_ft] seq_lens=[$seq] warmup_steps=2 timed_steps=3 out_dir=/tmp/q48_$seq > $OUT/q48_$seq.log 2>&1
  cp /tmp/q48_$seq/results.json $OUT/q48_$seq.json 2>/dev/null; python scratch/rows.py $OUT/q48_$seq.json
done
