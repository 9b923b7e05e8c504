# Session 13, call 4: the CUDA-graphs GPU tests again after fixing call 3's five failures, which were the
# test's own expectation of the kept bytes (written before the LoRA linears joined the projections; the
# gradient checks before them had passed).
export PYTHONPATH=$PWD:$PWD/.gpu-site HF_HUB_OFFLINE=1
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/modules/test_cuda_graphs.py > $OUT/gpu_tests_call4.txt 2>&1
tail -3 $OUT/gpu_tests_call4.txt
