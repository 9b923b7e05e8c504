"""Packed attention behind the transformers attention interface: three backends, metadata built once per batch.

`register_packed_attention` registers one attention function per backend with transformers
(``ATTENTION_NAMES``); a model loaded with that ``attn_implementation`` calls it in every layer with
the `PackedBatch` that `FinetuneModule` passes as the ``packed_batch`` keyword (transformers forwards
unknown keywords from the model call down to the attention function). transformers builds no mask
of its own for a name it has no mask function for, so nothing is derived from ``position_ids`` per
forward (its packed-sequence detection would cost a device sync). Without a ``packed_batch`` (e.g.
generation with a KV cache) every backend hands the call to transformers' own SDPA attention.

Backends (``model.attention``), each checked against `packed_attention_reference` (every document
through SDPA alone):

    varlen  `torch.nn.attention.varlen.varlen_attn` (flash-attention 2 inside PyTorch) on the packed
            [T, H, D] tensors with ``cu_seqlens``/``max_seqlen``: no mask, no padding, work ∝ Σ len².
            A row that holds one document (no window) runs SDPA's causal kernel instead, which is
            cuDNN's fused attention on Hopper, faster than flash-attention 2 at these lengths
            (forward+backward; see benchmarks/RESULTS.md).
            CUDA (sm80+), bf16/fp16 (fp32 inputs under autocast are cast to the autocast dtype, as
            SDPA's autocast does). GQA without repeating k/v: torch >= 2.12 takes
            ``enable_gqa=True``; torch 2.11 has no such argument and passes k/v with fewer heads
            straight to the flash kernel, which supports GQA natively (its backward expands dk/dv
            internally and sums them back).
    flex    FlexAttention with a document-causal `BlockMask` (sliding window when the layer has one).
            `flex_attention` is compiled once per process with dynamic shapes, so a new packed length
            (of more than one 128-token block) does not recompile. On the CPU torch runs its unfused
            reference instead (forward only: torch has no FlexAttention backward on the CPU).
    sdpa    `F.scaled_dot_product_attention` with a dense [T, T] block-diagonal causal mask: O(T²)
            memory; for the CPU and GPUs without flash-attention.
    auto    `resolve_attention_backend`: varlen when it can run, else sdpa.

Built once per batch and device (`PackedBatch.cached`, keyed by device), reused by all L layers, all
from the host ``cu_seqlens``/``max_seqlen`` and copied with ``non_blocking=True``, so no layer ever
waits on the device:

    varlen  ``cu_seqlens`` on the device (one copy of N + 1 int32)
    flex    the BlockMask: its block structure computed on the host, copied; document ids [T] on the device
    sdpa    the [1, 1, T, T] bool mask

Kept attention (with CUDA graphs, `lightning_ft.strategies.cuda_graphs`): inside `kept.keeping`
the varlen backend (and sdpa on the CPU) calls its kernel's forward and backward ops directly
(`AttentionKernel`: cuDNN for a one-document row on Hopper, flash-attention 2 for several
documents, the CPU's flash kernel), so a layer's forward can keep attention's output and
log-sum-exp (`lightning_ft.strategies.kept`, kind ``attention``) and the backward's recompute returns
them instead of running attention's forward again; its backward calls the same backward op
autograd would.

Shape suffixes: T tokens of the packed row, N documents, Hq query heads, Hkv key/value heads, D head
dim, M = ceil(T / block) blocks of a BlockMask. Values may have a narrower head dim than queries and
keys (MLA: DeepSeek-V3); the kernels that take one head dim get v zero-padded (`pad_value_head_dim`).

Sources: PyTorch ``torch/nn/attention/varlen.py`` (2.11 and 2.13), ``torch/nn/attention/flex_attention.py``;
flash-attention 2 ``mha_varlen_bwd`` (the dq accumulator behind `check_varlen_size`); transformers v5
``integrations/sdpa_attention.py``, ``masking_utils.py`` (sliding window: key kept iff q - k < window).
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lightning_ft.data.packing import PackedBatch
from lightning_ft.strategies import kept

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

BACKENDS = ("auto", "varlen", "flex", "sdpa")

# Note: transformers matches substrings of attn_implementation names ("sdpa", "flash",
# "flex_attention") to run its own checks and fallbacks, so no name here contains one of them.
ATTENTION_NAMES = {"sdpa": "lightning_ft", "varlen": "lightning_ft_varlen", "flex": "lightning_ft_flex"}

FLEX_BLOCK_SIZE = 128
_HALF_DTYPES = (torch.float16, torch.bfloat16)
_INT32_LIMIT = 2**31


def document_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] int32 on the host: the index of the document each token belongs to.

    Args:
        cu_seqlens: [N + 1] int32 cumulative document lengths, on the host.
    """
    lengths_N = cu_seqlens.diff().long()
    return torch.repeat_interleave(torch.arange(lengths_N.numel(), dtype=torch.int32), lengths_N)


def block_causal_mask(
    cu_seqlens: torch.Tensor, device: torch.device, sliding_window: int | None = None
) -> torch.Tensor:
    """[1, 1, T, T] bool mask, True where a query may attend a key (same document, not in the future).

    Args:
        cu_seqlens: [N + 1] int32 on the host.
        device: where the mask is needed. The document ids are computed on the host and copied,
            so building it never waits on the device.
        sliding_window: keep only keys with ``q - k < sliding_window`` (None: no window).
    """
    doc_T = document_ids(cu_seqlens).to(device, non_blocking=True)
    T = doc_T.numel()
    keep_TT = torch.ones(T, T, dtype=torch.bool, device=device).tril_()
    if sliding_window is not None:
        keep_TT.triu_(1 - sliding_window)
    return ((doc_T[:, None] == doc_T[None, :]) & keep_TT)[None, None]


def device_cu_seqlens(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` ([N + 1] int32) copied to ``device`` without waiting for it."""
    return cu_seqlens.to(device, non_blocking=True)


def _ordered_blocks(dense_MM: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [M, M] bool block map as a BlockMask's (num_blocks [1, 1, M], indices [1, 1, M, M]) int32 pair:
    per row, how many blocks are set and their column indices first, in increasing order."""
    num_M = dense_MM.sum(-1, dtype=torch.int32)
    indices_MM = torch.argsort(dense_MM.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num_M[None, None], indices_MM[None, None]


def document_causal_blocks(
    doc_T: torch.Tensor, sliding_window: int | None = None, block_size: int = FLEX_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query block, key block) tiles of the document-causal mask are partly and fully kept.

    Documents are contiguous runs of ``doc_T``, so for a query block ``i`` and a key block ``j <= i``:
    some pair is kept iff the last key of ``j`` is in the document of the first query of ``i``
    (within the window of that query); every pair is kept iff ``j < i``, the first key of ``j`` and
    the last query of ``i`` share a document (then the whole tile does), the tile is whole (not cut
    by T) and the window spans it. Matches what ``create_block_mask`` finds by evaluating the
    mask on every element, in O(M²) host work instead of O(T²) device work.

    Args:
        doc_T: [T] document ids on the host (`document_ids`).
        sliding_window: keep only keys with ``q - k < sliding_window`` (None: no window).
        block_size: tile size of the BlockMask.

    Returns:
        (partial_MM, full_MM) bool [M, M] on the host, disjoint.
    """
    T = doc_T.numel()
    first_M = torch.arange(0, T, block_size)
    last_M = (first_M + block_size).clamp(max=T) - 1
    q_first, q_last = first_M[:, None], last_M[:, None]
    k_first, k_last = first_M[None, :], last_M[None, :]
    any_MM = (k_first <= q_first) & (doc_T[last_M][None, :] >= doc_T[first_M][:, None])
    full_MM = (k_first < q_first) & (doc_T[first_M][None, :] == doc_T[last_M][:, None])
    full_MM &= q_last - q_first + 1 == block_size
    if sliding_window is not None:
        any_MM &= q_first - k_last < sliding_window
        full_MM &= q_last - k_first < sliding_window
    return any_MM & ~full_MM, full_MM


def build_block_mask(
    cu_seqlens: torch.Tensor, device: torch.device, sliding_window: int | None = None, block_size: int = FLEX_BLOCK_SIZE
) -> BlockMask:
    """The document-causal FlexAttention `BlockMask` of a packed row, on ``device``, without a device sync.

    The block structure (`document_causal_blocks`, and its transpose for the backward, which
    ``BlockMask.from_kv_blocks`` computes) is built on the host and each tensor copied with
    ``non_blocking=True`` (``BlockMask.to`` would copy blocking, i.e. sync). The ``mask_mod``
    (same document, causal, window) reads the [T] document ids on ``device``; FlexAttention
    applies it only inside partial tiles.

    Args:
        cu_seqlens: [N + 1] int32 on the host.
        device: where the BlockMask is needed.
        sliding_window: keep only keys with ``q - k < sliding_window`` (None: no window).
        block_size: tile size (FlexAttention's default, 128).
    """
    from torch.nn.attention.flex_attention import BlockMask

    doc_T = document_ids(cu_seqlens)
    T = doc_T.numel()
    partial_MM, full_MM = document_causal_blocks(doc_T, sliding_window, block_size)
    doc_dev_T = doc_T.to(device, non_blocking=True)

    def document_causal(b, h, q_idx, kv_idx):
        keep = (doc_dev_T[q_idx] == doc_dev_T[kv_idx]) & (q_idx >= kv_idx)
        if sliding_window is not None:
            keep = keep & (q_idx - kv_idx < sliding_window)
        return keep

    host = BlockMask.from_kv_blocks(
        *_ordered_blocks(partial_MM), *_ordered_blocks(full_MM), BLOCK_SIZE=block_size, seq_lengths=(T, T)
    )
    names = (
        "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
        "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
    )  # fmt: skip
    moved = {name: getattr(host, name).to(device, non_blocking=True) for name in names}
    return BlockMask(seq_lengths=(T, T), BLOCK_SIZE=host.BLOCK_SIZE, mask_mod=document_causal, **moved)


def compile_flex_attention(backend: str = "inductor") -> Callable:
    """`flex_attention` under ``torch.compile`` with dynamic shapes, traced without duck sizing.

    Duck sizing (dynamo's default) gives input dims of equal size one symbol: a first batch whose
    BlockMask had as many blocks as the keys have heads shared the heads' symbol, which GQA
    specializes, so the next batch of another block count compiled again (a guard on
    ``block_mask.q_indices``; a 4096-token budget has 32 blocks, Qwen3-30B-A3B's query heads).
    Traced without it, each dim gets its own symbol and one compile serves every packed length of
    more than one block (128 tokens); a row of one block compiles once more (dynamo specializes
    dims of size 1).

    The setting is read when a trace makes its symbols (the backward's too: it reuses the forward's),
    so each call runs inside a patch of it: one patch object per thread, reused (a new one per call
    leaks an entry in torch >= 2.12's thread-local config stack, so memory grows with every call).

    Args:
        backend: ``torch.compile``'s backend (inductor; tests on the CPU trace with a counting backend).
    """
    from torch.fx.experimental import _config as fx_config
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=True, backend=backend)
    local = threading.local()

    def call(*args, **kwargs):
        patch = getattr(local, "patch", None)
        if patch is None:
            patch = local.patch = fx_config.patch(use_duck_shape=False)
        with patch:
            return compiled(*args, **kwargs)

    return call


_compiled_flex_attention = functools.cache(compile_flex_attention)


def _flex_attention_for(device: torch.device) -> Callable:
    """`flex_attention` compiled with dynamic shapes on CUDA, torch's eager reference elsewhere.

    One compile per process serves every packed length; another head dim, window or scale (another
    model) compiles once more.
    """
    if device.type == "cuda":
        return _compiled_flex_attention()
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


@functools.cache
def _varlen_api() -> tuple[Callable, bool]:
    """`varlen_attn` and whether it takes ``enable_gqa`` (torch >= 2.12; 2.11 has no such argument)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


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


def _autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
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


@dataclass(frozen=True)
class AttentionKernel:
    """An attention kernel called through its forward and backward ops, so its saved tensors are explicit.

    ``forward(q, k, v) -> (out, aux)``: ``out`` shaped like q (in the kernel's memory layout) and
    ``aux`` what the backward needs besides q, k, v and out (the log-sum-exp, [1, Hq, T] or
    [Hq, T] fp32; RNG state; sequence offsets). ``backward(grad_out, q, k, v, out, aux) -> (dq, dk, dv)``,
    each shaped like its input. q, k, v are the layouts the backend passes (see the ``*_kernel``
    functions); ``scale`` and the mask are bound in.
    """

    forward: Callable[..., tuple[torch.Tensor, tuple]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _cudnn_causal_forward(q, k, v, scale):
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset = result[:8]
    return out, (lse, seed, offset, cum_q, cum_k, max_q, max_k)


def _cudnn_causal_backward(grad_out, q, k, v, out, aux, scale):
    lse, seed, offset, cum_q, cum_k, max_q, max_k = aux
    if grad_out.stride() != out.stride():  # cuDNN reads dO in O's layout
        grad_out = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device).copy_(grad_out)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale
    )


def cudnn_causal_kernel(scale: float | None) -> AttentionKernel:
    """cuDNN's fused causal attention (what SDPA runs for one document on Hopper), GQA native.

    q [1, Hq, T, D], k/v [1, Hkv, T, D], bf16/fp16 on CUDA. Ops: ``aten::_scaled_dot_product_cudnn_attention``
    and its ``_backward`` (the pair SDPA's autograd calls; torch 2.11 and 2.13).
    """
    return AttentionKernel(partial(_cudnn_causal_forward, scale=scale), partial(_cudnn_causal_backward, scale=scale))


def _flash_window(sliding_window: int | None) -> tuple[int, int]:
    """flash-attention's (left, right) window of a causal layer: keys with ``q - k < sliding_window`` (-1: all)."""
    return (sliding_window - 1 if sliding_window is not None else -1, 0)


def _flash_varlen_forward(q, k, v, cu_seqlens, max_seqlen, scale, sliding_window):
    left, right = _flash_window(sliding_window)
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scale,
        window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return out, (lse, rng_state, unused)


def _flash_varlen_backward(grad_out, q, k, v, out, aux, cu_seqlens, max_seqlen, scale, sliding_window):
    lse, rng_state, unused = aux
    left, right = _flash_window(sliding_window)
    return torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True,
        rng_state, unused, scale=scale, window_size_left=left, window_size_right=right,
    )  # fmt: skip


def flash_varlen_kernel(
    cu_seqlens: torch.Tensor, max_seqlen: int, scale: float | None, sliding_window: int | None
) -> AttentionKernel:
    """flash-attention 2 over the documents of a packed row (what `varlen_attn` runs), GQA native.

    q [T, Hq, D], k/v [T, Hkv, D], bf16/fp16 on CUDA; ``cu_seqlens`` [N + 1] int32 on the device.
    Ops: ``aten::_flash_attention_forward`` / ``_backward`` (the pair behind ``torch.nn.attention.varlen``).
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
    return AttentionKernel(partial(_cpu_flash_forward, mask=mask, scale=scale), partial(_cpu_flash_backward, mask=mask, scale=scale))


class _KeptAttentionOutput(torch.autograd.Function):
    """Attention whose output was computed earlier (kept): returns it, and differentiates through the kernel's backward op."""

    @staticmethod
    def forward(ctx, backward: Callable, aux: tuple, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        ctx.kernel_backward, ctx.aux = backward, aux
        ctx.save_for_backward(out, q, k, v)
        return out.view_as(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        out, q, k, v = ctx.saved_tensors
        dq, dk, dv = ctx.kernel_backward(grad_out, q, k, v, out, ctx.aux)
        return None, None, None, dq, dk, dv


def _attend_kept(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``kernel``'s output through the active kept ``attention`` (`lightning_ft.strategies.kept`), or None where
    none is active or this layer keeps nothing.

    In the forward (no grad) the call runs the kernel's forward and keeps (out, aux); in the
    recompute the same call returns the kept ``out`` and its backward calls the kernel's backward
    op: the recompute skips attention's forward, the most expensive op of a long row after the
    GEMMs (see benchmarks/RESULTS.md). Costs the kept tensors: [T, Hq, D] in the activation dtype plus
    [Hq, T] fp32 per layer (one set for a layer's CUDA-graph signatures of one token count).
    """
    keep = kept.active("attention")
    if keep is None:
        return None
    if keep.recompute:
        if (values := keep.take()) is None:  # this layer's forward kept nothing: attention runs as usual
            return None
        out, *aux = values
        return _KeptAttentionOutput.apply(kernel.backward, tuple(aux), out, q, k, v)
    with torch.no_grad():
        out, aux = kernel.forward(q, k, v)
    keep.store((out, *aux))  # flat: each tensor its own buffer
    return out


def _cudnn_runs(q: torch.Tensor) -> bool:
    """Whether cuDNN's attention takes these inputs: Hopper or newer (where SDPA prefers it), D <= 128, D % 8 == 0,
    not in deterministic mode."""
    D = q.shape[-1]
    return (
        torch.backends.cuda.cudnn_sdp_enabled()
        and not torch.are_deterministic_algorithms_enabled()  # SDPA does not pick cuDNN then either
        and torch.cuda.get_device_capability(q.device) >= (9, 0)
        and D <= 128 and D % 8 == 0
    )  # fmt: skip


def varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PackedBatch, scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """Flash-attention varlen over the documents of ``batch``; query [1, Hq, T, D], value [1, Hkv, T, Dv <= D]
    → output [1, T, Hq, Dv] (v zero-padded to D for the kernels, `pad_value_head_dim`).

    transformers lays q/k/v out as [1, T, H, D] in memory, so the [T, H, D] views passed on are
    contiguous and the output needs no transpose.

    Raises:
        ValueError: inputs not bf16/fp16 (outside autocast), or a batch too large (`check_varlen_size`).
    """
    # squeeze, not [0]: the backward of a select allocates zeros of the input's shape and copies the
    # gradient in (a fill and a copy per q/k/v and layer-step)
    q_THD, k_THD, v_THD = _autocast_inputs(*(t.squeeze(0).transpose(0, 1) for t in (query, key, value)))
    if q_THD.dtype not in _HALF_DTYPES:
        raise ValueError(
            f"model.attention=varlen needs bfloat16 or float16 q/k/v, got {q_THD.dtype}: set model.dtype=bfloat16 "
            f"or a bf16 trainer.precision, or use model.attention=sdpa"
        )
    v_THD, Dv = pad_value_head_dim(q_THD, v_THD)  # flash-attention and cuDNN's fast kernels take one head dim
    T, Hq, D = q_THD.shape
    if batch.num_docs == 1 and sliding_window is None:
        # One document: plain causal attention, which SDPA runs with cuDNN's fused kernel on Hopper
        # (FlashAttention-3 class) where varlen has flash-attention 2 only; a host-side check, no sync.
        q, k, v = (t.transpose(0, 1)[None] for t in (q_THD, k_THD, v_THD))  # [1, H, T, D] views of the cast inputs
        keeping = kept.active("attention") is not None and _cudnn_runs(q)
        out = _attend_kept(cudnn_causal_kernel(scaling), q, k, v) if keeping else None
        if out is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=k.shape[1] != Hq)
        return out.transpose(1, 2)[..., :Dv]
    check_varlen_size(T, batch.num_docs, Hq, D)
    cu_seqlens = batch.cached(("cu_seqlens", q_THD.device), lambda: device_cu_seqlens(batch.cu_seqlens, q_THD.device))
    if kept.active("attention") is not None:
        kernel = flash_varlen_kernel(cu_seqlens, batch.max_seqlen, scaling, sliding_window)
        if (out_THD := _attend_kept(kernel, q_THD, k_THD, v_THD)) is not None:
            return out_THD[None, ..., :Dv]
    varlen_attn, takes_enable_gqa = _varlen_api()
    extra = {"enable_gqa": True} if takes_enable_gqa and k_THD.shape[1] != Hq else {}
    window = _flash_window(sliding_window)
    out_THD = varlen_attn(
        q_THD, k_THD, v_THD, cu_seqlens, cu_seqlens, batch.max_seqlen, batch.max_seqlen,
        scale=scaling, window_size=window, **extra,
    )  # fmt: skip
    return out_THD[None, ..., :Dv]


def flex_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PackedBatch, scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """FlexAttention with the batch's document-causal BlockMask; query [1, Hq, T, D] → output [1, T, Hq, D]."""
    query, key, value = _autocast_inputs(query, key, value)
    block_mask = batch.cached(
        ("flex_block_mask", query.device, sliding_window),
        lambda: build_block_mask(batch.cu_seqlens, query.device, sliding_window),
    )
    flex = _flex_attention_for(query.device)
    out = flex(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batch: PackedBatch,
    scaling: float | None,
    sliding_window: int | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """SDPA with the batch's dense block-causal mask; query [1, Hq, T, D] → output [1, T, Hq, D].

    Value heads may be narrower than query/key heads (MLA): output [1, T, Hq, Dv].

    Note: k/v are repeated to Hq heads (as transformers does with a mask): SDPA's ``enable_gqa``
    with a mask would leave only its math kernel on CUDA.
    """
    mask = batch.cached(
        ("sdpa_mask", query.device, sliding_window),
        lambda: block_causal_mask(batch.cu_seqlens, query.device, sliding_window),
    )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = None
    if query.device.type == "cpu" and not dropout and kept.active("attention") is not None:
        q, k, v = _autocast_inputs(query, key, value)  # the op is called directly: cast as SDPA's autocast would
        additive = batch.cached(
            ("sdpa_additive_mask", q.device, sliding_window, q.dtype),
            lambda: torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf")),
        )
        v, Dv = pad_value_head_dim(q, v)  # the CPU's flash kernel takes one head dim
        out = _attend_kept(cpu_flash_kernel(additive, scaling), q, k, v)
        out = None if out is None else out[..., :Dv]
    if out is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous()


def packed_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scaling: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The unpacked reference of every backend: each document through SDPA alone, causal.

    Args:
        query: [1, Hq, T, D]; key: [1, Hkv, T, D]; value: [1, Hkv, T, Dv], Dv <= D (MLA's is narrower).
        cu_seqlens: [N + 1] int32 on the host.
        sliding_window: keep only keys with ``q - k < sliding_window`` (None: no window).

    Returns:
        [1, T, Hq, Dv], in the dtype of ``query``.
    """
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    outs = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        keep = torch.ones(end - start, end - start, dtype=torch.bool, device=query.device).tril_()
        if sliding_window is not None:
            keep.triu_(1 - sliding_window)
        q, k, v = (t[:, :, start:end] for t in (query, key, value))
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packed_batch: PackedBatch | None = None,
    backend: str = "sdpa",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed row; the signature transformers' attention interface expects.

    Args:
        query: [1, Hq, T, D]; key: [1, Hkv, T, D]; value: [1, Hkv, T, Dv], Dv <= D (MLA's is narrower).
        packed_batch: the batch being run (None: transformers' SDPA attention handles the call).
        backend: ``varlen``, ``flex`` or ``sdpa`` (bound by `register_packed_attention`).

    Returns:
        ([1, T, Hq, Dv] output, None).

    Raises:
        ValueError: several rows, attention dropout with varlen/flex, a softcap or attention sinks.
    """
    if packed_batch is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got a batch of {query.shape[0]} rows")
    unsupported = [name for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(f"model.attention={backend}: {unsupported} not supported on packed batches")
    window = kwargs.get("sliding_window")
    if backend == "sdpa":
        return sdpa_attention(query, key, value, packed_batch, scaling, window, dropout), None
    if dropout:
        raise ValueError(f"model.attention={backend} has no attention dropout (got {dropout}); use attention=sdpa")
    attend = varlen_attention if backend == "varlen" else flex_attention
    return attend(query, key, value, packed_batch, scaling, window), None


def varlen_unavailable(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    """Why `varlen_attention` cannot run on ``device`` (with weights of ``dtype``), or None when it can."""
    if device.type != "cuda":
        return f"needs CUDA, not {device.type}"
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash-attention"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"flash-attention needs sm80+, {torch.cuda.get_device_name(device)} is not"
    if dtype is not None and dtype not in _HALF_DTYPES:
        return f"flash-attention needs bfloat16/float16 weights, not {dtype}"
    return None


def resolve_attention_backend(backend: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """The concrete backend for ``model.attention`` on ``device`` with weights of ``dtype``, and why.

    ``auto`` is varlen when it can run (`varlen_unavailable`), else sdpa.

    Raises:
        ValueError: an unknown name, ``varlen`` where it cannot run, or ``flex`` off CUDA (no backward there).
    """
    if backend not in BACKENDS:
        raise ValueError(f"model.attention={backend!r}: expected one of {list(BACKENDS)}")
    if backend == "auto":
        reason = varlen_unavailable(device, dtype)
        if reason is None:
            return "varlen", f"auto: flash-attention varlen on {device}"
        return "sdpa", f"auto: varlen {reason}"
    if backend == "varlen" and (reason := varlen_unavailable(device)) is not None:
        alternatives = "flex or sdpa" if device.type == "cuda" else "sdpa"
        raise ValueError(f"model.attention=varlen {reason}: use model.attention={alternatives}")
    if backend == "flex" and device.type != "cuda":  # torch's FlexAttention raises NotImplementedError in backward
        raise ValueError(
            f"model.attention=flex cannot train on {device.type}: FlexAttention has no backward there; use model.attention=sdpa"
        )
    return backend, "set by model.attention"


def register_packed_attention(backend: str = "sdpa") -> str:
    """Register the packed attention of ``backend`` with transformers (idempotent); returns its name.

    Raises:
        ValueError: ``backend`` is not varlen, flex or sdpa (resolve ``auto`` first).
    """
    from transformers import AttentionInterface

    if backend not in ATTENTION_NAMES:
        raise ValueError(f"packed attention backend {backend!r}: expected one of {list(ATTENTION_NAMES)}")
    AttentionInterface.register(ATTENTION_NAMES[backend], partial(packed_attention_forward, backend=backend))
    return ATTENTION_NAMES[backend]
