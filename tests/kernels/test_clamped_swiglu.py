"""gpt-oss's fused clamped SwiGLU (interleaved gate/up, expert bias, routing weight) vs transformers' math in plain torch.

Tolerances (atol = rtol, atol scaled by the reference's largest magnitude / 8 as in test_swiglu), kernel vs the
reference computed in fp32 on the same values (so both clamp the same elements):
    fp32  1e-5
    bf16  2e-2  (the kernel rounds once to bf16; the row weight's and the bias's gradients are sums rounded once)
"""

import pytest
import torch

from lightning_ft.kernels.clamped_swiglu import clamped_swiglu, clamped_swiglu_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ALPHA, LIMIT = 1.702, 7.0


def _grads(fn, h, weight, bias, expert, dy, cast):
    leaves = [None if t is None else t.to(cast).clone().requires_grad_() for t in (h, weight, bias)]
    y = fn(leaves[0], ALPHA, LIMIT, leaves[1], leaves[2], expert)
    y.backward(dy.to(cast))
    return [y] + [leaf.grad for leaf in leaves if leaf is not None]


@pytest.mark.parametrize("biased", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "row_weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter,experts", [(37, 45, 3), (1, 8, 1), (0, 64, 2), (9, 2880, 5), (5, 1500, 4)])
def test_matches_reference(device, dtype, rows, inter, experts, weighted, biased):
    """Values spread well past ±limit (both clamps active); I = 45 (odd), 1500 and 2880 (several column blocks,
    whose partial sums make the row weight's gradient); zero rows; an expert with no rows (ids drawn from fewer
    than E)."""
    torch.manual_seed(0)
    h = (6 * torch.randn(rows, 2 * inter, device=device)).to(dtype)
    weight = torch.rand(rows, device=device).to(dtype) if weighted else None
    bias = torch.randn(experts, 2 * inter, device=device).to(dtype) if biased else None
    expert = torch.randint(0, max(experts - 1, 1), (rows,), device=device) if biased else None
    dy = torch.randn(rows, inter, device=device).to(dtype)
    outs = _grads(clamped_swiglu, h, weight, bias, expert, dy, dtype)
    refs = _grads(clamped_swiglu_reference, h, weight, bias, expert, dy, torch.float32)
    assert len(outs) == 2 + weighted + biased
    for out, ref in zip(outs, refs, strict=True):
        assert out.dtype == dtype and out.shape == ref.shape
        scale = ref.abs().max().item() if ref.numel() else 1.0
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype] * max(1.0, scale / 8), rtol=TOL[dtype])


def test_clamp_boundaries_pass_gradient_as_torch_clamp_does(device):
    """At exactly ±limit the gradient passes (torch's clamp: min ≤ x ≤ max); just past it, none."""
    just_over = torch.nextafter(torch.tensor(LIMIT), torch.tensor(100.0)).item()
    gate = torch.tensor([LIMIT, just_over, -LIMIT, -3.0], device=device)
    up = torch.tensor([LIMIT, -LIMIT, just_over, -just_over], device=device)
    h = torch.stack([gate, up], dim=-1).reshape(1, -1)
    dy = torch.ones(1, 4, device=device)
    outs = _grads(clamped_swiglu, h, None, None, None, dy, torch.float32)
    refs = _grads(clamped_swiglu_reference, h, None, None, None, dy, torch.float32)
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    d_gate, d_up = refs[1][0, 0::2], refs[1][0, 1::2]
    assert (d_gate[[0, 2, 3]] != 0).all() and d_gate[1] == 0  # gate: clamped above only
    assert (d_up[:2] != 0).all() and (d_up[2:] == 0).all()


def test_nan_stays_nan(device):
    """A NaN in gate, up or the bias stays NaN in the output and in the gradients torch's clamp gives NaN
    (its clamped position gets none): a diverging run is not hidden."""
    nan = float("nan")
    h = torch.tensor([[nan, 1.0, 1.0, nan, 2.0, 3.0]], device=device)
    bias = torch.tensor([[0.0, 0.0, 0.0, 0.0, nan, 0.0]], device=device)
    expert, weight, dy = torch.zeros(1, dtype=torch.long, device=device), torch.ones(1, device=device), torch.ones(1, 3, device=device)
    outs = _grads(clamped_swiglu, h, weight, bias, expert, dy, torch.float32)
    refs = _grads(clamped_swiglu_reference, h, weight, bias, expert, dy, torch.float32)
    assert outs[0].isnan().all() and refs[0].isnan().all()
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_hold_the_same_values(device, dtype):
    """pad_out / pad_grad: the output and h's gradient are views of rows with spare columns, bit for bit the
    contiguous results; h may itself be a view of wider rows (the slotted GEMM's output)."""
    torch.manual_seed(0)
    wide = (6 * torch.randn(7, 2 * 24 + 16, device=device)).to(dtype)
    weight = torch.rand(7, device=device, dtype=dtype)
    bias, expert = torch.randn(3, 48, device=device, dtype=dtype), torch.randint(0, 3, (7,), device=device)
    dy = torch.randn(7, 24, device=device, dtype=dtype)
    results = []
    for pad_out, pad_grad in ((0, 0), (8, 16)):
        leaf, w = wide.clone().requires_grad_(), weight.clone().requires_grad_()
        h_input, grad_h = leaf[:, :48], []
        h_input.register_hook(grad_h.append)
        y = clamped_swiglu(h_input, ALPHA, LIMIT, w, bias, expert, pad_out=pad_out, pad_grad=pad_grad)
        y.backward(dy)
        assert y.stride() == (24 + pad_out, 1) and grad_h[0].stride() == (48 + pad_grad, 1)
        results.append((y, grad_h[0], w.grad))
    for plain, padded in zip(*results, strict=True):
        torch.testing.assert_close(padded, plain, rtol=0, atol=0)


def test_bad_arguments_are_refused(device):
    h = torch.randn(4, 10, device=device)
    with pytest.raises(ValueError, match=r"expected h \[rows, 2I\] of interleaved gate/up, got \(4, 9\)"):
        clamped_swiglu(h[:, :9], ALPHA, LIMIT)
    with pytest.raises(ValueError, match=r"row_weight must be \[4\]"):
        clamped_swiglu(h, ALPHA, LIMIT, torch.ones(3, device=device))
    with pytest.raises(ValueError, match=r"bias_EF must be \[E, 10\] .* with expert_S \[4\]"):
        clamped_swiglu(h, ALPHA, LIMIT, None, torch.zeros(2, 10, device=device))
    with pytest.raises(ValueError, match=r"bias_EF must be \[E, 10\]"):
        clamped_swiglu(h, ALPHA, LIMIT, None, torch.zeros(2, 8, device=device), torch.zeros(4, dtype=torch.long, device=device))


@pytest.mark.gpu
def test_no_host_sync():
    h = torch.randn(8192, 5760, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.rand(8192, device="cuda", requires_grad=True)
    bias, expert = torch.randn(32, 5760, device="cuda", dtype=torch.bfloat16), torch.randint(0, 32, (8192,), device="cuda")
    clamped_swiglu(h, ALPHA, LIMIT, weight, bias, expert).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        clamped_swiglu(h, ALPHA, LIMIT, weight, bias, expert).backward(torch.ones(8192, 2880, device="cuda", dtype=torch.bfloat16))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fp64_runs_the_reference_exactly(device):
    """The kernel computes in fp32: fp64 inputs take the reference, bit for bit (values and gradients)."""
    torch.manual_seed(0)
    h = 6 * torch.randn(5, 16, device=device, dtype=torch.float64)
    weight = torch.rand(5, device=device, dtype=torch.float64)
    bias = torch.randn(2, 16, device=device, dtype=torch.float64)
    expert = torch.tensor([0, 1, 1, 0, 1], device=device)
    dy = torch.randn(5, 8, device=device, dtype=torch.float64)
    outs = _grads(clamped_swiglu, h, weight, bias, expert, dy, torch.float64)
    refs = _grads(clamped_swiglu_reference, h, weight, bias, expert, dy, torch.float64)
    for out, ref in zip(outs, refs, strict=True):
        assert out.dtype == torch.float64 and torch.equal(out, ref)
