# Session 20, call 1: GPU tests of this session's code (gathers fused with the thin expert-LoRA products,
# residual sums in the norms inside the CUDA graphs); 12-layer 8K A/B: new (working tree), mid (fb98b40:
# the fused gathers alone), old (e9a2577, the last commit before this session), 5 timed steps each.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
S=$OUT/call1.txt
nvidia-smi --query-gpu=name,memory.used --format=csv >> $S
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 200 python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/test_grouped_gemm.py tests/modules/test_moe.py tests/kernels/test_rms_norm.py tests/modules/test_patching.py tests/modules/test_cuda_graphs.py > $OUT/gpu_tests.txt 2>&1; tail -n 2 $OUT/gpu_tests.txt >> $S
grep -E "^FAILED|^E " $OUT/gpu_tests.txt | head -12 >> $S
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2"
ab() {  # tree name
  (cd $1 && PYTHONPATH=$1:$ROOT/.gpu-site timeout 85 python -m lightning_ft bench $B timed_steps=5 out_dir=/tmp/b_$2 > /tmp/$2.log 2>&1)
  python $ROOT/scratch/rows.py /tmp/b_$2/results.json >> $S 2>&1; echo "== $2" >> $OUT/ab_json.txt; cat /tmp/b_$2/results.json >> $OUT/ab_json.txt
  grep -iE "error|Traceback" /tmp/$2.log | tail -n 3 >> $S; tail -n 30 /tmp/$2.log >> $OUT/ab_logs.txt
}
ab $ROOT new1; ab $ROOT/scratch/old old1; ab $ROOT/scratch/mid mid1; ab $ROOT new2; ab $ROOT/scratch/old old2
cat $S
