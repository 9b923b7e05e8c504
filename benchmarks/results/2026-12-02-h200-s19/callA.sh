# Session 19, call A: GPU tests of this session's code (residual sums in the norms, router top-k kernel, the layer output buffer);
# kernel microbenchmarks; 12-layer 8K A/B against the last commit (1be80d4), interleaved, 8 timed steps each.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
mkdir -p /tmp/o
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 60 python scratch/micro.py > /tmp/o/micro.txt 2>&1; tail -n 14 /tmp/o/micro.txt
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 180 python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/test_rms_norm.py tests/kernels/test_moe_routing.py tests/modules/test_patching.py tests/modules/test_cuda_graphs.py tests/modules/test_moe.py > /tmp/o/gpu_tests.txt 2>&1; tail -n 2 /tmp/o/gpu_tests.txt
grep -E "^FAILED|^E " /tmp/o/gpu_tests.txt | head -12
rows() { python $ROOT/scratch/rows.py $1; }
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2"
ab() {  # tree name
  (cd $1 && PYTHONPATH=$1:$ROOT/.gpu-site timeout 90 python -m lightning_ft bench $B timed_steps=8 out_dir=/tmp/b_$2 > /tmp/o/$2.log 2>&1)
  rows /tmp/b_$2/results.json; cp /tmp/b_$2/results.json /tmp/o/$2.json; grep -i "error" /tmp/o/$2.log | tail -n 3
}
ab $ROOT new1; ab $ROOT/scratch/old old1; ab $ROOT new2; ab $ROOT/scratch/old old2
tar -C /tmp/o -czf $OUT/callA.tgz . ; ls -la $OUT
