"""The fused attention-sink correction (gpt-oss) vs its plain-torch reference, and the reference vs the sink as one more
softmax logit (transformers' eager attention).

Tolerances, kernel vs the reference on the same inputs (both compute in fp32 and round once to out's dtype):
    fp32  1e-6
    bf16  one bf16 ulp of the values (8e-3 relative), the sinks' gradient (an fp32 sum) 1e-5
"""

import pytest
import torch

from lightning_ft.kernels.attention_sinks import sink_backward, sink_backward_reference, sink_forward, sink_forward_reference

TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


def _inputs(T, H, D, dtype, device, layout="THD", seed=0):
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(T, H, D, generator=g).to(dtype)
    if layout == "BHTD":  # [T, H, D] seen through a [1, H, T, D] tensor, as the CPU flash kernel's output
        out = out.transpose(0, 1).contiguous().transpose(0, 1)
    lse = (3 * torch.randn(H * T, generator=g)).reshape(H, T)
    sinks = torch.randn(H, generator=g).to(dtype)
    grad = torch.randn(T, H, D, generator=g).to(dtype)
    return [t.to(device) for t in (out, lse, sinks, grad)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, H, D", [(37, 3, 64), (1, 1, 8), (0, 4, 64), (70, 5, 40), (33, 2, 256)])
@pytest.mark.parametrize("layout", ["THD", "BHTD"])
def test_matches_reference(device, dtype, T, H, D, layout):
    """Odd token counts (a partial block), zero tokens, head dims not a power of two, the BHTD kernels' strides."""
    out, lse, sinks, grad = _inputs(T, H, D, dtype, device, layout)
    y = sink_forward(out, lse, sinks)
    assert y.dtype == dtype and y.shape == out.shape and y.stride() == out.stride()
    torch.testing.assert_close(y, sink_forward_reference(out, lse, sinks), atol=TOL[dtype], rtol=TOL[dtype])
    for got, ref in zip(sink_backward(grad, out, lse, sinks), sink_backward_reference(grad, out, lse, sinks), strict=True):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        tol = 1e-5 if ref.dtype == torch.float32 and dtype != torch.float32 else TOL[dtype]
        torch.testing.assert_close(got, ref, atol=tol * max(1.0, ref.abs().max().item() if ref.numel() else 1.0), rtol=tol)


def test_reference_is_the_sink_as_one_more_softmax_logit():
    """fp32: out·σ(lse − s) equals softmax over the keys and the sink, the sink's column dropped, times v; the
    reference's backward (with the kernel's backward done by autograd here) gives the same gradients as autograd
    through that softmax, the sink's included."""
    torch.manual_seed(0)
    T, H, D = 6, 2, 4
    q, k, v = (torch.randn(H, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(H, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = (q @ k.transpose(1, 2)).masked_fill(~mask, float("-inf"))
    with_sink = torch.cat([scores, sinks[:, None, None].expand(H, T, 1)], dim=-1).softmax(-1)[..., :T]
    expected = (with_sink @ v).transpose(0, 1)  # [T, H, D]
    out = (scores.softmax(-1) @ v).transpose(0, 1)
    lse = scores.logsumexp(-1)
    got = sink_forward_reference(out, lse, sinks)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)

    dy = torch.randn(T, H, D, dtype=torch.float64)
    grads = torch.autograd.grad(expected, (q, k, v, sinks), dy, retain_graph=True)
    grad_scaled, out_scaled, grad_sinks = sink_backward_reference(dy, out.detach(), lse.detach(), sinks.detach())
    # the attention kernel's backward given (dO, O) = (dy·w, out·w): dS = P ∘ (dO vᵀ − Δ) with Δ = rowsum(dO ∘ O).
    # Autograd through out with dO gives the same with Δ from the true out; the difference, P ∘ (Δ_true − Δ), is
    # autograd through lse (∂lse/∂S = P) weighted by Δ_true − Δ.
    delta_kernel = (grad_scaled * out_scaled).sum(-1).t()  # [H, T]
    delta_true = (grad_scaled * out.detach()).sum(-1).t()
    plain = torch.autograd.grad((out * grad_scaled).sum(), (q, k, v), retain_graph=True)
    lse_term = torch.autograd.grad((lse * (delta_true - delta_kernel)).sum(), (q, k), retain_graph=True)
    torch.testing.assert_close(plain[2], grads[2], atol=1e-12, rtol=1e-12)  # dv
    for got_grad, want in zip((plain[0] + lse_term[0], plain[1] + lse_term[1]), grads[:2]):
        torch.testing.assert_close(got_grad, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(grad_sinks, grads[3], atol=1e-12, rtol=1e-12)


def test_bad_shapes_are_refused():
    out, lse, sinks, grad = _inputs(5, 3, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"sink_forward: expected out \[T, H, D\], lse \[H, T\], sinks \[H\]"):
        sink_forward(out, lse.t(), sinks)
    with pytest.raises(ValueError, match="sink_backward"):
        sink_backward(grad[:4], out, lse, sinks)
    with pytest.raises(ValueError, match="sink_forward"):
        sink_forward(out[0], lse, sinks)


def test_fp64_runs_the_reference_exactly(device):
    """The kernel computes in fp32: fp64 inputs take the reference, bit for bit."""
    out, lse, sinks, grad = (t.double() for t in _inputs(9, 2, 16, torch.float32, device))
    assert torch.equal(sink_forward(out, lse, sinks), sink_forward_reference(out, lse, sinks))
    for got, ref in zip(sink_backward(grad, out, lse, sinks), sink_backward_reference(grad, out, lse, sinks), strict=True):
        assert got.dtype == torch.float64 and torch.equal(got, ref)


def test_strided_sinks_and_head_offsets_past_int32(device):
    """A strided sinks vector; a head stride whose multiples pass 2³¹ elements (a [1, H, T, D] tensor seen as
    [T, H, D] at long T): the offsets are 64-bit. The big tensor is an expanded view of a small one (no 2³¹ bytes)."""
    out, lse, sinks, grad = _inputs(7, 4, 16, torch.float32, device)
    strided = torch.stack([sinks, sinks + 1], dim=1)[:, 0]
    assert strided.stride(0) == 2
    torch.testing.assert_close(sink_forward(out, lse, strided), sink_forward_reference(out, lse, sinks), atol=1e-6, rtol=1e-6)
    for got, ref in zip(sink_backward(grad, out, lse, strided), sink_backward_reference(grad, out, lse, sinks), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if device.type != "cpu":
        return  # below: a 4 GiB storage, only reserved on the CPU (a few pages touched), allocated on a GPU
    head_stride = 2**30 + 64
    storage = torch.empty(2 * head_stride + 16, dtype=torch.bfloat16)  # never written but for the three heads' rows
    far = torch.as_strided(storage, (1, 3, 16), (16, head_stride, 1))
    far.copy_(torch.randn(1, 3, 16).bfloat16())
    lse, sinks = torch.randn(3, 1), torch.randn(3)
    torch.testing.assert_close(sink_forward(far, lse, sinks), sink_forward_reference(far.clone(), lse, sinks), atol=8e-3, rtol=8e-3)
    for got, ref in zip(sink_backward(far, far, lse, sinks), sink_backward_reference(far.clone(), far.clone(), lse, sinks), strict=True):
        torch.testing.assert_close(got, ref, atol=8e-3 if got.dtype == torch.bfloat16 else 1e-5, rtol=8e-3)
