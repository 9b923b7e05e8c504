R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd scratch/new && export PYTHONPATH=$PWD:$R/.gpu-site
timeout 60 python $R/scratch/choices.py 2>&1 | grep -v Warn | tee $OUT/thin_choices.txt
timeout 280 python -m lightning_ft bench +bench=qwen3_moe seq_lens=[8192] systems=[hf_peft,lightning_ft] warmup_steps=2 timed_steps=5 out_dir=$OUT/q48_8k > $OUT/q48_8k.log 2>&1
python $R/scratch/rows.py $OUT/q48_8k/results.json
timeout 240 python -m pytest -q -m gpu tests/kernels/test_grouped_gemm.py tests/modules/test_moe.py tests/modules/test_finetune_module.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
rm -f $OUT/*/results.png
