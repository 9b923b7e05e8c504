# Session 19, call 2: fused add+norm microbenchmark; a trace of the 12-layer 8K step (this session's code) with per-graph kernel sequences.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
mkdir -p /tmp/o
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 60 python scratch/norm_micro.py > /tmp/o/norm_micro.txt 2>&1; cat /tmp/o/norm_micro.txt | tail -12
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2"
PYTHONPATH=$ROOT/scratch/prof_site:$ROOT:$ROOT/.gpu-site S18_TRACE=/tmp/trace.json timeout 150 python -m lightning_ft bench $B timed_steps=2 profile=true out_dir=/tmp/b_trace > /tmp/o/trace.log 2>&1
python scratch/rows.py /tmp/b_trace/results.json; cp /tmp/b_trace/profile_*.txt /tmp/o/
python scratch/seq.py /tmp/trace.json 5,18 > /tmp/o/seq.txt 2>&1; head -n 3 /tmp/o/seq.txt
python benchmarks/results/2026-12-02-h200-s15/gaps.py /tmp/trace.json > /tmp/o/gaps.txt 2>&1; head -n 4 /tmp/o/gaps.txt
gzip -c /tmp/trace.json > /tmp/o/trace.json.gz
tar -C /tmp/o -czf $OUT/call2.tgz . ; ls -la $OUT
