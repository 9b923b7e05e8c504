"""Rotary position embedding on q and k, in place, in one launch (forward and backward).

Math, HF's `apply_rotary_pos_emb` (rotate_half convention). Per token and head, with x the first
D_rot dims of the head split in halves x1, x2 and cos/sin split the same way (c1, c2, s1, s2; HF's
tables repeat the frequencies, so c1 == c2 and s1 == s2, but nothing here relies on it):

    out1 = x1 * c1 - x2 * s1
    out2 = x2 * c2 + x1 * s2            # = x * cos + rotate_half(x) * sin
    out[D_rot:] = x[D_rot:]             # partial rotary: the rest of the head is untouched

The map is linear in x, so the backward is its transpose (a rotation by -sin):

    dx1 = do1 * c1 + do2 * s2
    dx2 = do2 * c2 - do1 * s1

Accumulation: fp32 in registers, stored in q's / k's dtype (HF would promote to cos's dtype when
cos is fp32 and q bf16; here q keeps its dtype since it is written in place).

Shapes (legend): q [B, Hq, T, D], k [B, Hk, T, D] as HF passes them, usually transposed views of
the projections' [B, T, H, D] memory (any strides with a unit-stride last dim); Hq != Hk for GQA;
cos, sin [B or 1, T, D_rot] (or [T, D_rot]) with D_rot even and <= D, already gathered at each
token's position, so packed `position_ids` (restarting at 0 per document, one-token documents
included) need nothing special. One program per token rotates all Hq + Hk heads of that token,
so cos/sin are read once per token.

In place: the forward overwrites q and k through their own strides and returns them, so the
[B, T, H, D] layout flash-attention wants survives. A head dim that is not unit-stride is first
copied to a contiguous tensor, which is then rotated in place and returned.
Note: the write is not announced with `ctx.mark_dirty`. On views (the usual case) that is refused
for a Function returning two tensors, and with one Function per tensor it makes autograd route the
backward through AsStridedBackward + CopySlices: a zero-filled base-sized gradient, a clone and
three copies per tensor. Instead the version counters of q and k are bumped by hand, so any
autograd node that saved the pre-rotation q or k still fails loudly ("modified by an inplace
operation") rather than reading rotated values; the returned q, k are then plain outputs of this
Function and their backward is RoPEFunctionBackward -> the projections' TransposeBackward ->
ViewBackward, with nothing in between.

Cost per pass, E = B * T * (Hq + Hk) * D elements (cos/sin reads, [B or 1, T, D_rot], are small):
    forward   one launch, reads and writes q and k once: 2E elements (fewer with partial rotary,
              whose tail stays put), no allocation
    backward  one launch, reads dq, dk once and writes dq_in, dk_in once: 2E elements, two
              `empty_strided`, no zero-fill and no copy (the partial-rotary tail is copied by the
              kernel). dq_in / dk_in are laid out [B, T, H, D], so the transpose/view backward
              towards the projections is free and AccumulateGrad / the projection's matmul
              backward takes them as they are.
Note: the backward does not rotate the incoming gradients in place (as Liger's does). It would
save no bytes (read + write either way), only the two allocations, and autograd gives no ownership
guarantee: the incoming gradient can be the caller's `grad_tensors` (Liger's rope overwrites
them), a tensor a hook kept, or the same tensor AddBackward handed to another branch not yet run.
cos and sin get no gradient; when they require one, `apply_rope` uses the reference.

Source: Su et al., "RoFormer" (2021); layout and rotate_half convention of HF transformers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import triton_can_run, warn_fallback


@triton.jit
def _rotate_heads(
    X, OUT, stride_x_h, stride_out_h, c1, c2, s1, s2,
    N_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, BACKWARD: tl.constexpr,
):
    """Rotate the [N_HEADS, 2 * HALF] leading dims of one token's heads from X into OUT (c*, s* [1, BLOCK_HALF]),
    then copy the PASS trailing dims (partial rotary; only when OUT is not X)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < N_HEADS) & (d < HALF)
    x = X + h * stride_x_h + d
    out = OUT + h * stride_out_h + d
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    tl.store(out, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(out + HALF, o2.to(OUT.dtype.element_ty), mask=mask)
    if PASS > 0:
        p = tl.arange(0, BLOCK_PASS)[None, :]
        pass_mask = (h < N_HEADS) & (p < PASS)
        tail = tl.load(X + h * stride_x_h + 2 * HALF + p, mask=pass_mask)
        tl.store(OUT + h * stride_out_h + 2 * HALF + p, tail, mask=pass_mask)


@triton.jit
def _rope_kernel(
    Q, K, Q_OUT, K_OUT, COS, SIN,
    stride_q_b, stride_q_h, stride_q_t,
    stride_k_b, stride_k_h, stride_k_t,
    stride_cos_b, stride_cos_t,
    T,
    HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    """One program per token. Forward: rotate Q, K in place through their strides. Backward: read the
    gradients Q, K through their strides and write Q_OUT, K_OUT laid out [B, T, H, D] (contiguous)."""
    token = tl.program_id(0).to(tl.int64)
    b = token // T
    t = token - b * T
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF

    cos = COS + b * stride_cos_b + t * stride_cos_t + d
    sin = SIN + b * stride_cos_b + t * stride_cos_t + d
    c1 = tl.load(cos, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]

    q = Q + b * stride_q_b + t * stride_q_t
    k = K + b * stride_k_b + t * stride_k_t
    if BACKWARD:
        _rotate_heads(q, Q_OUT + token * (HQ * HEAD_DIM), stride_q_h, HEAD_DIM, c1, c2, s1, s2,
                      HQ, BLOCK_HQ, HALF, BLOCK_HALF, PASS, BLOCK_PASS, BACKWARD)
        _rotate_heads(k, K_OUT + token * (HK * HEAD_DIM), stride_k_h, HEAD_DIM, c1, c2, s1, s2,
                      HK, BLOCK_HK, HALF, BLOCK_HALF, PASS, BLOCK_PASS, BACKWARD)
    else:
        _rotate_heads(q, q, stride_q_h, stride_q_h, c1, c2, s1, s2,
                      HQ, BLOCK_HQ, HALF, BLOCK_HALF, PASS, BLOCK_PASS, BACKWARD)
        _rotate_heads(k, k, stride_k_h, stride_k_h, c1, c2, s1, s2,
                      HK, BLOCK_HK, HALF, BLOCK_HALF, PASS, BLOCK_PASS, BACKWARD)


def _launch(
    q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, backward: bool,
) -> None:
    """One launch over B * T tokens; head counts and dims are compile-time constants (one compile per model).

    4 warps per token: on Hopper at T=8192, 32/8 heads, D=128 (CUDA-graph replays), 4 warps ran
    both passes faster than 8, and 1, 2 or 16 warps or 2-8 tokens per program were slower (tuned at
    that head count only; the kernel's timings are in benchmarks/RESULTS.md).
    """
    batch, heads_q, seq_len, head_dim = q.shape
    heads_k = k.shape[1]
    half = cos.shape[-1] // 2
    pass_dims = head_dim - 2 * half if backward else 0
    block_hq, block_hk = triton.next_power_of_2(heads_q), triton.next_power_of_2(heads_k)
    block_half = triton.next_power_of_2(half)
    _rope_kernel[(batch * seq_len,)](
        q, k, q_out, k_out, cos, sin,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        0 if cos.shape[0] == 1 else cos.stride(0), cos.stride(1),
        seq_len,
        HQ=heads_q, HK=heads_k, HEAD_DIM=head_dim, HALF=half, PASS=pass_dims,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(max(pass_dims, 1)), BACKWARD=backward,
        num_warps=4,
    )


def _projection_layout_empty(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped like x [B, H, T, D] whose memory is [B, T, H, D], like the projections' outputs."""
    batch, heads, seq_len, head_dim = x.shape
    strides = (seq_len * heads * head_dim, head_dim, heads * head_dim, 1)
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)


def rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [B, Hq, T, D] and k [B, Hk, T, D] in place (one launch); cos/sin as `_check_tables` returns them."""
    if q.shape[0] * q.shape[2] > 0:
        _launch(q, k, q, k, cos, sin, backward=False)


def rope_backward(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the incoming gradients by -sin into fresh [B, T, H, D]-laid tensors (one launch, tail included).

    Reads dq, dk once and writes the results once: the bytes of the forward. The incoming
    gradients are left untouched (see the module docstring for why they are not reused).
    """
    dq = dq if dq.stride(-1) == 1 else dq.contiguous()
    dk = dk if dk.stride(-1) == 1 else dk.contiguous()
    dq_in, dk_in = _projection_layout_empty(dq), _projection_layout_empty(dk)
    if dq.shape[0] * dq.shape[2] > 0:
        _launch(dq, dk, dq_in, dk_in, cos, sin, backward=True)
    return dq_in, dk_in


class RoPEFunction(torch.autograd.Function):
    """Rotates q and k in place (see the Note in the module docstring); saves only cos and sin."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        rope_forward(q, k, cos, sin)
        torch.autograd.graph.increment_version((q, k))
        ctx.save_for_backward(cos, sin)
        return q, k

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_backward(dq, dk, cos, sin)
        return dq, dk, None, None


def _check_tables(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the shapes; return cos/sin as [B or 1, T, D_rot] with the same strides and a unit-stride last dim.

    A batch of 1 is broadcast by the kernel (batch stride 0), so nothing is expanded or copied in the
    usual case (HF's [1, T, D] or [B, T, D] contiguous tables).
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be [B, H, T, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, _, seq_len, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"apply_rope: k {tuple(k.shape)} does not match q {tuple(q.shape)} outside the head count")
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    rot = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape[1] != seq_len or cos.shape[0] not in (1, batch):
        raise ValueError(
            f"apply_rope: cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} are not [B or 1, {seq_len}, D_rot]"
        )
    if rot % 2 or rot > head_dim:
        raise ValueError(f"apply_rope: rotary dim {rot} must be even and <= head dim {head_dim}")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, Hq, T, D] and k [B, Hk, T, D] in place by cos/sin [B or 1, T, D_rot]; returns (q, k).

    Use the returned tensors: they are q and k themselves unless a head dim was not unit-stride
    (then rotated contiguous copies), or the reference ran (Triton unavailable, or cos/sin need grad).
    Raises ValueError when q/k are not 4-D, k differs from q outside the head count, cos/sin are not
    [B or 1, T, D_rot] (or [T, D_rot]), or D_rot is odd or larger than D.
    """
    cos, sin = _check_tables(q, k, cos, sin)
    if not triton_can_run(q) or cos.requires_grad or sin.requires_grad:
        if not triton_can_run(q):
            warn_fallback("apply_rope", q.device)
        return rope_reference(q, k, cos, sin)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    return RoPEFunction.apply(q, k, cos, sin)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch RoPE, out of place: HF's apply_rotary_pos_emb plus a pass-through tail for D_rot < D."""
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
        out = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out

    return rotate(q), rotate(k)
