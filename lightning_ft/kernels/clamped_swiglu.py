"""gpt-oss's clamped SwiGLU on interleaved gate/up columns, with the expert bias and routing weight, fused.

gpt-oss's experts compute h = x W_gate_up (+ LoRA) [S, F] whose columns interleave gate (even) and
up (odd), add the expert's bias b [F], and take

    gate = min(h[:, 0::2] + b[0::2], limit)      up = clamp(h[:, 1::2] + b[1::2], -limit, limit)
    y    = (up + 1) * gate * sigmoid(alpha * gate) * w                                  [S, F / 2]

(``alpha`` 1.702 and ``limit`` 7.0 in the published configs; w the row's routing weight where the
caller folds it in, as `lightning_ft.kernels.swiglu.swiglu_concat` does for SiLU experts). Written
out in torch this is a dozen elementwise passes over [S, F]-sized tensors per forward and more per
backward (32,768 routed rows × 5,760 columns at 8K tokens of gpt-oss-20b: 377 MB each), plus an
[S, F] tensor of gathered biases: profiled on the H100, a third of a gpt-oss step. Here it is one
pass each way: the forward reads h once and writes y; the backward reads h and dy and writes dh
(and the row weight's gradient, as one fp32 partial sum per block of columns), recomputing the
activation. The bias is read per row from the [E, F] table by the row's expert (``expert_S``),
never gathered into [S, F].

Math of the backward (torch's clamp passes gradient where min ≤ x ≤ max, as here), with
s = sigmoid(alpha * gate):

    d gate = dy * w * (up + 1) * (s + alpha * gate * s * (1 - s)) * [h_gate + b ≤ limit]
    d up   = dy * w * gate * s * [-limit ≤ h_up + b ≤ limit]
    d w    = Σ_cols dy * (up + 1) * gate * s
    d b_e  = Σ over expert e's rows of dh (only where the bias requires grad: full fine-tuning)

Everything is computed in fp32 registers and rounded once to h's dtype (transformers rounds after
each op in bf16: results differ by about one ulp).

Source: transformers ``models/gpt_oss/modeling_gpt_oss.py`` (``GptOssExperts._apply_gate``); the
fused forward/backward as in `lightning_ft.kernels.swiglu`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import num_warps_for, row_padded, triton_can_run, warn_fallback

__all__ = ["clamped_swiglu", "clamped_swiglu_reference"]

_BLOCK = 1024


@triton.jit
def _pair_offsets(cols, mask):
    """[BLOCK, 2] offsets of the interleaved (gate, up) pairs of columns ``cols`` and their mask: each pair is
    two adjacent elements, so a thread's pairs are one contiguous run (a coalesced, vectorised load) where two
    stride-2 loads each touch every cache line."""
    pair = tl.arange(0, 2)
    return 2 * cols[:, None] + pair[None, :], mask[:, None] & (pair[None, :] < 2)


@triton.jit
def _gate_up(H, B, EXPERT, row, cols, mask, stride_h, stride_b, HAS_BIAS: tl.constexpr):
    """fp32 (gate, up) before clamping: h's interleaved columns of ``row`` plus its expert's bias."""
    offs, pair_mask = _pair_offsets(cols, mask)
    h = tl.load(H + row * stride_h + offs, mask=pair_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        expert = tl.load(EXPERT + row).to(tl.int64)
        h += tl.load(B + expert * stride_b + offs, mask=pair_mask, other=0.0).to(tl.float32)
    return tl.split(h)


@triton.jit
def _clamped_swiglu_fwd_kernel(
    H, B, EXPERT, W, Y, n_cols, stride_h, stride_b, stride_y, alpha, limit,
    HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g, u = _gate_up(H, B, EXPERT, row, cols, mask, stride_h, stride_b, HAS_BIAS)
    g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)  # a NaN stays NaN, as in torch's clamp
    u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    y = (u + 1.0) * g * tl.sigmoid(alpha * g)
    if HAS_WEIGHT:
        y = y * tl.load(W + row).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _clamped_swiglu_bwd_kernel(
    DY, H, B, EXPERT, W, DH, DW, n_cols, stride_dy, stride_h, stride_b, stride_dh, stride_dw, alpha, limit,
    HAS_BIAS: tl.constexpr, HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row and block of columns (as the forward); with the weight's gradient, each program writes
    its block's fp32 partial sum to ``DW[row, block]`` (summed over the blocks after, in a fixed order)."""
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g_in, u_in = _gate_up(H, B, EXPERT, row, cols, mask, stride_h, stride_b, HAS_BIAS)
    g = tl.minimum(g_in, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.minimum(tl.maximum(u_in, -limit, propagate_nan=tl.PropagateNan.ALL), limit, propagate_nan=tl.PropagateNan.ALL)
    s = tl.sigmoid(alpha * g)
    a = g * s
    if WEIGHT_GRAD:
        tl.store(DW + row * stride_dw + block, tl.sum(dy * (u + 1.0) * a, axis=0))
    if HAS_WEIGHT:
        dy = dy * tl.load(W + row).to(tl.float32)
    dg = tl.where(g_in <= limit, dy * (u + 1.0) * (s + alpha * a * (1.0 - s)), 0.0)
    du = tl.where((u_in >= -limit) & (u_in <= limit), dy * a, 0.0)
    offs, pair_mask = _pair_offsets(cols, mask)
    tl.store(DH + row * stride_dh + offs, tl.join(dg, du).to(DH.dtype.element_ty), mask=pair_mask)


def _block(n_cols: int) -> int:
    return min(_BLOCK, triton.next_power_of_2(max(n_cols, 1)))


class ClampedSwiGLUFunction(torch.autograd.Function):
    """`clamped_swiglu` where Triton runs; saves h (and the bias, expert ids and weight)."""

    @staticmethod
    def forward(ctx, h, row_weight, bias_EF, expert_S, alpha, limit, pad_out, pad_grad):
        rows, n_cols = h.shape[0], h.shape[1] // 2
        y = row_padded(rows, n_cols, pad_out, h)
        block = _block(n_cols)
        if y.numel():
            _clamped_swiglu_fwd_kernel[(rows, triton.cdiv(n_cols, block))](
                h, h if bias_EF is None else bias_EF, h if expert_S is None else expert_S,
                h if row_weight is None else row_weight, y, n_cols, h.stride(0),
                0 if bias_EF is None else bias_EF.stride(0), y.stride(0), alpha, limit,
                HAS_BIAS=bias_EF is not None, HAS_WEIGHT=row_weight is not None, BLOCK=block,
                num_warps=num_warps_for(block),
            )  # fmt: skip
        ctx.save_for_backward(h, row_weight, bias_EF, expert_S)
        ctx.alpha, ctx.limit, ctx.pad_grad = alpha, limit, pad_grad
        return y

    @staticmethod
    def backward(ctx, dy):
        h, row_weight, bias_EF, expert_S = ctx.saved_tensors
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        rows, n_cols = h.shape[0], h.shape[1] // 2
        dh = row_padded(rows, 2 * n_cols, ctx.pad_grad, h)
        block = _block(n_cols)
        n_blocks = triton.cdiv(n_cols, block)
        # the weight's gradient: one fp32 partial sum per row and block of columns, summed below
        partial = torch.empty(rows, n_blocks, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[1] else None
        if dh.numel():
            _clamped_swiglu_bwd_kernel[(rows, n_blocks)](
                dy, h, h if bias_EF is None else bias_EF, h if expert_S is None else expert_S,
                h if row_weight is None else row_weight, dh, dh if partial is None else partial, n_cols,
                dy.stride(0), h.stride(0), 0 if bias_EF is None else bias_EF.stride(0), dh.stride(0),
                0 if partial is None else partial.stride(0), ctx.alpha, ctx.limit, HAS_BIAS=bias_EF is not None,
                HAS_WEIGHT=row_weight is not None, WEIGHT_GRAD=partial is not None, BLOCK=block,
                num_warps=num_warps_for(block),
            )  # fmt: skip
        elif partial is not None:
            partial.zero_()
        d_weight = None if partial is None else partial.sum(1).to(row_weight.dtype)
        d_bias = None
        if ctx.needs_input_grad[2]:
            d_bias = torch.zeros(bias_EF.shape, dtype=torch.float32, device=dh.device)
            d_bias = d_bias.index_add_(0, expert_S, dh.float()).to(bias_EF.dtype)
        return dh, d_weight, d_bias, None, None, None, None, None


def clamped_swiglu(
    h_SF: torch.Tensor,
    alpha: float,
    limit: float,
    row_weight: torch.Tensor | None = None,
    bias_EF: torch.Tensor | None = None,
    expert_S: torch.Tensor | None = None,
    *,
    pad_out: int = 0,
    pad_grad: int = 0,
) -> torch.Tensor:
    """gpt-oss's expert activation (the module docstring's math) on h [S, F] of interleaved gate/up columns → [S, F / 2].

    Args:
        h_SF: [S, F] (F even), the gate/up GEMM's output (any row stride, unit column stride), bf16, fp16 or fp32
            (fp64 runs the plain-torch reference: the kernel computes in fp32).
        alpha, limit: the experts' ``alpha`` and ``limit`` (1.702 and 7.0 in gpt-oss).
        row_weight: optional [S] routing weight per row (any float dtype), multiplied in before the one
            rounding; differentiable.
        bias_EF: optional [E, F] per-expert bias (``gate_up_proj_bias``), added to each row's h by the row's
            expert ``expert_S`` [S] (int64; `lightning_ft.kernels.moe.routing.expert_of_rows`); differentiable
            (its gradient summed per expert, in fp32).
        pad_out / pad_grad: where the kernel runs, the output is a view of [S, F/2 + pad_out] rows and h's
            gradient of [S, F + pad_grad] rows (`lightning_ft.kernels._utils.row_padded`: spare columns for
            the LoRA-slotted expert GEMMs); the plain-torch fallback returns contiguous tensors.

    Returns:
        [S, F / 2] in h's dtype.

    Raises:
        ValueError: h is not 2-D with an even number of columns; row_weight is not [S]; bias_EF is not
            [E, F] or comes without expert_S [S]; any of them on another device than h.
    """
    if h_SF.dim() != 2 or h_SF.shape[1] % 2:
        raise ValueError(f"clamped_swiglu: expected h [rows, 2I] of interleaved gate/up, got {tuple(h_SF.shape)}")
    rows, cols = h_SF.shape
    for name, t, shape in (("row_weight", row_weight, (rows,)), ("expert_S", expert_S, (rows,))):
        if t is not None and (tuple(t.shape) != shape or t.device != h_SF.device):
            raise ValueError(f"clamped_swiglu: {name} must be {list(shape)} on {h_SF.device}, "
                             f"got {list(t.shape)} on {t.device}")
    if bias_EF is not None and (bias_EF.dim() != 2 or bias_EF.shape[1] != cols or expert_S is None
                                or bias_EF.device != h_SF.device):
        raise ValueError(f"clamped_swiglu: bias_EF must be [E, {cols}] on {h_SF.device} with expert_S [{rows}], got "
                         f"{list(bias_EF.shape)} on {bias_EF.device} and expert_S {expert_S is not None}")
    if h_SF.dtype == torch.float64:  # the kernel computes in fp32: fp64 keeps its precision in the reference
        return clamped_swiglu_reference(h_SF, alpha, limit, row_weight, bias_EF, expert_S)
    if not triton_can_run(h_SF):
        warn_fallback("clamped_swiglu", h_SF.device)
        return clamped_swiglu_reference(h_SF, alpha, limit, row_weight, bias_EF, expert_S)
    h = h_SF if h_SF.stride(-1) == 1 else h_SF.contiguous()
    weight = None if row_weight is None else row_weight.contiguous()
    bias = None if bias_EF is None else bias_EF if bias_EF.stride(-1) == 1 else bias_EF.contiguous()
    expert = None if bias is None else expert_S.contiguous()
    return ClampedSwiGLUFunction.apply(h, weight, bias, expert, float(alpha), float(limit), pad_out, pad_grad)


def clamped_swiglu_reference(
    h_SF: torch.Tensor,
    alpha: float,
    limit: float,
    row_weight: torch.Tensor | None = None,
    bias_EF: torch.Tensor | None = None,
    expert_S: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, op for op as transformers' ``GptOssExperts`` (bias added to h, then ``_apply_gate``), times the
    row weight (cast to h's dtype)."""
    if bias_EF is not None:
        h_SF = h_SF + bias_EF.index_select(0, expert_S)
    gate = h_SF[..., ::2].clamp(min=None, max=limit)
    up = h_SF[..., 1::2].clamp(min=-limit, max=limit)
    y = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return y if row_weight is None else y * row_weight.to(y.dtype)[:, None]
