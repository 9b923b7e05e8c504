export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
PYTHONPATH=$ROOT:$ROOT/.gpu-site python scratch/gather_micro.py 2>&1 | tail -3 | tee $OUT/gather_micro.txt
rows() { python $ROOT/scratch/rows.py $1; }
run_bench() {  # tree name timeout args...
  local tree=$1 name=$2 limit=$3; shift 3
  (cd $tree && PYTHONPATH=$tree:$ROOT/.gpu-site timeout $limit python -m lightning_ft bench "$@" out_dir=$OUT/b_$name > $OUT/b_$name.log 2>&1)
  rows $OUT/b_$name/results.json
  cp $OUT/b_$name/results.json $OUT/$name.json 2>/dev/null; rm -rf $OUT/b_$name
  (echo "== $name"; grep -v "Warning\|warn(" $OUT/b_$name.log | grep -i "moe\|grouped_mm\|Error" | cut -c1-300 | tail -8) >> $OUT/logs.txt; rm -f $OUT/b_$name.log
}
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5"
run_bench $ROOT new1 120 $B
run_bench $ROOT/scratch/old old 120 $B
run_bench $ROOT new2 120 $B
cat $OUT/logs.txt
