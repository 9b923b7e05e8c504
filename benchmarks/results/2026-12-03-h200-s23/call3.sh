# Session 23, call 3: 48 layers at 32K and 64K with activation offload on (session 9's long-row command; call 2 left it at
# the fit default, off); then the GPU tests again with more time (call 2's were cut at 95% by their 170 s limit).
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
S=$OUT/call3.txt
T0=$(date +%s)
L="model.cuda_graphs_keep_attention=false model.cuda_graphs_keep_projections=false model.activation_offload=true"
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 330 python -m lightning_ft bench +bench=qwen3_moe systems=[lightning_ft] seq_lens=[32768,65536] warmup_steps=2 timed_steps=2 $L timeout_s=200 out_dir=/tmp/b3264 > $OUT/bench3264.log 2>&1
python scratch/rows.py /tmp/b3264/results.json >> $S 2>&1; cp /tmp/b3264/results.json $OUT/bench_qwen3_moe_48l_32k_64k_offload.json
grep -iE "error|Traceback" $OUT/bench3264.log | tail -n 3 >> $S
echo "benches done at +$(( $(date +%s) - T0 )) s" >> $S
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout $(( 580 - ($(date +%s) - T0) )) python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests --ignore=tests/kernels/test_grouped_gemm.py > $OUT/gpu_tests.txt 2>&1; tail -n 2 $OUT/gpu_tests.txt >> $S
grep -E "^FAILED|^E " $OUT/gpu_tests.txt | head -12 >> $S
echo "tests done at +$(( $(date +%s) - T0 )) s" >> $S
cat $S
