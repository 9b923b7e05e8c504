"""Gated linear units of a gated MLP: y = act(gate) * up, forward and backward fused.

SwiGLU (act = silu, Llama and most others) and GeGLU (act = gelu_tanh, GELU's tanh approximation:
Gemma's ``gelu_pytorch_tanh``). The projections stay outside (they are LoRA-wrapped nn.Linear layers
in our models); this op fuses only the elementwise middle of `down_proj(act_fn(gate_proj(x)) * up_proj(x))`.

Math, elementwise: both activations are g * sigmoid(k(g)), with

    silu       k(g) = g                                   k'(g) = 1
    gelu_tanh  k(g) = 2c (g + 0.044715 g^3)               k'(g) = 2c (1 + 3 * 0.044715 g^2),  c = sqrt(2 / pi)

(0.5 (1 + tanh(z)) = sigmoid(2z)), so with s = sigmoid(k(g)):

    y  = g * s * u
    dg = dy * u * (s + g * s * (1 - s) * k'(g))
    du = dy * g * s

Everything is computed in fp32 registers and rounded once to the input dtype (HF rounds twice in
bf16: after the activation and after the product, so bf16 results differ by about one ulp). Only
gate and up are saved for backward; the activation is recomputed there. dg and du are fresh
tensors: gate and up are left intact for anything else that holds them.

With ``fp8_rows`` (`swiglu`) the forward runs by rows and also writes y's rows in e4m3 and their fp32
scales (amax(|y|) / 448 of the rounded y, `lightning_ft.kernels.fp8.quantize_rows`' math) for the
down projection's fp8 GEMM: a second pass over the row reads back the y it wrote, in place of a
separate quantisation kernel over all of y.

Shapes: gate and up of any identical shape (flattened; made contiguous if they are not), e.g.
[B, T, intermediate] with intermediate = 14336 or 3072 or any odd size.

Source: Shazeer, "GLU Variants Improve Transformer" (2020); GELU's tanh approximation from Hendrycks
& Gimpel, "Gaussian Error Linear Units" (2016); fused forward/backward as in Liger Kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import num_warps_for, row_padded, triton_can_run, warn_fallback
from lightning_ft.kernels.fp8 import e4m3_scale, e4m3_values, fp8_rows_done, fp8_rows_like, quantize_rows

ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU, GeGLU
_BLOCK = 2048


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """(act(g), act'(g)) of fp32 g, act(g) = g * sigmoid(k(g)) (the module docstring's k)."""
    if ACTIVATION == "gelu_tanh":
        k = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 sqrt(2 / pi) = 1.5957691216057308
        dk = 1.5957691216057308 * (1.0 + 0.134145 * g * g)
    else:
        k = g
        dk = 1.0
    s = tl.sigmoid(k)
    return g * s, s + g * s * (1.0 - s) * dk


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n_elements, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a, _ = _activation(g, ACTIVATION)
    tl.store(Y + offs, (a * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fwd_fp8_rows_kernel(
    G, U, Y, Q, QSCALE, n_cols, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    """`_swiglu_fwd_kernel` by rows (one program each), also writing y's row in e4m3 and its scale
    (`lightning_ft.kernels.fp8.quantize_rows` of the rounded y): a pass over the row's column blocks
    for y and its largest magnitude, then one reading y back to quantise it."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(G + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        a, _ = _activation(g, ACTIVATION)
        y = (a * u).to(Y.dtype.element_ty)
        tl.store(Y + row * n_cols + cols, y, mask=mask)
        amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
    scale = e4m3_scale(tl.max(amax, axis=0))
    tl.store(QSCALE + row, scale)
    for start in range(0, n_cols, BLOCK):  # each thread reads back the values it stored (same layout)
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(Y + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Q + row * n_cols + cols, e4m3_values(y, scale).to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n_elements, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _activation(g, ACTIVATION)
    tl.store(DU + offs, (dy * a).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (dy * u * da).to(DG.dtype.element_ty), mask=mask)


def _grid(n_elements: int) -> tuple[int]:
    return (triton.cdiv(n_elements, _BLOCK),)


def _check_activation(op: str, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {list(ACTIVATIONS)}, got {activation!r}")


def swiglu_forward(
    gate: torch.Tensor, up: torch.Tensor, activation: str, fp8_rows: bool = False
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Launch the forward kernel on contiguous gate/up of one shape and dtype. Returns (y, y's fp8 rows or
    None): with ``fp8_rows``, (q [M, I] e4m3, scale [M] fp32) of y's rows of the last dim's length I."""
    y = torch.empty_like(gate)
    n = gate.numel()
    if not fp8_rows:
        if n > 0:
            _swiglu_fwd_kernel[_grid(n)](
                gate, up, y, n, ACTIVATION=activation, BLOCK=_BLOCK, num_warps=num_warps_for(_BLOCK)
            )
        return y, None
    n_cols = gate.shape[-1] if gate.dim() else 1
    q, scale = fp8_rows_like(y.view(-1, n_cols))
    if n > 0:
        block = min(_BLOCK, triton.next_power_of_2(n_cols))
        _swiglu_fwd_fp8_rows_kernel[(n // n_cols,)](
            gate, up, y, q, scale, n_cols, ACTIVATION=activation, BLOCK=block, num_warps=num_warps_for(block)
        )
    return y, fp8_rows_done((q, scale))


def swiglu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel. Returns (d gate, d up)."""
    dy = dy.contiguous()
    dg = torch.empty_like(gate)
    du = torch.empty_like(up)
    n = gate.numel()
    if n > 0:
        _swiglu_bwd_kernel[_grid(n)](
            dy, gate, up, dg, du, n, ACTIVATION=activation, BLOCK=_BLOCK, num_warps=num_warps_for(_BLOCK)
        )
    return dg, du


class SwiGLUFunction(torch.autograd.Function):
    """act(gate) * up; saves gate and up only."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, activation: str, fp8_rows: bool):
        y, rows = swiglu_forward(gate, up, activation, fp8_rows)
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        if rows is None:
            return y
        ctx.mark_non_differentiable(*rows)
        return y, *rows

    @staticmethod
    def backward(ctx, dy: torch.Tensor, *_rows_grads):
        gate, up = ctx.saved_tensors
        return *swiglu_backward(dy, gate, up, ctx.activation), None, None


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", *, fp8_rows: bool = False):
    """Fused act(gate) * up (see the module docstring): SwiGLU with ``silu``, GeGLU with ``gelu_tanh``.

    Args:
        gate, up: tensors of one shape (promoted to a common dtype).
        activation: one of `ACTIVATIONS`.
        fp8_rows: also return y's rows in e4m3 for an fp8 GEMM that reads y (the down projection:
            `lightning_ft.kernels.fp8`), computed in the same kernel from the rounded y (a row-wise
            launch: one program per row): no separate quantisation pass.

    Returns:
        act(gate) * up, of gate's shape in the promoted dtype; with ``fp8_rows``, (y, q, scale): q [M, I]
        e4m3 and scale [M] fp32 (I the last dim, M = y.numel() // I), as
        `lightning_ft.kernels.fp8.quantize_rows` of y's rows (no gradient flows through q and scale).

    Raises:
        ValueError: gate and up differ in shape, or an unknown activation.
    """
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    _check_activation("swiglu", activation)
    if not triton_can_run(gate):
        warn_fallback("swiglu", gate.device)
        y = swiglu_reference(gate, up, activation)
        return (y, *quantize_rows(y.detach().reshape(-1, y.shape[-1]))) if fp8_rows else y
    dtype = torch.promote_types(gate.dtype, up.dtype)
    return SwiGLUFunction.apply(gate.to(dtype).contiguous(), up.to(dtype).contiguous(), activation, fp8_rows)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Plain-torch act(gate) * up, as HF's MLP computes it (``silu``: ACT2FN["silu"];
    ``gelu_tanh``: ACT2FN["gelu_pytorch_tanh"], torch's tanh-approximate GELU)."""
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    return torch.nn.functional.silu(gate) * up


# Concatenated layout: the gate and up halves of one [rows, 2I] GEMM output (transformers' MoE experts
# keep ``gate_up_proj`` stacked, so each expert GEMM yields h = [gate | up]). An optional per-row
# weight w scales each row: y = act(gate) * up * w (the MoE routing weight, see `swiglu_concat`).


@triton.jit
def _swiglu_concat_fwd_kernel(
    H, W, Y, HC, n_cols, stride_h, stride_y, stride_hc,
    HAS_WEIGHT: tl.constexpr, COPY_H: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g_in = tl.load(H + row * stride_h + cols, mask=mask, other=0.0)
    u_in = tl.load(H + row * stride_h + n_cols + cols, mask=mask, other=0.0)
    if COPY_H:
        tl.store(HC + row * stride_hc + cols, g_in, mask=mask)
        tl.store(HC + row * stride_hc + n_cols + cols, u_in, mask=mask)
    g = g_in.to(tl.float32)
    u = u_in.to(tl.float32)
    a, _ = _activation(g, ACTIVATION)
    y = a * u
    if HAS_WEIGHT:
        y = y * tl.load(W + row).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_concat_bwd_kernel(
    DY, H, W, DH, DW, n_cols, stride_dy, stride_h, stride_dh,
    HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row (the weight's gradient is a whole-row sum), column blocks in a loop."""
    row = tl.program_id(0).to(tl.int64)
    w = 1.0
    if HAS_WEIGHT:
        w = tl.load(W + row).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(H + row * stride_h + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        a, da = _activation(g, ACTIVATION)
        if WEIGHT_GRAD:
            dw += dy * a * u
        dy = dy * w
        tl.store(DH + row * stride_dh + cols, (dy * u * da).to(DH.dtype.element_ty), mask=mask)
        tl.store(DH + row * stride_dh + n_cols + cols, (dy * a).to(DH.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        tl.store(DW + row, tl.sum(dw, axis=0).to(DW.dtype.element_ty))


_CONCAT_BLOCK = 1024


def _concat_block(n_cols: int) -> int:
    return min(_CONCAT_BLOCK, triton.next_power_of_2(n_cols))


class SwiGLUConcatFunction(torch.autograd.Function):
    """act(h[:, :I]) * h[:, I:] (* w) on a [rows, 2I] tensor; saves h (and w), its gradient is one [rows, 2I] tensor."""

    @staticmethod
    def forward(
        ctx, h: torch.Tensor, row_weight: torch.Tensor | None, pad_out: int, pad_grad: int, h_copy: torch.Tensor | None,
        activation: str,
    ) -> torch.Tensor:
        rows, n_cols = h.shape[0], h.shape[1] // 2
        y = row_padded(rows, n_cols, pad_out, h)
        block = _concat_block(n_cols)
        if y.numel():
            _swiglu_concat_fwd_kernel[(rows, triton.cdiv(n_cols, block))](
                h, h if row_weight is None else row_weight, y, h if h_copy is None else h_copy,
                n_cols, h.stride(0), y.stride(0), 0 if h_copy is None else h_copy.stride(0),
                HAS_WEIGHT=row_weight is not None, COPY_H=h_copy is not None, ACTIVATION=activation,
                BLOCK=block, num_warps=num_warps_for(block),
            )  # fmt: skip
        ctx.save_for_backward(h, row_weight)
        ctx.pad_grad, ctx.activation = pad_grad, activation
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        h, row_weight = ctx.saved_tensors
        dy = dy.contiguous()
        dh = row_padded(h.shape[0], h.shape[1], ctx.pad_grad, h)
        d_weight = torch.empty_like(row_weight) if ctx.needs_input_grad[1] else None
        rows, n_cols = dy.shape
        block = _concat_block(n_cols)
        if dy.numel():
            _swiglu_concat_bwd_kernel[(rows,)](
                dy, h, h if row_weight is None else row_weight, dh, dh if d_weight is None else d_weight,
                n_cols, dy.stride(0), h.stride(0), dh.stride(0),
                HAS_WEIGHT=row_weight is not None, WEIGHT_GRAD=d_weight is not None, ACTIVATION=ctx.activation,
                BLOCK=block, num_warps=num_warps_for(block),
            )  # fmt: skip
        elif d_weight is not None:
            d_weight.zero_()
        return dh, d_weight, None, None, None, None


def swiglu_concat(
    h: torch.Tensor,
    row_weight: torch.Tensor | None = None,
    *,
    pad_out: int = 0,
    pad_grad: int = 0,
    h_copy: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """Fused act(gate) * up of a concatenated [rows, 2I] tensor h = [gate | up] → [rows, I].

    The MoE experts' layout (one GEMM against the stacked ``gate_up_proj``), also Phi-3's MLP: no
    chunk views, no activation intermediate, and the backward writes the one [rows, 2I] gradient the
    GEMM's backward takes, instead of two halves that autograd would concatenate. Same math and
    rounding as `swiglu`.

    Args:
        h: [rows, 2I] gate and up, side by side.
        row_weight: optional [rows] weight on h's device, multiplied into each output row (in fp32,
            before the one rounding), differentiable; its gradient comes back in its own dtype. The MoE experts pass the routing weight here: the down
            projection and its LoRA are linear, so W_down (w h) = w (W_down h), and scaling the
            [rows, I] input instead of the [rows, D] output saves two elementwise passes over the
            larger tensor per forward and two (plus a reduction) per backward (a [65536, 2048]
            output for Qwen3-30B-A3B at 8K tokens).
        pad_out / pad_grad: where the kernel runs, the output is a view of [rows, I + pad_out] rows
            and h's gradient a view of [rows, 2I + pad_grad] rows (spare columns, uninitialised,
            for a LoRA-augmented expert GEMM's thin LoRA middle: `lightning_ft.kernels.moe`); the
            plain-torch fallback returns contiguous tensors.
        h_copy: optional [rows, 2I] tensor of h's dtype and device in rows that do not overlap (unit
            column stride, any row stride of at least 2I) and in memory apart from h's, that receives
            h's values, written as the kernel reads them: one write instead of a copy's read and
            write (not part of autograd). The MoE experts pass the kept gate/up output's buffer here
            when their slotted GEMM cannot write into it (`lightning_ft.kernels.moe`; a [rows, 2I]
            copy per layer and step otherwise: 201 MB at 8K tokens of Qwen3-30B-A3B).
        activation: one of `ACTIVATIONS`, as in `swiglu`.

    Returns:
        [rows, I] in h's dtype.

    Raises:
        ValueError: h is not 2-D with an even number of columns, row_weight is not [rows] on h's
            device, h_copy does not match h as described, or an unknown activation.
    """
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"swiglu_concat: expected [rows, 2I], got {tuple(h.shape)}")
    if row_weight is not None and (row_weight.shape != h.shape[:1] or row_weight.device != h.device):
        raise ValueError(
            f"swiglu_concat: row_weight must be [{h.shape[0]}] on {h.device}, "
            f"got {tuple(row_weight.shape)} on {row_weight.device}"
        )
    if h_copy is not None and (
        h_copy.shape != h.shape or h_copy.dtype != h.dtype or h_copy.device != h.device or h_copy.stride(1) != 1
        or (h.shape[0] > 1 and h_copy.stride(0) < h.shape[1])
        or (h_copy.numel() and h_copy.untyped_storage().data_ptr() == h.untyped_storage().data_ptr())
    ):  # fmt: skip
        raise ValueError(
            f"swiglu_concat: h_copy must be {tuple(h.shape)} {h.dtype} on {h.device} in rows that do not overlap "
            f"(unit column stride, row stride >= {h.shape[1]}) and share no memory with h, got {tuple(h_copy.shape)} "
            f"{h_copy.dtype} on {h_copy.device} with strides {h_copy.stride()}"
        )
    _check_activation("swiglu_concat", activation)
    if not triton_can_run(h):
        warn_fallback("swiglu_concat", h.device)
        if h_copy is not None:
            h_copy.copy_(h)
        return swiglu_concat_reference(h, row_weight, activation)
    weight = None if row_weight is None else row_weight.contiguous()
    return SwiGLUConcatFunction.apply(h.contiguous(), weight, pad_out, pad_grad, h_copy, activation)


def swiglu_concat_reference(
    h: torch.Tensor, row_weight: torch.Tensor | None = None, activation: str = "silu"
) -> torch.Tensor:
    """Plain-torch `swiglu_concat`: act(gate) * up, then times the row weight (cast to h's dtype)."""
    y = swiglu_reference(*h.chunk(2, dim=-1), activation)
    return y if row_weight is None else y * row_weight.to(y.dtype)[:, None]
