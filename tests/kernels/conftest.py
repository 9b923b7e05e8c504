"""Device fixture for the kernel tests: the CPU under Triton's interpreter, and CUDA (marked gpu)."""

import pytest
import torch

from lightning_ft.kernels._utils import INTERPRETER

CPU_NEEDS_INTERPRETER = "Triton runs on the CPU only under TRITON_INTERPRET=1"


@pytest.fixture(
    params=[
        pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETER, reason=CPU_NEEDS_INTERPRETER)),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ]
)
def device(request) -> torch.device:
    return torch.device(request.param)
