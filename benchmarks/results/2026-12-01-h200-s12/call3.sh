R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd scratch/new && export PYTHONPATH=$PWD:$R/.gpu-site
timeout 60 python $R/scratch/choices.py 2>&1 | grep "MoE LoRA" | tee $OUT/thin_choices.txt
timeout 280 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[unsloth,lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=3 out_dir=$OUT/u12_8k > $OUT/u12_8k.log 2>&1
python $R/scratch/rows.py $OUT/u12_8k/results.json
timeout 270 python -m lightning_ft bench +bench=qwen3_moe seq_lens=[8192] systems=[hf_peft,lightning_ft] warmup_steps=2 timed_steps=5 out_dir=$OUT/q48_8k > $OUT/q48_8k.log 2>&1
python $R/scratch/rows.py $OUT/q48_8k/results.json
rm -f $OUT/*/results.png
