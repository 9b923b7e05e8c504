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
Note: the write is not announced with `ctx.mark_dirty`, which on views (the usual case) makes
autograd route the backward through CopySlices: a zero-filled base-sized gradient, a clone and a
copy per tensor. Instead the version counters of q and k are bumped by hand, so any autograd node
that saved the pre-rotation q or k still fails loudly ("modified by an inplace operation") rather
than reading rotated values. The backward writes fresh gradients (laid out [B, T, H, D], which the
projections' view/transpose backward takes for free) and never touches the incoming ones.
cos and sin get no gradient; when they require one, `apply_rope` uses the reference.

Source: Su et al., "RoFormer" (2021); layout and rotate_half convention of HF transformers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import num_warps_for, triton_can_run, warn_fallback


@triton.jit
def _rotate_heads(
    SRC, DST, stride_src_h, stride_dst_h, n_heads,
    c1, c2, s1, s2, d, d_mask, HALF,
    BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)
    mask = (h < n_heads)[:, None] & d_mask[None, :]
    src = SRC + h[:, None] * stride_src_h + d[None, :]
    dst = DST + h[:, None] * stride_dst_h + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1[None, :] + x2 * s2[None, :]
        o2 = x2 * c2[None, :] - x1 * s1[None, :]
    else:
        o1 = x1 * c1[None, :] - x2 * s1[None, :]
        o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(dst, o1.to(DST.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, Q_OUT, K_OUT, COS, SIN,
    stride_q_b, stride_q_h, stride_q_t,
    stride_k_b, stride_k_h, stride_k_t,
    stride_qo_b, stride_qo_h, stride_qo_t,
    stride_ko_b, stride_ko_h, stride_ko_t,
    stride_cos_b, stride_cos_t, stride_sin_b, stride_sin_t,
    T, HQ, HK, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    b = token // T
    t = token % T
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF

    cos = COS + b * stride_cos_b + t * stride_cos_t + d
    sin = SIN + b * stride_sin_b + t * stride_sin_t + d
    c1 = tl.load(cos, mask=d_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF, mask=d_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin, mask=d_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF, mask=d_mask, other=0.0).to(tl.float32)

    _rotate_heads(
        Q + b * stride_q_b + t * stride_q_t, Q_OUT + b * stride_qo_b + t * stride_qo_t,
        stride_q_h, stride_qo_h, HQ, c1, c2, s1, s2, d, d_mask, HALF, BLOCK_HQ, BACKWARD,
    )
    _rotate_heads(
        K + b * stride_k_b + t * stride_k_t, K_OUT + b * stride_ko_b + t * stride_ko_t,
        stride_k_h, stride_ko_h, HK, c1, c2, s1, s2, d, d_mask, HALF, BLOCK_HK, BACKWARD,
    )


def _launch(
    q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, backward: bool,
) -> None:
    batch, heads_q, seq_len, _ = q.shape
    heads_k = k.shape[1]
    half = cos.shape[-1] // 2
    block_hq, block_hk, block_half = (triton.next_power_of_2(n) for n in (heads_q, heads_k, half))
    _rope_kernel[(batch * seq_len,)](
        q, k, q_out, k_out, cos, sin,
        *q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3],
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        seq_len, heads_q, heads_k, half,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_HALF=block_half, BACKWARD=backward,
        num_warps=num_warps_for(max(block_hq, block_hk) * block_half),
    )


def _projection_layout_like(x: torch.Tensor) -> torch.Tensor:
    """An empty [B, H, T, D] tensor whose memory is [B, T, H, D], like the q/k/v projections'."""
    batch, heads, seq_len, head_dim = x.shape
    return x.new_empty((batch, seq_len, heads, head_dim)).transpose(1, 2)


def rope_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q and k in place (one launch)."""
    if q.shape[0] * q.shape[2] > 0:
        _launch(q, k, q, k, cos, sin, backward=False)


def rope_backward(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the incoming gradients by -sin into fresh tensors (one launch)."""
    dq = dq if dq.stride(-1) == 1 else dq.contiguous()
    dk = dk if dk.stride(-1) == 1 else dk.contiguous()
    dq_in, dk_in = _projection_layout_like(dq), _projection_layout_like(dk)
    rot = cos.shape[-1]
    if rot < dq.shape[-1]:
        dq_in[..., rot:] = dq[..., rot:]
        dk_in[..., rot:] = dk[..., rot:]
    if dq.shape[0] * dq.shape[2] > 0:
        _launch(dq, dk, dq_in, dk_in, cos, sin, backward=True)
    return dq_in, dk_in


class RoPEFunction(torch.autograd.Function):
    """Rotates q and k in place (see the Note in the module docstring); saves only cos and sin."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        rope_forward(q, k, cos, sin)
        torch.autograd.graph.increment_version(q)
        torch.autograd.graph.increment_version(k)
        ctx.save_for_backward(cos, sin)
        return q, k

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_backward(dq, dk, cos, sin)
        return dq, dk, None, None


def _check_and_broadcast(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
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
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    return cos.expand(batch, seq_len, rot), sin.expand(batch, seq_len, rot)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [B, Hq, T, D] and k [B, Hk, T, D] in place by cos/sin [B or 1, T, D_rot]; returns (q, k).

    Use the returned tensors: they are q and k themselves unless a head dim was not unit-stride
    (then rotated contiguous copies), or the reference ran (Triton unavailable, or cos/sin need grad).
    """
    cos, sin = _check_and_broadcast(q, k, cos, sin)
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
