# Session 22, call 2: the GPU tests of every file but the grouped GEMM's (HEAD); against Unsloth in one run again (a third sample
# of the 1.5x ratio); our row with activation offload off (the fit default) in the same call.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
S=$OUT/call2.txt
T0=$(date +%s)
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 170 python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests --deselect tests/kernels/test_grouped_gemm.py --ignore=tests/kernels/test_grouped_gemm.py > $OUT/gpu_tests.txt 2>&1; tail -n 2 $OUT/gpu_tests.txt >> $S
grep -E "^FAILED|^E " $OUT/gpu_tests.txt | head -12 >> $S
echo "tests done at +$(( $(date +%s) - T0 )) s" >> $S
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 260 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[unsloth,lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5 out_dir=/tmp/b_u > $OUT/unsloth.log 2>&1
python scratch/rows.py /tmp/b_u/results.json >> $S 2>&1; cp /tmp/b_u/results.json $OUT/unsloth_12l_8k.json 2>/dev/null
grep -iE "error|Traceback" $OUT/unsloth.log | tail -n 3 >> $S
echo "unsloth done at +$(( $(date +%s) - T0 )) s" >> $S
if [ $(( $(date +%s) - T0 )) -lt 500 ]; then
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 90 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5 model.activation_offload=false out_dir=/tmp/b_n > /tmp/n.log 2>&1
echo "== offload off" >> $S; python scratch/rows.py /tmp/b_n/results.json >> $S 2>&1; cp /tmp/b_n/results.json $OUT/offload_off_12l_8k.json
fi
cat $S
