# Session 15, call 2: a chrome trace of the new 12-layer 8K step (idle gaps per stream), and activation offload off vs on.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
rows() { python $ROOT/scratch/rows.py $1; }
export PYTHONPATH=$ROOT/scratch/prof_site:$ROOT:$ROOT/.gpu-site S15_TRACE=/tmp/trace.json
timeout 150 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=2 profile=true out_dir=$OUT/b_trace > $OUT/trace.log 2>&1
rows $OUT/b_trace/results.json; tail -2 $OUT/trace.log | cut -c1-300
python scratch/gaps.py /tmp/trace.json > $OUT/gaps.txt 2>&1; head -70 $OUT/gaps.txt
gzip -c /tmp/trace.json > $OUT/trace12.json.gz
unset S15_TRACE; export PYTHONPATH=$ROOT:$ROOT/.gpu-site
i=0; for o in false true false; do i=$((i+1))
  timeout 120 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5 model.activation_offload=$o out_dir=$OUT/b_off_$o > $OUT/off.log 2>&1
  echo "offload=$o"; rows $OUT/b_off_$o/results.json; cp $OUT/b_off_$o/results.json $OUT/offload_${o}_$i.json; rm -rf $OUT/b_off_$o
done
rm -rf $OUT/b_trace
