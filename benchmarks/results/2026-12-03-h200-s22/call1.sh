# Session 22, call 1: GPU tests of the review fixes (8424308, 3efcde4); against Unsloth in one run on HEAD (12 layers, 8K);
# the memory/speed trade on HEAD: kept projections off (and slots off), and a 2 GiB keep cap.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
S=$OUT/call1.txt
T0=$(date +%s)
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 120 python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/kernels/test_lora.py tests/modules/test_cuda_graphs.py > $OUT/gpu_tests.txt 2>&1; tail -n 2 $OUT/gpu_tests.txt >> $S
grep -E "^FAILED|^E " $OUT/gpu_tests.txt | head -12 >> $S
echo "tests done at +$(( $(date +%s) - T0 )) s" >> $S
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 260 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[unsloth,lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5 out_dir=/tmp/b_u > $OUT/unsloth.log 2>&1
python scratch/rows.py /tmp/b_u/results.json >> $S 2>&1; cp /tmp/b_u/results.json $OUT/unsloth_12l_8k.json 2>/dev/null
grep -iE "error|Traceback" $OUT/unsloth.log | tail -n 3 >> $S
echo "unsloth done at +$(( $(date +%s) - T0 )) s" >> $S
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5"
row() {  # name overrides...
  [ $(( $(date +%s) - T0 )) -lt 500 ] || { echo "skipped $1 (time)" >> $S; return; }
  n=$1; shift
  PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 90 python -m lightning_ft bench $B "$@" out_dir=/tmp/b_$n > /tmp/$n.log 2>&1
  echo "== $n $*" >> $S; python $ROOT/scratch/rows.py /tmp/b_$n/results.json >> $S 2>&1
  echo "== $n $*" >> $OUT/trade_json.txt; cat /tmp/b_$n/results.json >> $OUT/trade_json.txt
  grep -iE "error|Traceback" /tmp/$n.log | tail -n 3 >> $S
}
row lean model.cuda_graphs_keep_projections=false moe.lora_slots=false
row cap2 model.cuda_graphs_keep_max_gib=2
cat $S
