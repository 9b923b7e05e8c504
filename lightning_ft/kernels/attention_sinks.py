"""Attention sinks (gpt-oss) as a correction of a normal attention's output, fused: one pass each way.

A sink is a learned logit ``s_h`` per query head that joins every query's softmax denominator and is then
dropped. With ``out`` and ``lse`` a normal attention's output [T, H, D] and log-sum-exp [H, T] (over the
keys alone), the output with the sink is

    y = out · w,    w = σ(lse − s_h)                                        (one weight per token and head)

since ``exp(x) / (Σ exp + exp(s)) = softmax(x) · 1 / (1 + exp(s − lse))``. Its backward, with dy the
output gradient (`lightning_ft.model.attention_kernels` explains why the attention kernel's own backward,
called with ``dO = dy·w`` and ``O = out·w``, then gives exact dq, dk, dv):

    dO = dy · w        O = out · w        ds_h = −Σ_t rowsum(dy ∘ out) · w (1 − w)

In torch ops this is a dozen passes over [T, H, D] tensors (fp32 copies of out and dy, products, casts, a
row sum): profiled on the H100 at 8K tokens of gpt-oss-20b (64 heads of 64), about a millisecond per
layer. Here the forward reads out once and writes y; the backward reads dy and out once and writes dO, O
and one partial sum of ds per block of tokens and head (summed in torch after, in a fixed order). w is
recomputed from lse (fp32) in both. fp32 math, rounded once to out's dtype.

Sources: transformers ``models/gpt_oss/modeling_gpt_oss.py`` (``eager_attention_forward``: the sink as
one more logit of the softmax, dropped after); the closed-form correction and its backward as in
`lightning_ft.model.attention_kernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import num_warps_for, triton_can_run, warn_fallback

__all__ = ["sink_backward", "sink_backward_reference", "sink_forward", "sink_forward_reference"]

_BLOCK_T = 32


@triton.jit
def _sink_weights(LSE, S, h, rows, row_mask, stride_lh, stride_lt):
    """fp32 w = σ(lse − s_h) of ``rows`` of head ``h`` (0 where masked)."""
    lse = tl.load(LSE + h * stride_lh + rows * stride_lt, mask=row_mask, other=float("-inf")).to(tl.float32)
    return tl.sigmoid(lse - tl.load(S + h).to(tl.float32))


@triton.jit
def _sink_fwd_kernel(O, LSE, S, Y, T, D, stride_ot, stride_oh, stride_yt, stride_yh, stride_lh, stride_lt,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(1).to(tl.int64)  # h × a head stride may pass 2³¹ (a [1, H, T, D] tensor seen as [T, H, D])
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < T
    mask = row_mask[:, None] & (cols[None, :] < D)
    w = _sink_weights(LSE, S, h, rows, row_mask, stride_lh, stride_lt)
    o = tl.load(O + rows[:, None] * stride_ot + h * stride_oh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_yt + h * stride_yh + cols[None, :], (o * w[:, None]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _sink_bwd_kernel(DY, O, LSE, S, DO, OW, PARTIAL, T, D, H, stride_dyt, stride_dyh, stride_ot, stride_oh,
                     stride_dot, stride_doh, stride_owt, stride_owh, stride_lh, stride_lt,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    block = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # h × a head stride may pass 2³¹ (a [1, H, T, D] tensor seen as [T, H, D])
    rows = (block * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < T
    mask = row_mask[:, None] & (cols[None, :] < D)
    w = _sink_weights(LSE, S, h, rows, row_mask, stride_lh, stride_lt)
    dy = tl.load(DY + rows[:, None] * stride_dyt + h * stride_dyh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + rows[:, None] * stride_ot + h * stride_oh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    grad_lse = tl.sum(dy * o, axis=1) * w * (1.0 - w)
    tl.store(DO + rows[:, None] * stride_dot + h * stride_doh + cols[None, :], (dy * w[:, None]).to(DO.dtype.element_ty), mask=mask)
    tl.store(OW + rows[:, None] * stride_owt + h * stride_owh + cols[None, :], (o * w[:, None]).to(OW.dtype.element_ty), mask=mask)
    tl.store(PARTIAL + block * H + h, tl.sum(tl.where(row_mask, grad_lse, 0.0), axis=0))


def _reference_weights(out_THD: torch.Tensor, lse_HT: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """w = σ(lse − sink) as [T, H, 1], in fp32 (fp64 for fp64 inputs)."""
    acc = torch.promote_types(out_THD.dtype, torch.float32)
    return torch.sigmoid(lse_HT.to(acc) - sinks.to(acc)[:, None]).t()[:, :, None]


def sink_forward_reference(out_THD: torch.Tensor, lse_HT: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out · σ(lse − sink)`` in plain torch (fp32 math, rounded once to out's dtype): [T, H, D]."""
    weights = _reference_weights(out_THD, lse_HT, sinks)
    return (out_THD.to(weights.dtype) * weights).to(out_THD.dtype)


def sink_backward_reference(
    grad_THD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy·w, out·w, the sinks' gradient) in plain torch: [T, H, D], [T, H, D] in out's dtype; [H] fp32 (fp64 for
    fp64 inputs)."""
    weights = _reference_weights(out_THD, lse_HT, sinks)
    dy, o = grad_THD.to(weights.dtype), out_THD.to(weights.dtype)
    grad_lse = (dy * o).sum(-1, keepdim=True) * weights * (1 - weights)
    return (dy * weights).to(out_THD.dtype), (o * weights).to(out_THD.dtype), -grad_lse.sum(dim=(0, 2))


def _check(name: str, out_THD: torch.Tensor, lse_HT: torch.Tensor, sinks: torch.Tensor, grad_THD: torch.Tensor | None = None):
    T, H = out_THD.shape[:2] if out_THD.dim() == 3 else (-1, -1)
    if out_THD.dim() != 3 or tuple(lse_HT.shape) != (H, T) or tuple(sinks.shape) != (H,) or (
            grad_THD is not None and grad_THD.shape != out_THD.shape):
        shapes = [tuple(t.shape) for t in (out_THD, lse_HT, sinks, grad_THD) if t is not None]
        raise ValueError(f"{name}: expected out [T, H, D], lse [H, T], sinks [H] (and the gradient like out), got {shapes}")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _grid(T: int, H: int) -> tuple[int, int]:
    return triton.cdiv(T, _BLOCK_T), H


def _launch(D: int) -> dict[str, int]:
    block_d = triton.next_power_of_2(D)
    return dict(BLOCK_T=_BLOCK_T, BLOCK_D=block_d, num_warps=num_warps_for(_BLOCK_T * block_d))


def sink_forward(out_THD: torch.Tensor, lse_HT: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The attention output with sinks, ``out · σ(lse − sink)`` (the module docstring), in one Triton pass.

    Args:
        out_THD: [T, H, D] the attention's output (any token and head strides), bf16, fp16 or fp32 (fp64 runs
            the plain-torch reference).
        lse_HT: [H, T] its log-sum-exp (any strides), fp32.
        sinks: [H] the sink logits (any float dtype, any stride).

    Returns:
        [T, H, D] in out's dtype, laid out like out. Not differentiable itself: `sink_backward` is its backward.

    Raises:
        ValueError: shapes other than these.
    """
    _check("sink_forward", out_THD, lse_HT, sinks)
    if out_THD.dtype == torch.float64:  # the kernel computes in fp32: fp64 keeps its precision in the reference
        return sink_forward_reference(out_THD, lse_HT, sinks)
    if not triton_can_run(out_THD):
        warn_fallback("sink_forward", out_THD.device)
        return sink_forward_reference(out_THD, lse_HT, sinks)
    out_THD, sinks = _unit_last(out_THD), sinks.contiguous()
    T, H, D = out_THD.shape
    y = torch.empty_like(out_THD)
    if T:
        _sink_fwd_kernel[_grid(T, H)](
            out_THD, lse_HT, sinks, y, T, D, out_THD.stride(0), out_THD.stride(1), y.stride(0), y.stride(1),
            lse_HT.stride(0), lse_HT.stride(1), **_launch(D),
        )  # fmt: skip
    return y


def sink_backward(
    grad_THD: torch.Tensor, out_THD: torch.Tensor, lse_HT: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sink_forward`'s backward in one Triton pass (the module docstring's math).

    Args:
        grad_THD: [T, H, D] the gradient of `sink_forward`'s output; out_THD, lse_HT, sinks: its inputs.

    Returns:
        (dy·w, out·w): [T, H, D] each in out's dtype, the output gradient and output to call the attention
        kernel's backward with; and the sinks' gradient [H] fp32.

    Raises:
        ValueError: shapes other than these.
    """
    _check("sink_backward", out_THD, lse_HT, sinks, grad_THD)
    if out_THD.dtype == torch.float64:  # the kernel computes in fp32: fp64 keeps its precision in the reference
        return sink_backward_reference(grad_THD, out_THD, lse_HT, sinks)
    if not triton_can_run(out_THD):
        warn_fallback("sink_backward", out_THD.device)
        return sink_backward_reference(grad_THD, out_THD, lse_HT, sinks)
    grad_THD, out_THD, sinks = _unit_last(grad_THD), _unit_last(out_THD), sinks.contiguous()
    T, H, D = out_THD.shape
    grad_out, out_w = torch.empty_like(out_THD), torch.empty_like(out_THD)
    blocks, _ = _grid(T, H)
    partial = torch.zeros(max(blocks, 1), H, dtype=torch.float32, device=out_THD.device)
    if T:
        _sink_bwd_kernel[blocks, H](
            grad_THD, out_THD, lse_HT, sinks, grad_out, out_w, partial, T, D, H,
            grad_THD.stride(0), grad_THD.stride(1), out_THD.stride(0), out_THD.stride(1),
            grad_out.stride(0), grad_out.stride(1), out_w.stride(0), out_w.stride(1),
            lse_HT.stride(0), lse_HT.stride(1), **_launch(D),
        )  # fmt: skip
    return grad_out, out_w, -partial.sum(0)
