R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
run_bench() {  # tree outname args...
  local tree=$1 name=$2; shift 2
  (cd $R/scratch/$tree && PYTHONPATH=$PWD:$R/.gpu-site timeout 200 python -m lightning_ft bench "$@" out_dir=$OUT/$name > $OUT/$name.log 2>&1)
  python $R/scratch/rows.py $OUT/$name/results.json
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
AB="+bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5"
run_bench new ab_new1 $AB
run_bench old ab_old $AB
run_bench new ab_new2 $AB
grep -h "MoE LoRA" $OUT/ab_new1.log | cut -c1-250 | head -12
(cd scratch/new && MEM_OUT=$OUT PYTHONPATH=$PWD:$R/.gpu-site:$R/scratch/memsite timeout 200 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=2 out_dir=$OUT/mem > $OUT/mem.log 2>&1; grep memphase $OUT/mem.log; head -30 $OUT/mem_peak_*.txt)
rm -f $OUT/*/results.png
