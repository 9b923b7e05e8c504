# Session 14, call 2: GPU tests of the graphs (varlen document-count buckets with empty documents,
# kept buffers shared across signatures), then the main job on real data (GSM8K packed to 4096
# tokens, the 48-layer Qwen3-30B-A3B shape) from this tree and from the last commit (scratch/old).
R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$R:$R/.gpu-site
timeout 260 python -m pytest -q -m gpu -p no:cacheprovider tests/modules/test_cuda_graphs.py \
  tests/modules/test_attention_gpu.py::test_training_step_never_syncs > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
fit() {  # tree name
  (cd $R/$1 && PYTHONPATH=$PWD:$R/.gpu-site timeout 200 bash benchmarks/fit_smoke_gpu.sh $OUT/$2 qwen3_moe \
     data=jsonl data.path=$R/scratch/gsm8k_train.jsonl trainer.max_steps=100 > $OUT/$2.log 2>&1)
  python -c "
import json,sys; s=json.load(open(sys.argv[1]))
print(sys.argv[2], s['status'], 'steps', s['steps'], 'tokens/s', round(s['tokens_per_s'] or 0), 'peak GiB', round(s['peak_memory_bytes']/2**30,2), 'loss', s['initial_loss'], s['final_loss'])
print('   ', {k: (round(v/2**30,2) if k.endswith('bytes') else v) for k, v in (s.get('cuda_graphs') or {}).items()})" $OUT/$2/qwen3_moe.summary.json $2
  grep -h "cuda graphs\|Error" $OUT/$2.log | cut -c1-300 | head -8
}
fit . fit_new
fit scratch/old fit_old
