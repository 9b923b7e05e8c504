export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 250 python -m pytest -q -m gpu -p no:cacheprovider -x tests/modules/test_moe.py tests/kernels/test_swiglu.py tests/modules/test_cuda_graphs.py > $OUT/gpu_tests.txt 2>&1; tail -3 $OUT/gpu_tests.txt
grep -E "FAILED|Error" $OUT/gpu_tests.txt | head -20
(PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 110 python -m lightning_ft bench +bench=unsloth_qwen3_moe systems=[lightning_ft] seq_lens=[8192] warmup_steps=2 timed_steps=5 model.cuda_graphs_keep_projections=false moe.lora_slots=false out_dir=$OUT/b_off > $OUT/b_off.log 2>&1)
python scratch/rows.py $OUT/b_off/results.json; cp $OUT/b_off/results.json $OUT/off_noslots.json; rm -rf $OUT/b_off
grep -i "lora factors\|moe:" $OUT/b_off.log | head -3; tail -3 $OUT/b_off.log | cut -c1-300
