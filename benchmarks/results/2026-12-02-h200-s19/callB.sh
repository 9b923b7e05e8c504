# Session 19, call B: against Unsloth in one run (12 layers, 8K), this session's code.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
mkdir -p /tmp/o
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 420 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[unsloth,lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5 out_dir=/tmp/b_u > /tmp/o/unsloth.log 2>&1
python scratch/rows.py /tmp/b_u/results.json; cp /tmp/b_u/results.json /tmp/o/unsloth_12l_8k.json; cp /tmp/b_u/results.md /tmp/o/ 2>/dev/null; grep -i "error" /tmp/o/unsloth.log | tail -n 3
tar -C /tmp/o -czf $OUT/callB.tgz . ; ls -la $OUT
