# Session 21, call 5: GPU tests (kept LoRA input gradients summed once; the unread expert output as one expanded zero);
# against Unsloth in one run (12 layers, 8K, the README's command); then a 12-layer 8K A/B pair, new against old (bad0863).
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
S=$OUT/call5.txt
T0=$(date +%s)
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 130 python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/test_lora.py tests/modules/test_cuda_graphs.py tests/modules/test_moe.py "tests/kernels/test_grouped_gemm.py::test_an_unneeded_output_is_zeros_with_the_same_gradients" > $OUT/gpu_tests.txt 2>&1; tail -n 2 $OUT/gpu_tests.txt >> $S
grep -E "^FAILED|^E " $OUT/gpu_tests.txt | head -12 >> $S
echo "tests done at +$(( $(date +%s) - T0 )) s" >> $S
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 300 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[unsloth,lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5 out_dir=/tmp/b_u > /tmp/unsloth.log 2>&1
python scratch/rows.py /tmp/b_u/results.json >> $S 2>&1; cp /tmp/b_u/results.json $OUT/unsloth_12l_8k.json
grep -iE "error|Traceback" /tmp/unsloth.log | tail -n 3 >> $S
echo "unsloth done at +$(( $(date +%s) - T0 )) s" >> $S
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2"
ab() {  # tree name
  [ $(( $(date +%s) - T0 )) -lt 480 ] || { echo "skipped $2 (time)" >> $S; return; }
  (cd $1 && PYTHONPATH=$1:$ROOT/.gpu-site timeout 85 python -m lightning_ft bench $B timed_steps=10 out_dir=/tmp/b_$2 > /tmp/$2.log 2>&1)
  python $ROOT/scratch/rows.py /tmp/b_$2/results.json >> $S 2>&1; echo "== $2" >> $OUT/ab_json.txt; cat /tmp/b_$2/results.json >> $OUT/ab_json.txt
  grep -iE "error|Traceback" /tmp/$2.log | tail -n 3 >> $S
}
ab $ROOT/scratch/old old1; ab $ROOT new1
cat $S
