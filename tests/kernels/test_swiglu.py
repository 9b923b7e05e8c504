"""SwiGLU / GeGLU kernels vs act(gate) * up in plain torch (silu, tanh-approximate GELU), forward and backward.

Tolerances (atol = rtol), kernel vs reference in the same dtype:
    fp32  1e-5
    bf16  2e-2  (the reference rounds act(gate) to bf16 before the product, the kernel rounds once)
Under the CPU interpreter bf16 sits up to an ulp further: it truncates fp32 -> bf16 where the GPU
rounds to nearest even.
"""

import pytest
import torch
from fp8_checks import assert_fp8_rows

from lightning_ft.kernels.swiglu import (
    ACTIVATIONS,
    swiglu,
    swiglu_concat,
    swiglu_concat_reference,
    swiglu_reference,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _run(fn, gate, up, dy, activation="silu"):
    gate = gate.detach().clone().requires_grad_()
    up = up.detach().clone().requires_grad_()
    y = fn(gate, up, activation)
    y.backward(dy)
    return y, gate.grad, up.grad


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 300), (1, 1, 96), (3, 2880), (1, 2, 14336)])
def test_matches_reference(device, dtype, shape, activation):
    torch.manual_seed(0)
    gate = 3 * torch.randn(shape, dtype=dtype, device=device)
    up = torch.randn(shape, dtype=dtype, device=device)
    dy = torch.randn(shape, dtype=dtype, device=device)
    outs = _run(swiglu, gate, up, dy, activation)
    refs = _run(swiglu_reference, gate, up, dy, activation)
    for out, ref in zip(outs, refs, strict=True):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_keeps_inputs_intact(device):
    gate, up = torch.randn(4, 50, device=device), torch.randn(4, 50, device=device)
    saved = gate.clone(), up.clone()
    _run(swiglu, gate, up, torch.randn(4, 50, device=device))
    assert torch.equal(gate, saved[0]) and torch.equal(up, saved[1])


def test_non_contiguous_inputs(device):
    gate_up = torch.randn(3, 5, 2 * 40, device=device)
    gate, up = gate_up.chunk(2, dim=-1)
    dy = torch.randn(3, 5, 40, device=device)
    for out, ref in zip(_run(swiglu, gate, up, dy), _run(swiglu_reference, gate, up, dy), strict=True):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_unknown_activation_is_refused(device):
    gate = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match=r"swiglu: activation must be one of \['silu', 'gelu_tanh'\], got 'gelu'"):
        swiglu(gate, gate, "gelu")
    with pytest.raises(ValueError, match="swiglu_concat: activation must be one of"):
        swiglu_concat(gate, activation="relu")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "row_weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(37, 768), (1, 40), (0, 64), (5, 1500), (3, 2880)])
def test_concat_layout_matches_reference(device, dtype, rows, inter, weighted, activation):
    """The MoE experts' layout: h = [gate | up] of one GEMM, one [rows, 2I] gradient back; with a
    row weight (the routing weight) its gradient too (I = 1500, 2880: several column blocks per row).

    Compared with the reference in fp32 on the same values: the weight's gradient is a sum over I
    products, which the bf16 reference rounds term by term (ours sums in fp32 and rounds once).
    """
    torch.manual_seed(0)
    h = (3 * torch.randn(rows, 2 * inter, device=device)).to(dtype)
    weight = torch.rand(rows, device=device).to(dtype) if weighted else None
    dy = torch.randn(rows, inter, device=device).to(dtype)
    results = []
    for fn, cast in ((swiglu_concat, dtype), (swiglu_concat_reference, torch.float32)):
        leaf = h.to(cast).clone().requires_grad_()
        w = weight.to(cast).clone().requires_grad_() if weighted else None
        y = fn(leaf, w, activation=activation)
        y.backward(dy.to(cast))
        results.append((y, leaf.grad) + ((w.grad,) if weighted else ()))
    for out, ref in zip(*results, strict=True):
        assert out.dtype == dtype and out.shape == ref.shape
        scale = ref.abs().max().item() if ref.numel() else 1.0
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype] * max(1.0, scale / 8), rtol=TOL[dtype])


def test_concat_row_weight_without_grad(device):
    """A frozen row weight still scales the output and the gradient of h; no weight gradient is made."""
    h = torch.randn(6, 2 * 40, device=device)
    weight = torch.rand(6, device=device)
    dy = torch.randn(6, 40, device=device)
    grads = []
    for fn in (swiglu_concat, swiglu_concat_reference):
        leaf = h.clone().requires_grad_()
        fn(leaf, weight).backward(dy)
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)
    assert weight.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concat_padded_rows_hold_the_same_values(device, dtype):
    """pad_out / pad_grad: the output and h's gradient are views of rows with spare columns (for a
    LoRA-augmented expert GEMM), bit for bit the contiguous results."""
    h = torch.randn(7, 2 * 24, device=device, dtype=dtype)
    weight = torch.rand(7, device=device, dtype=dtype)
    dy = torch.randn(7, 24, device=device, dtype=dtype)
    results = []
    for pad_out, pad_grad in ((0, 0), (8, 16)):
        leaf, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
        h_input, grad_h = leaf * 1, []  # a non-leaf: its hook sees the gradient as the kernel wrote it
        h_input.register_hook(grad_h.append)
        y = swiglu_concat(h_input, w, pad_out=pad_out, pad_grad=pad_grad)
        y.backward(dy)
        assert y.stride() == (24 + pad_out, 1) and grad_h[0].stride() == (48 + pad_grad, 1)
        results.append((y, grad_h[0], w.grad))
    for plain, padded in zip(*results):
        torch.testing.assert_close(padded, plain, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concat_h_copy_receives_h_and_changes_nothing_else(device, dtype):
    """h_copy (the MoE experts' kept gate/up buffer): written with h's values bit for bit, in rows of any
    stride (here a view of wider rows, whose other columns stay as they were); output and gradients
    unchanged. A buffer of another shape, dtype or column stride, with overlapping rows, or in h's
    memory is refused."""
    h = torch.randn(9, 2 * 40, device=device, dtype=dtype)
    weight = torch.rand(9, device=device, dtype=dtype)
    dy = torch.randn(9, 40, device=device, dtype=dtype)
    results = []
    wide = torch.full((9, 2 * 40 + 8), 7.0, device=device, dtype=dtype)
    for h_copy in (None, wide[:, :80]):
        leaf, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
        y = swiglu_concat(leaf, w, h_copy=h_copy)
        y.backward(dy)
        results.append((y, leaf.grad, w.grad))
    torch.testing.assert_close(wide[:, :80], h, rtol=0, atol=0)
    assert (wide[:, 80:] == 7).all()
    for plain, copied in zip(*results):
        torch.testing.assert_close(copied, plain, rtol=0, atol=0)
    overlapping_rows = torch.empty(9 * 40 + 40, device=device, dtype=dtype).as_strided((9, 80), (40, 1))
    shares_h = torch.empty(9, 81, device=device, dtype=dtype)
    for bad in (torch.empty(9, 78, device=device, dtype=dtype), torch.empty(9, 80, device=device, dtype=torch.float64),
                torch.empty(80, 9, device=device, dtype=dtype).t(), overlapping_rows,
                torch.empty(1, 80, device=device, dtype=dtype).expand(9, 80)):
        with pytest.raises(ValueError, match="h_copy must be"):
            swiglu_concat(h, weight, h_copy=bad)
    with pytest.raises(ValueError, match="share no memory with h"):  # h itself, or a view of h's memory
        swiglu_concat(shares_h[:, :80], weight, h_copy=shares_h[:, 1:])


@pytest.mark.gpu
def test_no_host_sync():
    gate = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    swiglu(gate, up).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        swiglu(gate, up).backward(torch.ones_like(gate))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 37), (5, 19), (1, 2, 2100)])  # 2100: a row over two column blocks
def test_fp8_rows_are_the_quantised_output(device, dtype, shape, activation):
    torch.manual_seed(0)
    gate = (3 * torch.randn(shape, dtype=dtype, device=device)).requires_grad_()
    up = torch.randn(shape, dtype=dtype, device=device)
    up.view(-1, shape[-1])[1] = 0.0  # an all-zero row: zero values, no NaN
    y, q, scale = swiglu(gate, up, activation, fp8_rows=True)
    assert_fp8_rows(y, q, scale)
    assert torch.equal(y, swiglu(gate, up, activation))  # y as without the rows
    dy = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, gate, dy)[0], torch.autograd.grad(swiglu(gate, up, activation), gate, dy)[0])
