# Session 23, call 4: against Unsloth in one run on HEAD (12 layers, 8K: a fourth sample of the 1.5x ratio); then the
# grouped GEMM's GPU tests in the time left.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
S=$OUT/call4.txt
T0=$(date +%s)
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 280 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[unsloth,lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5 out_dir=/tmp/b_u > $OUT/unsloth.log 2>&1
python scratch/rows.py /tmp/b_u/results.json >> $S 2>&1; cp /tmp/b_u/results.json $OUT/unsloth_12l_8k.json 2>/dev/null
grep -iE "error|Traceback" $OUT/unsloth.log | tail -n 3 >> $S
echo "unsloth done at +$(( $(date +%s) - T0 )) s" >> $S
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout $(( 400 - ($(date +%s) - T0) )) python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/test_grouped_gemm.py > $OUT/gpu_tests_gg.txt 2>&1; tail -n 2 $OUT/gpu_tests_gg.txt >> $S
grep -E "^FAILED|^E " $OUT/gpu_tests_gg.txt | head -12 >> $S
echo "tests done at +$(( $(date +%s) - T0 )) s" >> $S
cat $S
