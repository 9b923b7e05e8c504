# Session 18, call 1: GPU tests of the changed paths (unrun since e597118); 12-layer 8K rows, the kept gate/up copy written by SwiGLU (new) against HEAD (old); a trace with Python stacks of the step boundary.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python -c "import torch, pytest; print(torch.__version__, pytest.__version__)"
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 250 python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/modules/test_moe.py tests/kernels/test_grouped_gemm.py tests/kernels/test_swiglu.py tests/modules/test_cuda_graphs.py tests/modules/test_attention_gpu.py > $OUT/gpu_tests.txt 2>&1; tail -n 3 $OUT/gpu_tests.txt
grep -E "FAILED|Error" $OUT/gpu_tests.txt | head -20
rows() { python $ROOT/scratch/rows.py $1; }
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2"
ab() {  # tree name
  (cd $1 && PYTHONPATH=$1:$ROOT/.gpu-site timeout 100 python -m lightning_ft bench $B timed_steps=5 out_dir=$OUT/b_$2 > $OUT/$2.log 2>&1)
  rows $OUT/b_$2/results.json; cp $OUT/b_$2/results.json $OUT/$2.json; rm -rf $OUT/b_$2; grep -i "error" $OUT/$2.log | tail -n 3
}
ab $ROOT new1; ab $ROOT/scratch/old old; ab $ROOT new2
PYTHONPATH=$ROOT/scratch/prof_site:$ROOT:$ROOT/.gpu-site S18_STACK=1 S18_TRACE=/tmp/trace.json timeout 150 python -m lightning_ft bench $B timed_steps=2 profile=true out_dir=$OUT/b_trace > $OUT/trace.log 2>&1
rows $OUT/b_trace/results.json; cp $OUT/b_trace/profile_*.txt $OUT/ 2>/dev/null; rm -rf $OUT/b_trace
tail -n 2 $OUT/trace.log | cut -c1-300
python scratch/boundary.py /tmp/trace.json 40 12 > $OUT/boundary.txt 2>&1; head -c 6000 $OUT/boundary.txt
python benchmarks/results/2026-12-02-h200-s15/gaps.py /tmp/trace.json > $OUT/gaps.txt 2>&1; head -n 12 $OUT/gaps.txt
gzip -c /tmp/trace.json > $OUT/trace.json.gz; ls -la $OUT
