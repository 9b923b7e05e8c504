# Session 21, call 1: a trace of the 12-layer 8K step (HEAD) with Python stacks: the host timeline of the step's start,
# the device gaps, the kernel sequence of one forward and one backward graph.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2"
PYTHONPATH=$ROOT/scratch/prof_site:$ROOT:$ROOT/.gpu-site S21_TRACE=/tmp/trace.json timeout 200 python -m lightning_ft bench $B timed_steps=2 profile=true out_dir=/tmp/b_trace > /tmp/trace.log 2>&1
python scratch/rows.py /tmp/b_trace/results.json > $OUT/call1.txt 2>&1
tail -n 5 /tmp/trace.log >> $OUT/call1.txt
python scratch/host.py /tmp/trace.json 0 30 > $OUT/host0.txt 2>&1
python scratch/host.py /tmp/trace.json 1 30 > $OUT/host1.txt 2>&1
python scratch/seq.py /tmp/trace.json 5,18 > $OUT/seq.txt 2>&1
python scratch/gaps.py /tmp/trace.json > $OUT/gaps.txt 2>&1
cp /tmp/b_trace/profile_*.txt $OUT/ 2>/dev/null
gzip -c /tmp/trace.json > $OUT/trace.json.gz; ls -la $OUT; cat $OUT/call1.txt; head -5 $OUT/host1.txt
