# Session 18, call 2: the fixed kept-bytes test and the h_copy/kept paths on the GPU; 12-layer 8K A/B: new (SwiGLU writes the kept gate/up, host-tensor logging) vs HEAD; a trace with stacks (profile table, step-boundary host work).
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
mkdir -p /tmp/o
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 150 python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/modules/test_cuda_graphs.py tests/kernels/test_swiglu.py tests/modules/test_moe.py tests/kernels/test_grouped_gemm.py -k "step_after_step or h_copy or kept or slots" > /tmp/o/gpu_tests.txt 2>&1; tail -n 2 /tmp/o/gpu_tests.txt
grep -E "^FAILED|^E " /tmp/o/gpu_tests.txt | head -10
rows() { python $ROOT/scratch/rows.py $1; }
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2"
ab() {  # tree name
  (cd $1 && PYTHONPATH=$1:$ROOT/.gpu-site timeout 100 python -m lightning_ft bench $B timed_steps=5 out_dir=/tmp/b_$2 > /tmp/o/$2.log 2>&1)
  rows /tmp/b_$2/results.json; cp /tmp/b_$2/results.json /tmp/o/$2.json; grep -i "error" /tmp/o/$2.log | tail -n 3
}
ab $ROOT new1; ab $ROOT/scratch/old old; ab $ROOT new2
PYTHONPATH=$ROOT/scratch/prof_site:$ROOT:$ROOT/.gpu-site S18_STACK=1 S18_TRACE=/tmp/trace.json timeout 150 python -m lightning_ft bench $B timed_steps=2 profile=true out_dir=/tmp/b_trace > /tmp/o/trace.log 2>&1
rows /tmp/b_trace/results.json; cp /tmp/b_trace/profile_*.txt /tmp/o/
python scratch/boundary.py /tmp/trace.json 60 40 > /tmp/o/boundary.txt 2>&1
python benchmarks/results/2026-12-02-h200-s15/gaps.py /tmp/trace.json > /tmp/o/gaps.txt 2>&1
head -n 45 /tmp/o/profile_lightning_ft_8192.txt | cut -c1-110,230-300
gzip -c /tmp/trace.json > /tmp/o/trace.json.gz
tar -C /tmp/o -czf $OUT/call2.tgz . ; ls -la $OUT
