"""RMSNorm kernel vs its plain-torch reference (HF's math: Llama's, and Gemma's scaling by 1 + weight in
fp32), forward and backward; the reference vs HF's modules bit for bit.

Tolerances (atol = rtol), kernel vs reference in the same dtype:
    fp32  1e-5 for y and dx; dW (a sum over rows, in another order) 1e-4 of its largest value
    bf16  2e-2 for y and dx, and dW within 2e-2 of its largest value: about 4 bf16 ulps; the
          reference rounds dy * weight and each dW product to bf16, the kernel keeps them in fp32,
          and a 1-ulp difference in the rounded n can move y by an ulp
Under the CPU interpreter bf16 sits up to an ulp further: it truncates fp32 -> bf16 where the GPU
rounds to nearest even.
"""

import pytest
import torch
from fp8_checks import assert_fp8_rows

import lightning_ft.kernels.rms_norm as rms_norm_module
from lightning_ft.kernels.rms_norm import rms_norm, rms_norm_reference

TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2)}  # dtype -> (y/dx tol, dW tol)
EPS = 1e-6


# (offset, fp32_scale): Llama's norm, Gemma's, and the two mixed
STYLES = {"llama": (0.0, False), "gemma": (1.0, True), "offset_only": (1.0, False), "fp32_scale_only": (0.0, True)}


def _run(fn, x, weight, dy, style):
    offset, fp32_scale = STYLES[style]
    x = x.detach().clone().requires_grad_(x.requires_grad)
    weight = weight.detach().clone().requires_grad_(weight.requires_grad)
    y = fn(x, weight, EPS, offset=offset, fp32_scale=fp32_scale)
    y.backward(dy)
    return y, x.grad, weight.grad


def _check(x, weight, style="llama"):
    torch.manual_seed(1)
    y_dtype = x.dtype if STYLES[style][1] else torch.promote_types(x.dtype, weight.dtype)
    dy = torch.randn(x.shape, dtype=y_dtype, device=x.device)
    y, dx, dw = _run(rms_norm, x, weight, dy, style)
    y_ref, dx_ref, dw_ref = _run(rms_norm_reference, x, weight, dy, style)
    tol, tol_dw = TOL[x.dtype]
    assert y.dtype == y_ref.dtype == y_dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    if x.requires_grad:
        torch.testing.assert_close(dx, dx_ref, atol=tol, rtol=tol)
    if weight.requires_grad:
        assert dw.dtype == weight.dtype
        torch.testing.assert_close(dw, dw_ref, atol=tol_dw * dw_ref.abs().max().item(), rtol=tol_dw)
    else:
        assert dw is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        (2, 5, 200),  # hidden not a power of two
        (1, 1, 64),  # T=1
        (2, 3, 4, 128),  # Qwen3 q/k norm: [B, T, H, head_dim]
        (3, 2880),
        (2, 5120),  # BLOCK_N = 8192 > one tile: one row per program
        (67, 96),  # many rows per program, a ragged last row block
    ],
)
def test_matches_reference(device, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    weight = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
    _check(x, weight)


@pytest.mark.parametrize("style", ["gemma", "offset_only", "fp32_scale_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 200), (2, 3, 4, 16), (37, 72)])
def test_offset_and_fp32_scale_match_reference(device, dtype, shape, style):
    """Weights around 0, as Gemma's (1 + weight) keeps them; the gradient of the weight is as without the offset."""
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    weight = (0.1 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
    _check(x, weight, style)


def test_gemma_style_bf16_input_fp32_weight_returns_bf16_like_hf(device):
    x = torch.randn(3, 7, 160, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (0.1 * torch.randn(160, device=device)).requires_grad_()
    assert rms_norm(x, weight, EPS, offset=1.0, fp32_scale=True).dtype == torch.bfloat16
    _check(x, weight, "gemma")


@pytest.mark.parametrize("style", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hf_bit_for_bit(dtype, style):
    """The reference rounds where HF's LlamaRMSNorm / Gemma3RMSNorm round: forward and backward equal."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    hf = (LlamaRMSNorm if style == "llama" else Gemma3RMSNorm)(200, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(200))
    x = torch.randn(3, 5, 200, dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 5, 200, dtype=dtype)
    expected = _run(lambda x, weight, eps, **_: hf(x), x, hf.weight, dy, style)[:2] + (hf.weight.grad,)
    for got, want in zip(_run(rms_norm_reference, x, hf.weight, dy, style), expected, strict=True):
        assert torch.equal(got, want)


def test_frozen_weight_skips_dw(device):
    x = torch.randn(4, 3, 96, device=device, requires_grad=True)
    _check(x, torch.rand(96, device=device) + 0.5)


def test_bf16_input_fp32_weight_promotes_like_hf(device):
    # Under autocast with fp32 master weights HF's RMSNorm returns fp32 for a bf16 input.
    x = torch.randn(3, 7, 160, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.rand(160, device=device) + 0.5).requires_grad_()
    y = rms_norm(x, weight, EPS)
    assert y.dtype == torch.float32
    _check(x, weight)


def test_non_contiguous_input(device):
    base = torch.randn(6, 4, 200, device=device)
    x = base.transpose(0, 1).requires_grad_()  # [4, 6, 200], rows not evenly strided
    _check(x, (torch.rand(200, device=device) + 0.5).requires_grad_())


def test_falls_back_to_reference_where_triton_cannot_run(monkeypatch):
    monkeypatch.setattr(rms_norm_module, "triton_can_run", lambda t: False)
    rms_norm_module.warn_fallback.cache_clear()
    x, weight = torch.randn(3, 32), torch.rand(32)
    with pytest.warns(UserWarning, match="Triton cannot run"):
        y = rms_norm(x, weight, EPS)
    torch.testing.assert_close(y, rms_norm_reference(x, weight, EPS), atol=0, rtol=0)


@pytest.mark.gpu
def test_no_host_sync():
    x = torch.randn(8, 256, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rms_norm(x, weight, EPS).sum().backward()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rms_norm(x, weight, EPS).backward(torch.ones_like(x))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_double_backward_raises(device):
    """The kernel's backward is not differentiable: a second-order gradient raises, not a silent wrong value."""
    x = torch.randn(4, 32, device=device, requires_grad=True)
    weight = torch.randn(32, device=device, requires_grad=True)
    (dx,) = torch.autograd.grad(rms_norm(x, weight, EPS).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        dx.sum().backward()


@pytest.mark.parametrize("style", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 3, 37), (5, 19), (2, 2, 48)])
def test_fp8_rows_are_the_quantised_output(device, dtype, shape, style):
    offset, fp32_scale = STYLES[style]
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
    x.data[0, 0] = 0.0  # an all-zero row: zero values, no NaN
    weight = torch.randn(shape[-1], dtype=dtype, device=device)
    y, q, scale = rms_norm(x, weight, EPS, offset=offset, fp32_scale=fp32_scale, fp8_rows=True)
    assert_fp8_rows(y, q, scale)
    assert torch.equal(y, rms_norm(x, weight, EPS, offset=offset, fp32_scale=fp32_scale))  # y as without the rows
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    (dx_plain,) = torch.autograd.grad(rms_norm(x, weight, EPS, offset=offset, fp32_scale=fp32_scale), x, dy)
    assert torch.equal(dx, dx_plain)
