# Session 14, call 4: the review's fixes (kept bytes counted once per shared set, restores only where
# another forward wrote the buffers, one-document rows not padded) on the GPU: the graph tests, then
# the main job on GSM8K again (48 layers, 4096 tokens, 100 steps).
R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$R:$R/.gpu-site
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/modules/test_cuda_graphs.py \
  tests/modules/test_attention_gpu.py::test_training_step_never_syncs > $OUT/gpu_tests_call4.txt 2>&1
tail -2 $OUT/gpu_tests_call4.txt
timeout 200 bash benchmarks/fit_smoke_gpu.sh $OUT/fit qwen3_moe data=jsonl data.path=$R/scratch/gsm8k_train.jsonl trainer.max_steps=100 > $OUT/fit.log 2>&1
python -c "
import json,sys; s=json.load(open(sys.argv[1]))
print(s['status'], 'steps', s['steps'], 'tokens/s', round(s['tokens_per_s'] or 0), 'peak GiB', round(s['peak_memory_bytes']/2**30,2), 'loss', s['initial_loss'], s['final_loss'])
print('   ', {k: (round(v/2**30,2) if k.endswith('bytes') else v) for k, v in (s.get('cuda_graphs') or {}).items()})" $OUT/fit/qwen3_moe.summary.json
cp $OUT/fit/qwen3_moe.summary.json $OUT/fit_gsm8k_4k_call4.summary.json; rm -rf $OUT/fit
grep -h "cuda graphs\|Error" $OUT/fit.log | cut -c1-300 | head -6; rm $OUT/fit.log
