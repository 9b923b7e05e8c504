R=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd scratch/new && export PYTHONPATH=$PWD:$R/.gpu-site
timeout 520 python -m pytest -q -m gpu tests/kernels/test_grouped_gemm.py tests/modules/test_moe.py tests/modules/test_finetune_module.py 2>&1 | tail -6 | tee $OUT/gpu_tests.txt
