"""RMSNorm, forward and backward in one pass each (Llama / Qwen3 / Qwen3-MoE, q/k norms included; Gemma 3).

Math, per row x of length N (the last dim), with w = weight + offset (offset 0 for HF's
LlamaRMSNorm / Qwen3RMSNorm, 1 for Gemma3RMSNorm's ``(1 + weight)``; the sum taken in fp32):

    rstd = 1 / sqrt(mean(x.float() ** 2) + eps)
    n32  = x.float() * rstd

then, as HF's LlamaRMSNorm (``fp32_scale=False``):

    n    = n32.to(x.dtype)                              # rounded to the input dtype
    y    = w * n                                        # in promote(x.dtype, weight.dtype)

or as HF's Gemma3RMSNorm (``fp32_scale=True``): y = (n32 * w).to(x.dtype), rounded once.

Gradients, with dn = dy * w (the offset included) and n the value y was scaled from (rounded n for
Llama's order, n32 for Gemma's):

    dx = rstd * (dn - n32 * mean(dn * n32))
    dW = sum over rows of dy * n                        # the offset does not change it

Accumulation: everything in fp32 in registers. dW is reduced without atomics: a persistent grid of
P programs (4 per SM) each walks its own contiguous range of rows and writes one fp32 partial row,
then a [P, N] -> [N] sum gives dW, cast to weight.dtype. dW is skipped when weight does not require
grad (LoRA). Saved for backward: x (input dtype) and rstd (fp32 [M]), nothing else.

With ``fp8_rows`` the forward also writes y's rows in e4m3 and their fp32 scales (amax(|y|) / 448 of
the rounded y, `lightning_ft.kernels.fp8.quantize_rows`' math) for an fp8 GEMM that reads y: the
row is whole in the program's registers, so this costs one more write of M·N bytes.

Shapes: x [..., N] with any leading dims (flattened to M rows), weight [N]; N need not be a power of
two (2880, 5120, 128 for the q/k norms all work). Tiles are [BLOCK_M, BLOCK_N] with BLOCK_N the
next power of two of N and BLOCK_M > 1 rows per program when N is small.

Source: the RMSNorm of Zhang & Sennrich (2019) with HF transformers' rounding orders; the
persistent-grid dW reduction is the usual one (Triton's layer-norm tutorial, Liger Kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from lightning_ft.kernels._utils import num_warps_for, persistent_programs, triton_can_run, warn_fallback
from lightning_ft.kernels.fp8 import fp8_rows_done, fp8_rows_like, quantize_rows, quantize_rows_tile

_TILE_ELEMS = 4096  # values per tensor per program: BLOCK_M * BLOCK_N


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD, Q, QSCALE,
    stride_x, stride_y,
    M, N, eps, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_SCALE: tl.constexpr, FP8_ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)

    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    n = x * rstd[:, None]
    if not FP32_SCALE:
        n = n.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    y = (w[None, :] * n).to(Y.dtype.element_ty)
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y, mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    if FP8_ROWS:  # y's rows in e4m3 for the next GEMM (`lightning_ft.kernels.fp8.quantize_rows`, from the rounded y)
        q, q_scale = quantize_rows_tile(y.to(tl.float32))
        tl.store(Q + rows64[:, None] * N + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
        tl.store(QSCALE + rows, q_scale, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_x, stride_dx,
    M, N, rows_per_program, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COMPUTE_DW: tl.constexpr, FP32_SCALE: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)

        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)

        n = x * rstd[:, None]
        dn = dy * w[None, :]
        dx = rstd[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / N)[:, None])
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            if FP32_SCALE:
                dw += dy * n
            else:
                dw += dy * n.to(X.dtype.element_ty).to(tl.float32)

    if COMPUTE_DW:
        tl.store(DW_PARTIAL + pid * N + cols, tl.sum(dw, axis=0), mask=col_mask)


def _tile(n_cols: int) -> tuple[int, int]:
    block_n = triton.next_power_of_2(n_cols)
    return max(1, _TILE_ELEMS // block_n), block_n


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, fp32_scale: bool, fp8_rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Launch the forward kernel. Returns (y, x as [M, N] rows, rstd fp32 [M], y's fp8 rows or None):
    with ``fp8_rows``, (q [M, N] e4m3, scale [M] fp32) as `lightning_ft.kernels.fp8.quantize_rows` of y."""
    n_cols = x.shape[-1]
    x2d = x.reshape(-1, n_cols)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    n_rows = x2d.shape[0]
    y_dtype = x.dtype if fp32_scale else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty((n_rows, n_cols), dtype=y_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rows = fp8_rows_like(y) if fp8_rows else None
    if n_rows > 0:
        block_m, block_n = _tile(n_cols)
        _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
            x2d, weight, y, rstd, *(rows if rows is not None else (y, rstd)),
            x2d.stride(0), y.stride(0),
            n_rows, n_cols, eps, float(offset),
            BLOCK_M=block_m, BLOCK_N=block_n, FP32_SCALE=fp32_scale, FP8_ROWS=fp8_rows,
            num_warps=num_warps_for(block_m * block_n),
        )
    return y.view(*x.shape[:-1], n_cols), x2d, rstd, rows if rows is None else fp8_rows_done(rows)


def rms_norm_backward(
    dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float, fp32_scale: bool,
    compute_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel. Returns (dx [M, N] in x's dtype, dW in weight's dtype or None)."""
    n_rows, n_cols = x2d.shape
    dy2d = dy.reshape(-1, n_cols)
    if dy2d.stride(-1) != 1:
        dy2d = dy2d.contiguous()
    dx = torch.empty_like(x2d)
    if n_rows == 0:
        return dx, torch.zeros_like(weight) if compute_dw else None
    block_m, block_n = _tile(n_cols)
    row_blocks = triton.cdiv(n_rows, block_m)
    rows_per_program = triton.cdiv(row_blocks, min(row_blocks, persistent_programs(x2d.device))) * block_m
    programs = triton.cdiv(n_rows, rows_per_program)
    # Without dW the kernel never touches DW_PARTIAL; rstd stands in for the pointer.
    dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x2d.device) if compute_dw else rstd
    _rms_norm_bwd_kernel[(programs,)](
        dy2d, x2d, weight, rstd, dx, dw_partial,
        dy2d.stride(0), x2d.stride(0), dx.stride(0),
        n_rows, n_cols, rows_per_program, float(offset),
        BLOCK_M=block_m, BLOCK_N=block_n, COMPUTE_DW=compute_dw, FP32_SCALE=fp32_scale,
        num_warps=num_warps_for(block_m * block_n),
    )
    dw = dw_partial.sum(0).to(weight.dtype) if compute_dw else None
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """y = (weight + offset) * rstd * x, rounded as `rms_norm` says; saves x and rstd, computes dx and
    (when needed) dW."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, fp32_scale: bool, fp8_rows: bool
    ):
        y, x2d, rstd, rows = rms_norm_forward(x, weight, eps, offset, fp32_scale, fp8_rows)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.x_shape, ctx.offset, ctx.fp32_scale = x.shape, offset, fp32_scale
        if rows is None:
            return y
        ctx.mark_non_differentiable(*rows)
        return y, *rows

    @staticmethod
    @once_differentiable  # a double backward raises instead of differentiating the kernel as a constant
    def backward(ctx, dy: torch.Tensor, *_rows_grads):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(
            dy, x2d, weight, rstd, ctx.offset, ctx.fp32_scale, compute_dw=ctx.needs_input_grad[1]
        )
        return dx.view(ctx.x_shape), dw, None, None, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0, fp32_scale: bool = False,
    fp8_rows: bool = False,
):
    """Fused RMSNorm over the last dim of `x`, scaled by ``weight + offset`` (math in the module docstring).

    Args:
        x: [..., N] activations.
        weight: [N] scale.
        eps: added to the mean square.
        offset: added to the weight (in fp32) before scaling: 0.0 for Llama's norm, 1.0 for Gemma's
            ``(1 + weight)``. The weight's gradient does not depend on it.
        fp32_scale: False: normalise, round to x's dtype, then scale; y in promote(x.dtype,
            weight.dtype) (HF's LlamaRMSNorm). True: scale in fp32 and round once to x's dtype
            (HF's Gemma3RMSNorm).
        fp8_rows: also return y's rows in e4m3 for an fp8 GEMM that reads y (`lightning_ft.kernels.fp8`),
            computed in the same kernel from the rounded y: no separate quantisation pass.

    Returns:
        y of x's shape, in the dtype ``fp32_scale`` names; with ``fp8_rows``, (y, q, scale): q [M, N] e4m3
        and scale [M] fp32 with M = y.numel() // N, as `lightning_ft.kernels.fp8.quantize_rows` of y's
        rows (no gradient flows through q and scale).
    """
    if not triton_can_run(x):
        warn_fallback("rms_norm", x.device)
        y = rms_norm_reference(x, weight, eps, offset=offset, fp32_scale=fp32_scale)
        return (y, *quantize_rows(y.detach().reshape(-1, y.shape[-1]))) if fp8_rows else y
    return RMSNormFunction.apply(x, weight, eps, offset, fp32_scale, fp8_rows)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0, fp32_scale: bool = False
) -> torch.Tensor:
    """Plain-torch `rms_norm`: op for op as HF's LlamaRMSNorm.forward (offset 0, ``fp32_scale=False``)
    or Gemma3RMSNorm.forward (offset 1, ``fp32_scale=True``)."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    n32 = x32 * torch.rsqrt(variance + eps)
    if fp32_scale:
        return (n32 * (offset + weight.float())).type_as(x)
    if offset == 0.0:
        return weight * n32.to(x.dtype)
    return ((offset + weight.float()) * n32.to(x.dtype)).to(torch.promote_types(x.dtype, weight.dtype))
