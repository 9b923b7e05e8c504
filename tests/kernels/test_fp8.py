"""fp8 linear (frozen e4m3 weight, row-wise scales) against bf16/fp32 ``F.linear``, forward and input gradient.

Bounds (relative Frobenius error against F.linear of the unquantised operands in fp32):
    forward and dx   0.08   (e4m3 rounds each operand by ≤ 2⁻⁴ relative: about 4% on random data)
    _scaled_mm vs the fp32 reference of the same quantised operands   0.01 (bf16 output rounding)
"""

import pytest
import torch
import torch.nn.functional as F

from lightning_ft.kernels.fp8 import (
    E4M3,
    E4M3_MAX,
    fp8_linear,
    fp8_linear_reference,
    quantize_rows,
    quantize_rows_reference,
    quantize_rows_triton,
    quantize_weight,
    transpose_bytes,
)

BOUND = 0.08


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quantize_rows_scales_each_row_to_the_e4m3_range():
    x = torch.randn(5, 37) * torch.tensor([1e-3, 1.0, 50.0, 0.0, 7.0])[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (5,)
    amax = q.float().abs().amax(-1)
    assert torch.equal(amax[[0, 1, 2, 4]], torch.full((4,), E4M3_MAX))  # the largest value of each row lands on 448
    assert torch.equal(q[3].float(), torch.zeros(37))  # an all-zero row stays zero (no NaN from 0 / 0)
    deq = q.float() * scale[:, None]
    nonzero = x.abs() > scale[:, None] * 2**-6  # normal e4m3 range: relative rounding ≤ 2⁻⁴
    assert ((deq - x).abs() <= x.abs() * 2**-4 + 1e-30)[nonzero].all()


def test_quantize_rows_folds_a_column_scale():
    x, col = torch.randn(3, 20), torch.rand(20) + 0.5
    q, scale = quantize_rows(x, col_scale=col)
    q2, scale2 = quantize_rows(x * col)
    assert torch.equal(q.float(), q2.float()) and torch.equal(scale, scale2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 48, 80), (1, 13, 37, 19), (1, 1, 16, 16)])  # (B, T, K, N), odd sizes
@pytest.mark.parametrize("bias", [False, True])
def test_reference_matches_linear_within_bound(dtype, shape, bias):
    torch.manual_seed(0)
    b, t, k, n = shape
    w = torch.randn(n, k)
    wq, ws = quantize_weight(w)
    x = torch.randn(b, t, k, dtype=dtype, requires_grad=True)
    x_ref = x.detach().float().requires_grad_()
    bias_t = torch.randn(n) if bias else None
    y = fp8_linear_reference(x, wq, ws, None if bias_t is None else bias_t.to(dtype))
    y_ref = F.linear(x_ref, w, bias_t)
    assert y.dtype == dtype and y.shape == (b, t, n)
    assert _rel(y, y_ref) < BOUND
    dy = torch.randn(b, t, n, dtype=dtype)
    y.backward(dy)
    y_ref.backward(dy.float())
    assert x.grad.dtype == dtype and _rel(x.grad, x_ref.grad) < BOUND


def test_reference_under_autocast_returns_the_autocast_dtype_and_no_weight_gradient():
    wq, ws = quantize_weight(torch.randn(32, 48))
    x = torch.randn(4, 48, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, wq, ws)  # on the CPU: the reference
    assert y.dtype == torch.bfloat16 and not wq.requires_grad
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32


def test_rejects_a_weight_that_is_not_e4m3():
    with pytest.raises(ValueError, match="e4m3 weight"):
        fp8_linear(torch.randn(2, 16), torch.randn(16, 16), torch.ones(16))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 4096, 1024), (300, 2048, 4096), (64, 48, 80), (33, 37, 19)])  # M, K, N
def test_scaled_mm_matches_reference_and_bf16(shape):
    torch.manual_seed(0)
    m, k, n = shape
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_weight(w)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    outs = []
    for fn in (fp8_linear, fp8_linear_reference):
        x.grad = None
        torch.cuda.set_sync_debug_mode("error")  # no device-to-host sync in forward or backward
        try:
            y = fn(x, wq, ws)
            y.backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        outs.append((y, x.grad.clone()))
    (y, dx), (y_ref, dx_ref) = outs
    assert _rel(y, y_ref) < 0.01 and _rel(dx, dx_ref) < 0.01
    x_full = x.detach().float().requires_grad_()
    y_full = F.linear(x_full, w.float())
    y_full.backward(dy.float())
    assert _rel(y, y_full) < BOUND and _rel(dx, x_full.grad) < BOUND


@pytest.mark.parametrize("col_scale", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 37), (3, 2100), (1, 16)])  # 2100: a row over two column blocks
def test_quantize_rows_kernel_matches_the_torch_quantiser(device, dtype, shape, col_scale):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 5).to(device, dtype)
    x[0] = 0.0  # an all-zero row
    col = torch.rand(shape[1], device=device) + 0.5 if col_scale else None
    q, scale = quantize_rows_triton(x, col)
    q_ref, scale_ref = quantize_rows_reference(x, col)
    assert q.dtype == E4M3 and scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref) if device.type == "cpu" else torch.allclose(scale, scale_ref, rtol=1e-6, atol=0)
    if device.type == "cpu":  # bit for bit under the interpreter; one e4m3 step on CUDA (Triton's division)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    else:
        torch.testing.assert_close(q.float(), q_ref.float(), rtol=2**-3, atol=2**-9)


@pytest.mark.parametrize("shape", [(5, 37), (130, 257), (0, 4), (1, 1)])  # 130 x 257: partial tiles on both edges
def test_transpose_bytes_matches_torch_bit_for_bit(device, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 100).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).to(device)
    out = transpose_bytes(x)
    assert out.dtype == E4M3 and out.shape == shape[::-1] and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), x.t().contiguous().view(torch.uint8))


def test_transpose_bytes_rejects_what_it_cannot_copy():
    with pytest.raises(ValueError, match="contiguous 2-D tensor of 1-byte"):
        transpose_bytes(torch.zeros(4, 6, dtype=E4M3).t())
    with pytest.raises(ValueError, match="1-byte"):
        transpose_bytes(torch.zeros(4, 6))
