# Session 23, call 1: the 48-layer rows on HEAD, hf_peft and lightning_ft in one run (1K, 4K, 8K).
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
S=$OUT/call1.txt
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> $S
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 570 python -m lightning_ft bench +bench=qwen3_moe systems=[hf_peft,lightning_ft] seq_lens=[1024,4096,8192] warmup_steps=2 timed_steps=3 timeout_s=200 out_dir=/tmp/b48 > $OUT/bench48.log 2>&1
python scratch/rows.py /tmp/b48/results.json >> $S 2>&1; cp /tmp/b48/results.json $OUT/bench_qwen3_moe_48l.json; cp /tmp/b48/results.md $OUT/bench_qwen3_moe_48l.md 2>/dev/null
grep -iE "error|Traceback" $OUT/bench48.log | tail -n 3 >> $S
echo "done at +$(( $(date +%s) - T0 )) s" >> $S
cat $S
