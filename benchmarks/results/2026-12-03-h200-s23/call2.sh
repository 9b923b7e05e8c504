# Session 23, call 2: GPU tests of every file but the grouped GEMM's (HEAD); 48 layers at 32K (hf_peft and lightning_ft,
# one run) and 64K (lightning_ft) in the long-row configuration (no kept attention or projections).
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
ROOT=$PWD
S=$OUT/call2.txt
T0=$(date +%s)
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 170 python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests --ignore=tests/kernels/test_grouped_gemm.py > $OUT/gpu_tests.txt 2>&1; tail -n 2 $OUT/gpu_tests.txt >> $S
grep -E "^FAILED|^E " $OUT/gpu_tests.txt | head -12 >> $S
echo "tests done at +$(( $(date +%s) - T0 )) s" >> $S
L="model.cuda_graphs_keep_attention=false model.cuda_graphs_keep_projections=false"
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout 200 python -m lightning_ft bench +bench=qwen3_moe systems=[hf_peft,lightning_ft] seq_lens=[32768] warmup_steps=2 timed_steps=2 $L timeout_s=120 out_dir=/tmp/b32 > $OUT/bench32.log 2>&1
python scratch/rows.py /tmp/b32/results.json >> $S 2>&1; cp /tmp/b32/results.json $OUT/bench_qwen3_moe_48l_32k.json
grep -iE "error|Traceback" $OUT/bench32.log | tail -n 3 >> $S
echo "32K done at +$(( $(date +%s) - T0 )) s" >> $S
PYTHONPATH=$ROOT:$ROOT/.gpu-site timeout $(( 575 - ($(date +%s) - T0) )) python -m lightning_ft bench +bench=qwen3_moe systems=[lightning_ft] seq_lens=[65536] warmup_steps=2 timed_steps=2 $L out_dir=/tmp/b64 > $OUT/bench64.log 2>&1
python scratch/rows.py /tmp/b64/results.json >> $S 2>&1; cp /tmp/b64/results.json $OUT/bench_qwen3_moe_48l_64k.json
grep -iE "error|Traceback" $OUT/bench64.log | tail -n 3 >> $S
echo "64K done at +$(( $(date +%s) - T0 )) s" >> $S
cat $S
