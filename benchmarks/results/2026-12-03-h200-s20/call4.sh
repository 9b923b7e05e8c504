# Session 20, call 4: against Unsloth in one run (12 layers, 8K), final code (95ae606: the fused gather no longer
# makes a frozen x's rows require grad).
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 370 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[unsloth,lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5 out_dir=/tmp/b_u > /tmp/unsloth.log 2>&1
python scratch/rows.py /tmp/b_u/results.json > $OUT/call4.txt 2>&1; cp /tmp/b_u/results.json $OUT/unsloth_12l_8k.json
grep -iE "error|Traceback" /tmp/unsloth.log | tail -n 3 >> $OUT/call4.txt; cat $OUT/call4.txt
