# Session 21, call 3: GPU tests of the shared input gradient of kept LoRA layers; 12-layer 8K A/B: new (working tree),
# old (HEAD bad0863, the last commit; the 2048-row chunks by ce_sitecustomize.py, which was scratch/ce_site/sitecustomize.py), new with 2048-row cross-entropy chunks, 5 timed steps each.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
S=$OUT/call3.txt
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 150 python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/test_lora.py tests/modules/test_cuda_graphs.py tests/modules/test_patching.py > $OUT/gpu_tests.txt 2>&1; tail -n 2 $OUT/gpu_tests.txt >> $S
grep -E "^FAILED|^E " $OUT/gpu_tests.txt | head -12 >> $S
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2"
ab() {  # tree name [extra PYTHONPATH]
  (cd $1 && PYTHONPATH=$3$1:$ROOT/.gpu-site timeout 85 python -m lightning_ft bench $B timed_steps=5 out_dir=/tmp/b_$2 > /tmp/$2.log 2>&1)
  python $ROOT/scratch/rows.py /tmp/b_$2/results.json >> $S 2>&1; echo "== $2" >> $OUT/ab_json.txt; cat /tmp/b_$2/results.json >> $OUT/ab_json.txt
  grep -iE "error|Traceback" /tmp/$2.log | tail -n 3 >> $S; tail -n 30 /tmp/$2.log >> $OUT/ab_logs.txt
}
ab $ROOT new1; ab $ROOT/scratch/old old1; ab $ROOT ce1 $ROOT/scratch/ce_site:; ab $ROOT new2; ab $ROOT/scratch/old old2
cat $S
