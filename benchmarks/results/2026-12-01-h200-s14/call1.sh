# Session 14, call 1: the current 12-layer 8K step profiled (kernels by device time), then the long
# rows (48 layers, 32K and 64K) with the default kept activations (attention and projections on)
# and activation offload, which session 9 ran with model.cuda_graphs_keep_attention=false.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.gpu-site
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python -c "import flash_attn_interface" 2>&1 | tail -1; python -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
rows() { python benchmarks/results/2026-12-01-h200-s12/rows.py $1; python -c "
import json,sys
for r in json.load(open(sys.argv[1]))['rows']:
    print('   ', {k: (round(v/2**30,2) if k.endswith('bytes') else v) for k, v in r.items() if k.startswith('cuda_graphs_') or k.startswith('peak_mem_gib_')})" $1; }
run_bench() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  timeout $limit python -m lightning_ft bench "$@" out_dir=$OUT/b_$name > $OUT/b_$name.log 2>&1
  rows $OUT/b_$name/results.json
  cp $OUT/b_$name/results.json $OUT/$name.json 2>/dev/null
  cp $OUT/b_$name/profile_*.txt $OUT/ 2>/dev/null; rm -rf $OUT/b_$name
  (echo "== $name"; grep -v "Warning\|warn(" $OUT/b_$name.log | grep "cuda graphs\|Error\|error" | cut -c1-400 | tail -8) >> $OUT/logs.txt; rm -f $OUT/b_$name.log
}
run_bench prof12_8k 120 +bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=2 profile=true
run_bench q48_32k 150 +bench=qwen3_moe systems=[lightning_ft] seq_lens=[32768] model.activation_offload=true warmup_steps=2 timed_steps=2
run_bench q48_64k 200 +bench=qwen3_moe systems=[lightning_ft] seq_lens=[65536] model.activation_offload=true warmup_steps=2 timed_steps=1
cat $OUT/logs.txt
