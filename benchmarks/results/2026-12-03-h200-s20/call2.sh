# Session 20, call 2: the two GPU tests the code changed since call 1 touches; against Unsloth in one run
# (12 layers, 8K), this session's final code (dba06fd).
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
S=$OUT/call2.txt
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 80 python -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_grouped_gemm.py -k "timed_once_on_cuda or gathers_into or stores_the_rows" tests/kernels/test_rms_norm.py > $OUT/gpu_tests.txt 2>&1; tail -n 2 $OUT/gpu_tests.txt >> $S
grep -E "^FAILED|^E " $OUT/gpu_tests.txt | head -12 >> $S
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 440 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[unsloth,lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5 out_dir=/tmp/b_u > /tmp/unsloth.log 2>&1
python scratch/rows.py /tmp/b_u/results.json >> $S 2>&1; cp /tmp/b_u/results.json $OUT/unsloth_12l_8k.json; cp /tmp/b_u/results.md $OUT/ 2>/dev/null
grep -iE "error|Traceback" /tmp/unsloth.log | tail -n 3 >> $S; tail -n 40 /tmp/unsloth.log > $OUT/unsloth_log_tail.txt
cat $S
