"""Attention kernels called through their forward and backward ops, and the one autograd function over them.

Every fast path of `lightning_ft.model.attention` runs an `AttentionKernel`: a kernel's forward op
(returning its output and what its backward needs: the log-sum-exp, RNG state, offsets) and its
backward op, with the mask, scale and window bound in. One autograd function, `attend`, runs any of
them, so three things work the same for every kernel:

- kept attention (CUDA graphs, `lightning_ft.strategies.kept`, kind ``attention``): the forward keeps
  (out, aux) and the recompute's same call returns them instead of running the forward again;
- attention sinks (gpt-oss): a learned logit per head that joins every query's softmax denominator
  and is then dropped. With ``lse`` the kernel's log-sum-exp of a query's scores, the output with the
  sink is ``out · σ(lse − sink)``. Its backward is the kernel's own backward op called with
  ``dO·σ`` as the output gradient and ``out·σ`` as the output: the op uses the output only for
  ``Δ = rowsum(dO ∘ O)``, which then equals ``rowsum(dy ∘ out)·σ²``, exactly the Δ the sink's extra
  softmax term needs; the sink's gradient is ``−Σ rowsum(dy ∘ out)·σ(1 − σ)`` over the tokens. No
  kernel needs a sink variant, and the sink's gradient is exact (the correction as described in the
  gpt-oss model card's reference attention, here differentiated in closed form). The correction and its
  backward run as one Triton pass each (`lightning_ft.kernels.attention_sinks`; its reference on the CPU);
- the custom backward calls the same backward op autograd would.

Kernels (each checked against `lightning_ft.model.attention.packed_attention_reference`):

    cuDNN        `cudnn_causal_kernel`: one document, causal; what SDPA runs on Hopper (GQA native)
    flash        `flash_varlen_kernel`: flash-attention 2 over the documents of a packed run (what
                 ``torch.nn.attention.varlen`` runs), GQA native, sliding windows
    CPU flash    `cpu_flash_kernel`: the CPU's flash attention with an additive mask (what SDPA runs there)

Layouts: ``THD`` kernels take q [T, Hq, D], k/v [T, Hkv, D] and return out [T, Hq, D]; ``BHTD``
kernels take [1, H, T, D]. The log-sum-exp is ``aux[0]``, fp32, [Hq, T] once reshaped.

Sources: PyTorch ``aten::_scaled_dot_product_cudnn_attention`` / ``_flash_attention_forward`` /
``_scaled_dot_product_flash_attention_for_cpu`` and their ``_backward`` ops (torch 2.11 and 2.13);
flash-attention 2 ``mha_varlen_bwd`` (Δ = rowsum(dO∘O), the dq accumulator behind `check_varlen_size`);
transformers ``models/gpt_oss/modeling_gpt_oss.py`` (``eager_attention_forward``: the sink as one more
logit of the softmax, dropped after).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lightning_ft.kernels._utils import triton_can_run
from lightning_ft.kernels.attention_sinks import sink_backward, sink_backward_reference, sink_forward, sink_forward_reference
from lightning_ft.strategies import kept

HALF_DTYPES = (torch.float16, torch.bfloat16)
_INT32_LIMIT = 2**31


def check_varlen_size(total_q: int, num_docs: int, num_heads: int, head_dim: int) -> None:
    """Raise before flash-attention's varlen backward would overflow int32 indexing.

    Its dq accumulator holds ``(total_q + 128·num_docs)·num_heads·round(head_dim)`` fp32 elements
    (``round``: up to a multiple of 32, or 256 above 192), indexed with 32-bit integers.

    Raises:
        ValueError: that count reaches 2³¹; the message says how many tokens would fit.
    """
    rounded = -(-head_dim // 32) * 32 if head_dim <= 192 else 256
    if (total_q + 128 * num_docs) * num_heads * rounded >= _INT32_LIMIT:
        fits = (_INT32_LIMIT - 1) // (num_heads * rounded) - 128 * num_docs
        raise ValueError(
            f"model.attention=varlen: a packed batch of {total_q} tokens in {num_docs} documents with {num_heads} "
            f"heads of dim {head_dim} overflows flash-attention's int32 indexing in backward; lower data.max_tokens "
            f"to at most {max(fits, 0)} or use model.attention=flex"
        )


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast fp32 q/k/v to the autocast dtype when autocast is on for their device (as SDPA's autocast does)."""
    device_type = tensors[0].device.type
    if tensors[0].dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return tuple(t.to(dtype) for t in tensors)
    return tensors


def pad_value_head_dim(query: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``value`` with its head dim zero-padded to ``query``'s, and its own head dim.

    For the kernels that take one head dim for q, k and v (flash-attention 2, the CPU's flash
    kernel) when v's is narrower, as in MLA (DeepSeek-V3, GLM-4.7-Flash): the zero columns of v give
    zero columns of the output, which the caller slices off (``out[..., :Dv]``); their gradient is dropped.

    Args:
        query: [..., Dqk]; value: [..., Dv], the other dims as the kernel takes them.

    Raises:
        ValueError: v's head dim wider than q/k's.
    """
    d_qk, d_v = query.shape[-1], value.shape[-1]
    if d_v > d_qk:
        raise ValueError(f"packed attention: a value head dim ({d_v}) wider than the query/key head dim ({d_qk}) is not supported")
    return (F.pad(value, (0, d_qk - d_v)) if d_v < d_qk else value), d_v


def cudnn_head_dim_limit(device: torch.device) -> int:
    """The largest head dim we send to cuDNN's attention on ``device`` (forward and backward): 256 on sm90 (H100/H200)
    with cuDNN >= 9.13, else 128. torch's SDPA allows 256 on sm90 from cuDNN 9.10 (``check_cudnn_tensor_shapes`` in
    ``sdp_utils.cpp``; cuDNN's support matrix: Hopper bprop d <= 256), but cuDNN 9.11 and 9.12 had a Hopper backward
    bug for some large head dims (fixed in 9.13: cuDNN frontend 1.14.1 release notes)."""
    version = torch.backends.cudnn.version() or 0
    return 256 if torch.cuda.get_device_capability(device) == (9, 0) and version >= 91300 else 128


def cudnn_runs(q: torch.Tensor) -> bool:
    """Whether cuDNN's attention takes ``q``'s kind of input: CUDA, Hopper or newer (where SDPA prefers it),
    bf16/fp16, D <= `cudnn_head_dim_limit`, D % 8 == 0, cuDNN attention enabled and not in deterministic mode."""
    D = q.shape[-1]
    return (
        q.is_cuda and q.dtype in HALF_DTYPES
        and torch.backends.cuda.cudnn_sdp_enabled()
        and not torch.are_deterministic_algorithms_enabled()  # SDPA does not pick cuDNN then either
        and torch.cuda.get_device_capability(q.device) >= (9, 0)
        and D <= cudnn_head_dim_limit(q.device) and D % 8 == 0
    )  # fmt: skip


@dataclass(frozen=True)
class AttentionKernel:
    """An attention kernel called through its forward and backward ops, so its saved tensors are explicit.

    ``forward(q, k, v) -> (out, aux)``: ``out`` shaped like q and ``aux`` a flat tuple of what the
    backward needs besides q, k, v and out (the log-sum-exp first, fp32; RNG state; sequence
    offsets). ``backward(grad_out, q, k, v, out, aux) -> (dq, dk, dv)``, each shaped like its input.
    ``layout``: ``THD`` (q [T, Hq, D]) or ``BHTD`` (q [1, Hq, T, D]). ``lse(aux)``: the log-sum-exp as
    [Hq, T] fp32 (default: ``aux[0]`` reshaped).
    """

    forward: Callable[..., tuple[torch.Tensor, tuple]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    layout: str = "THD"
    lse: Callable[[tuple], torch.Tensor] | None = None

    def log_sum_exp(self, aux: tuple, heads: int, tokens: int) -> torch.Tensor:
        """[Hq, T] fp32 log-sum-exp of each query's (scaled, masked) scores."""
        return self.lse(aux) if self.lse is not None else aux[0].reshape(heads, tokens)


def _heads_tokens(kernel: AttentionKernel, out: torch.Tensor) -> tuple[int, int]:
    return (out.shape[1], out.shape[0]) if kernel.layout == "THD" else (out.shape[1], out.shape[2])


def _thd(kernel: AttentionKernel, t: torch.Tensor) -> torch.Tensor:
    """The kernel's output-shaped tensor as a [T, H, D] view."""
    return t if kernel.layout == "THD" else t[0].transpose(0, 1)


def _from_thd(kernel: AttentionKernel, t_THD: torch.Tensor) -> torch.Tensor:
    """A [T, H, D] tensor in the kernel's layout (a view)."""
    return t_THD if kernel.layout == "THD" else t_THD.transpose(0, 1)[None]


class _KernelAttention(torch.autograd.Function):
    """``kernel``'s attention (or the kept (out, aux) of an earlier forward), with the sink correction when
    ``sinks`` is given; the backward calls the kernel's backward op."""

    @staticmethod
    def forward(ctx, kernel: AttentionKernel, values: tuple | None, q, k, v, sinks):
        out, aux = kernel.forward(q, k, v) if values is None else values
        ctx.kernel, ctx.aux, ctx.sinks_dtype = kernel, aux, None if sinks is None else sinks.dtype
        if sinks is None:
            ctx.save_for_backward(out, q, k, v)
            return out.view_as(out)  # a kept buffer must not be the output itself
        heads, tokens = _heads_tokens(kernel, out)
        lse_HT = kernel.log_sum_exp(aux, heads, tokens).float()
        ctx.save_for_backward(out, q, k, v, lse_HT, sinks)
        forward = sink_forward if triton_can_run(out) else sink_forward_reference  # the reference: the CPU
        return _from_thd(kernel, forward(_thd(kernel, out), lse_HT, sinks))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        if ctx.sinks_dtype is None:
            out, q, k, v = ctx.saved_tensors
            dq, dk, dv = ctx.kernel.backward(grad_out, q, k, v, out, ctx.aux)
            return None, None, dq, dk, dv, None
        out, q, k, v, lse_HT, sinks = ctx.saved_tensors
        kernel = ctx.kernel
        backward = sink_backward if triton_can_run(out) else sink_backward_reference
        grad_scaled, out_scaled, grad_sinks = backward(_thd(kernel, grad_out), _thd(kernel, out), lse_HT, sinks)
        dq, dk, dv = kernel.backward(_from_thd(kernel, grad_scaled), q, k, v, _from_thd(kernel, out_scaled), ctx.aux)
        return None, None, dq, dk, dv, grad_sinks.to(ctx.sinks_dtype)


def attend(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None,
           keep: bool = True) -> torch.Tensor:
    """``kernel``'s attention of q, k, v (its layout), with attention sinks when ``sinks`` ([Hq]) is given.

    Inside an active kept ``attention`` (`lightning_ft.strategies.kept`) and with ``keep``: in the
    forward (no grad) the kernel's (out, aux) are offered to it; in the recompute what the forward
    kept is returned and its backward calls the kernel's backward op, so the recompute skips
    attention's forward (the most expensive op of a long row after the GEMMs). A layer that keeps
    nothing runs as usual. Costs the kept tensors: the output in the activation dtype plus the fp32
    log-sum-exp per layer.
    """
    keeper = kept.active("attention") if keep else None
    if keeper is not None and keeper.recompute:
        if (values := keeper.take()) is not None:
            out, *aux = values
            return _KernelAttention.apply(kernel, (out, tuple(aux)), q, k, v, sinks)
        keeper = None
    if keeper is not None:
        with torch.no_grad():
            out, aux = kernel.forward(q, k, v)
        keeper.store((out, *aux))  # flat: each tensor its own buffer
        return _KernelAttention.apply(kernel, (out, aux), q, k, v, sinks)
    return _KernelAttention.apply(kernel, None, q, k, v, sinks)


def _cudnn_causal_forward(q, k, v, scale):
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, T, D] views of [T, H, D]
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, True, False, scale=scale)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset = result[:8]
    return out[0].transpose(0, 1), (lse, seed, offset, cum_q, cum_k, max_q, max_k)


def _cudnn_causal_backward(grad_out, q, k, v, out, aux, scale):
    lse, seed, offset, cum_q, cum_k, max_q, max_k = aux
    q4, k4, v4, out4, grad4 = (t.transpose(0, 1)[None] for t in (q, k, v, out, grad_out))
    if grad4.stride() != out4.stride():  # cuDNN reads dO in O's layout
        grad4 = torch.empty_strided(out4.shape, out4.stride(), dtype=out4.dtype, device=out4.device).copy_(grad4)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad4, q4, k4, v4, out4, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale
    )
    return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)


def cudnn_causal_kernel(scale: float | None) -> AttentionKernel:
    """cuDNN's fused causal attention over one document (what SDPA runs on Hopper), GQA native.

    q [T, Hq, D], k/v [T, Hkv, D] (passed to cuDNN as [1, H, T, D] views), bf16/fp16 on CUDA (`cudnn_runs`).
    Ops: ``aten::_scaled_dot_product_cudnn_attention`` and its ``_backward`` (the pair SDPA's autograd calls).
    """
    return AttentionKernel(partial(_cudnn_causal_forward, scale=scale), partial(_cudnn_causal_backward, scale=scale))


def flash_window(sliding_window: int | None) -> tuple[int, int]:
    """flash-attention's (left, right) window of a causal layer: keys with ``q - k < sliding_window`` (-1: all)."""
    return (sliding_window - 1 if sliding_window is not None else -1, 0)


def _flash_varlen_forward(q, k, v, cu_seqlens, max_seqlen, scale, sliding_window):
    left, right = flash_window(sliding_window)
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale,
        window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return out, (lse, rng_state, unused)


def _flash_varlen_backward(grad_out, q, k, v, out, aux, cu_seqlens, max_seqlen, scale, sliding_window):
    lse, rng_state, unused = aux
    left, right = flash_window(sliding_window)
    return torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True,
        rng_state, unused, scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip


def flash_varlen_kernel(
    cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None, sliding_window: int | None
) -> AttentionKernel:
    """flash-attention 2 over the documents of a packed run (what `varlen_attn` runs), GQA native.

    q [T, Hq, D], k/v [T, Hkv, D], bf16/fp16 on CUDA; ``cu_seqlens`` [N + 1] int32 on the device,
    starting at 0 and ending at T. Ops: ``aten::_flash_attention_forward`` / ``_backward`` (the pair behind
    ``torch.nn.attention.varlen``).
    """
    bound = dict(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, scale=scale, sliding_window=sliding_window)
    return AttentionKernel(partial(_flash_varlen_forward, **bound), partial(_flash_varlen_backward, **bound))


def _cpu_flash_forward(q, k, v, mask, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return out, (lse,)


def _cpu_flash_backward(grad_out, q, k, v, out, aux, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, aux[0], 0.0, False, attn_mask=mask, scale=scale
    )


def cpu_flash_kernel(mask: torch.Tensor, scale: float | None) -> AttentionKernel:
    """The CPU's flash attention with an additive mask (what SDPA runs on the CPU).

    q/k/v [1, H, T, D] with the same head count; ``mask`` [1, 1, T, T] in q's dtype (0 kept, -inf
    masked). Ops: ``aten::_scaled_dot_product_flash_attention_for_cpu`` / ``_backward``.
    """
    bound = dict(mask=mask, scale=scale)
    return AttentionKernel(partial(_cpu_flash_forward, **bound), partial(_cpu_flash_backward, **bound), layout="BHTD")
