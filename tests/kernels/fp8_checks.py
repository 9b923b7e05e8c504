"""Checks shared by the kernels that emit their output's fp8 rows (RMSNorm, SwiGLU)."""

import torch

from lightning_ft.kernels.fp8 import E4M3, quantize_rows_reference


def assert_fp8_rows(y: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """``(q, scale)`` are the plain-torch quantiser's rows of ``y`` (`quantize_rows_reference` of y's [M, N] rows).

    Bit for bit on the CPU (the interpreter divides as torch does); on CUDA Triton's fp32 division may
    round differently: scales within 1e-6 relative and each value within one e4m3 step (2⁻³ relative).
    """
    q_ref, scale_ref = quantize_rows_reference(y.detach().reshape(-1, y.shape[-1]))
    assert q.dtype == E4M3 and q.shape == q_ref.shape and scale.dtype == torch.float32 and scale.shape == scale_ref.shape
    if y.device.type == "cpu":
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
    else:
        torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=2**-3, atol=2**-9)
