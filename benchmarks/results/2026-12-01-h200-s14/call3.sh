# Session 14, call 3: the MoE issue's 48-layer 1K and 4K rows with the default kept activations.
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.gpu-site
timeout 480 python -m lightning_ft bench +bench=qwen3_moe seq_lens=[1024,4096] systems=[hf_peft,lightning_ft] warmup_steps=2 timed_steps=3 out_dir=$OUT/b > $OUT/q48_1k_4k.log 2>&1
python benchmarks/results/2026-12-01-h200-s12/rows.py $OUT/b/results.json
cp $OUT/b/results.json $OUT/q48_1k_4k.json; rm -rf $OUT/b
grep -v "Warning\|warn(" $OUT/q48_1k_4k.log | tail -c 1500 > $OUT/q48_1k_4k_tail.txt; rm $OUT/q48_1k_4k.log
