# Session 15, call 1: GPU tests of the changed paths; A/B at 12 layers 8K (new, old, new); the new step profiled.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/modules/test_moe.py tests/kernels/test_lora.py tests/modules/test_cuda_graphs.py -k "kept or later or graph" > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
rows() { python $ROOT/scratch/rows.py $1; python -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']:
    print('   ', {k: (round(v/2**30,2) if k.endswith('bytes') else v) for k, v in r.items() if k.startswith('cuda_graphs_') or k.startswith('peak_mem_gib_')})" $1; }
run_bench() {  # tree name timeout args...
  local tree=$1 name=$2 limit=$3; shift 3
  (cd $tree && PYTHONPATH=$tree:$ROOT/.gpu-site timeout $limit python -m lightning_ft bench "$@" out_dir=$OUT/b_$name > $OUT/b_$name.log 2>&1)
  rows $OUT/b_$name/results.json
  cp $OUT/b_$name/results.json $OUT/$name.json 2>/dev/null
  cp $OUT/b_$name/profile_*.txt $OUT/ 2>/dev/null; rm -rf $OUT/b_$name
  (echo "== $name"; grep -v "Warning\|warn(" $OUT/b_$name.log | grep "cuda graphs\|Error\|error\|MoE LoRA" | cut -c1-300 | tail -14) >> $OUT/logs.txt; rm -f $OUT/b_$name.log
}
B="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5"
run_bench $ROOT new1 120 $B
run_bench $ROOT/scratch/old old 120 $B
run_bench $ROOT new2 120 $B
run_bench $ROOT prof 120 +bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=2 profile=true
cat $OUT/logs.txt
