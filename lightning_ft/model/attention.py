"""Packed attention behind the transformers attention interface: five backends, metadata built once per batch.

`register_packed_attention` registers one attention function per backend with transformers
(``ATTENTION_NAMES``); a model loaded with that ``attn_implementation`` calls it in every layer with
the `PackedBatch` that `FinetuneModule` passes as the ``packed_batch`` keyword (transformers forwards
unknown keywords from the model call down to the attention function). Inside `packed_forward` (how
`FinetuneModule` runs a packed row) transformers builds no mask of its own, so nothing is derived from
``position_ids`` per forward (its packed-sequence detection would cost a device sync). Without a
``packed_batch`` (evaluation on padded rows, generation with a KV cache) every backend runs
`unpacked_attention` on transformers' SDPA mask (padding, sliding windows), sinks and soft-capping included.

Backends (``model.attention``), each checked against `packed_attention_reference` (every document
alone):

    auto    the fastest exact kernel per document (`lightning_ft.model.attention_plan`): cuDNN's fused
            attention (what SDPA runs on Hopper) for each document from a length measured once per
            shape class, flash-attention 2 varlen for the runs of shorter ones. Where flash-attention
            cannot run (the CPU, fp32 weights, pre-sm80 GPUs) auto is sdpa.
    cudnn   cuDNN for every document, one launch each (Hopper or newer).
    varlen  flash-attention 2 varlen (what ``torch.nn.attention.varlen`` runs) over the packed
            [T, H, D] tensors with ``cu_seqlens``/``max_seqlen``: no mask, no padding, work ∝ Σ len².
    flex    FlexAttention with a document-causal `BlockMask`. `flex_attention` is compiled once per
            process with dynamic shapes, so a new packed length (of more than one 128-token block)
            does not recompile. On the CPU torch runs its unfused reference instead (forward only:
            torch has no FlexAttention backward on the CPU).
    sdpa    `F.scaled_dot_product_attention` with a dense [T, T] block-diagonal causal mask: O(T²)
            memory; for the CPU and GPUs without flash-attention.

auto, cudnn and varlen take CUDA (sm80+) and bf16/fp16 (fp32 inputs under autocast are cast to the
autocast dtype, as SDPA's autocast does); GQA runs natively (k/v never repeated). What else
attention needs, per backend:

    sliding window   varlen, flex, sdpa; auto and cudnn run a windowed layer's documents through
                     flash-attention 2 (cuDNN's causal kernel has no window)
    attention sinks  every backend (gpt-oss's ``s_aux``): the output corrected with the kernel's
                     log-sum-exp (`lightning_ft.model.attention_kernels`)
    soft-capping     flex and sdpa; auto, cudnn and varlen run a soft-capped layer through flex
                     (sdpa on the CPU), warned once
    narrower v       every backend (MLA): v zero-padded for the kernels that take one head dim

Built once per batch and device (`PackedBatch.cached`, keyed by device), reused by all L layers, all
from the host ``cu_seqlens``/``max_seqlen`` and copied with ``non_blocking=True``, so no layer ever
waits on the device:

    auto/cudnn/varlen  the segment plan and each run's offsets (one copy), or for one run the
                       batch's ``cu_seqlens`` (one copy of N + 1 int32)
    flex               the BlockMask: its block structure computed on the host, copied; document
                       ids [T] on the device
    sdpa               the [1, 1, T, T] bool mask

Kept attention (with CUDA graphs, `lightning_ft.strategies.cuda_graphs`): auto, cudnn, varlen (and
sdpa on the CPU) call their kernels' forward and backward ops through
`lightning_ft.model.attention_kernels.attend`, so a layer's forward can keep attention's output and
log-sum-exp (`lightning_ft.strategies.kept`, kind ``attention``) and the backward's recompute returns
them instead of running attention's forward again.

Shape suffixes: T tokens of the packed row, N documents, Hq query heads, Hkv key/value heads, D head
dim, M = ceil(T / block) blocks of a BlockMask. Values may have a narrower head dim than queries and
keys (MLA: DeepSeek-V3); the kernels that take one head dim get v zero-padded (`pad_value_head_dim`).

Sources: PyTorch ``torch/nn/attention/varlen.py`` (2.11 and 2.13), ``torch/nn/attention/flex_attention.py``;
transformers v5
``integrations/sdpa_attention.py``, ``masking_utils.py`` (sliding window: key kept iff q - k < window).
"""

from __future__ import annotations

import functools
import logging
import threading
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.nn.functional as F

from lightning_ft.data.packing import PackedBatch
from lightning_ft.errors import check_choice
from lightning_ft.model.attention_kernels import (
    HALF_DTYPES, attend, autocast_inputs, check_varlen_size, cpu_flash_kernel, cudnn_runs, pad_value_head_dim,
)  # fmt: skip
from lightning_ft.model.attention_plan import NEVER, batch_plan, crossover, segmented_kernel
from lightning_ft.strategies import kept

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cudnn", "varlen", "flex", "sdpa")
VARLEN_FAMILY = ("auto", "cudnn", "varlen")  # the backends of `varlen_attention`: cuDNN and flash-attention 2 segments

# Note: transformers matches substrings of attn_implementation names ("sdpa", "flash",
# "flex_attention") to run its own checks and fallbacks, so no name here contains one of them.
ATTENTION_NAMES = {
    "sdpa": "lightning_ft", "varlen": "lightning_ft_varlen", "cudnn": "lightning_ft_cudnn", "auto": "lightning_ft_auto",
    "flex": "lightning_ft_flex",
}  # fmt: skip

FLEX_BLOCK_SIZE = 128
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


def _min_cudnn_tokens(policy: str, q_THD: torch.Tensor, k_THD: torch.Tensor, v_THD: torch.Tensor,
                      sliding_window: int | None) -> int:
    """From how many tokens a document runs cuDNN under ``policy`` (`attention_plan.NEVER`: none does)."""
    if policy == "varlen" or sliding_window is not None or not cudnn_runs(q_THD):  # cuDNN's causal kernel has no window
        return NEVER
    return 1 if policy == "cudnn" else crossover(q_THD, k_THD, v_THD)


def varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PackedBatch, scaling: float | None,
    sliding_window: int | None, policy: str = "varlen", sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The documents of ``batch`` through cuDNN (long ones, alone) and flash-attention 2 varlen (runs of the others).

    query [1, Hq, T, D], key [1, Hkv, T, D], value [1, Hkv, T, Dv <= D] → output [1, T, Hq, Dv] (v
    zero-padded to D for the kernels, `pad_value_head_dim`). ``policy``: ``varlen`` (flash-attention 2
    for every document), ``cudnn`` (cuDNN for every document), ``auto`` (cuDNN from the measured
    `attention_plan.crossover` length on). Layers with a sliding window, and GPUs where cuDNN's
    attention does not run (`cudnn_runs`), use flash-attention 2 for every document. ``sinks``: [Hq]
    attention-sink logits (gpt-oss), or None.

    transformers lays q/k/v out as [1, T, H, D] in memory, so the [T, H, D] views passed on are
    contiguous and the output needs no transpose.

    Raises:
        ValueError: inputs not bf16/fp16 (outside autocast), or a batch too large (`check_varlen_size`).
    """
    # squeeze, not [0]: the backward of a select allocates zeros of the input's shape and copies the
    # gradient in (a fill and a copy per q/k/v and layer-step)
    q_THD, k_THD, v_THD = autocast_inputs(*(t.squeeze(0).transpose(0, 1) for t in (query, key, value)))
    if q_THD.dtype not in HALF_DTYPES:
        raise ValueError(
            f"model.attention={policy} needs bfloat16 or float16 q/k/v, got {q_THD.dtype}: set model.dtype=bfloat16 "
            f"or a bf16 trainer.precision, or use model.attention=sdpa"
        )
    v_THD, Dv = pad_value_head_dim(q_THD, v_THD)  # flash-attention and cuDNN's fast kernels take one head dim
    T, Hq, D = q_THD.shape
    segments, offsets = batch_plan(batch, _min_cudnn_tokens(policy, q_THD, k_THD, v_THD, sliding_window), q_THD.device)
    if any(seg.kind == "varlen" for seg in segments):
        check_varlen_size(T, batch.num_docs, Hq, D)
    kernel = segmented_kernel(segments, offsets, scaling, sliding_window)
    return attend(kernel, q_THD, k_THD, v_THD, sinks)[None, ..., :Dv]


def _softcapped(softcap: float | None) -> Callable | None:
    """FlexAttention's ``score_mod`` for logit soft-capping (Gemma 2: ``softcap · tanh(score / softcap)``), or None."""
    if softcap is None:
        return None

    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def flex_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: PackedBatch, scaling: float | None,
    sliding_window: int | None, sinks: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """FlexAttention with the batch's document-causal BlockMask; query [1, Hq, T, D] → output [1, T, Hq, D].

    ``softcap``: logit soft-capping as a ``score_mod``. ``sinks`` ([Hq] logits): the output corrected
    with FlexAttention's log-sum-exp, ``out · σ(lse − sink)``, differentiated by autograd (FlexAttention
    takes the log-sum-exp's gradient).
    """
    query, key, value = autocast_inputs(query, key, value)
    block_mask = batch.cached(
        ("flex_block_mask", query.device, sliding_window),
        lambda: build_block_mask(batch.cu_seqlens, query.device, sliding_window),
    )
    flex = _flex_attention_for(query.device)
    gqa = query.shape[1] != key.shape[1]
    kwargs = dict(block_mask=block_mask, scale=scaling, enable_gqa=gqa, score_mod=_softcapped(softcap))
    if sinks is None:
        out = flex(query, key, value, **kwargs)
    else:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = flex(query, key, value, return_aux=AuxRequest(lse=True), **kwargs)
        out = (out.float() * torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None])[..., None]).to(out.dtype)
    return out.transpose(1, 2).contiguous()


def _math_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor, scaling: float | None,
    sinks: torch.Tensor | None, softcap: float | None,
) -> torch.Tensor:
    """Attention as written out (transformers' eager attention): scores, soft-capping, mask, the sink as one more
    logit of the softmax (dropped after), softmax in fp32; query [1, Hq, T, D], key/value with Hq heads,
    ``keep`` [.., T, T] bool → [1, Hq, T, Dv]."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (query @ key.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs.to(value.dtype) @ value


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batch: PackedBatch,
    scaling: float | None,
    sliding_window: int | None,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """SDPA with the batch's dense block-causal mask; query [1, Hq, T, D] → output [1, T, Hq, D].

    Value heads may be narrower than query/key heads (MLA): output [1, T, Hq, Dv]. On the CPU the
    flash kernel runs through `attend` (kept attention, ``sinks``); soft-capping, and sinks on CUDA,
    take `_math_attention` (the dense mask is O(T²) already).

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
    if softcap is not None or (sinks is not None and (query.device.type != "cpu" or dropout)):
        if dropout:
            raise ValueError("model.attention=sdpa: attention dropout with soft-capping or sinks is not supported")
        return _math_attention(*autocast_inputs(query, key, value), mask, scaling, sinks, softcap).transpose(1, 2).contiguous()
    out = None
    if query.device.type == "cpu" and not dropout and (sinks is not None or kept.active("attention") is not None):
        q, k, v = autocast_inputs(query, key, value)  # the op is called directly: cast as SDPA's autocast would
        additive = batch.cached(
            ("sdpa_additive_mask", q.device, sliding_window, q.dtype),
            lambda: torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf")),
        )
        v, Dv = pad_value_head_dim(q, v)  # the CPU's flash kernel takes one head dim
        out = attend(cpu_flash_kernel(additive, scaling), q, k, v, sinks)[..., :Dv]
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
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The unpacked reference of every backend: each document alone, causal, through SDPA (with ``sinks`` or
    ``softcap``: written out as transformers' eager attention does, `_math_attention`).

    Args:
        query: [1, Hq, T, D]; key: [1, Hkv, T, D]; value: [1, Hkv, T, Dv], Dv <= D (MLA's is narrower).
        cu_seqlens: [N + 1] int32 on the host.
        sliding_window: keep only keys with ``q - k < sliding_window`` (None: no window).
        sinks: [Hq] attention-sink logits; softcap: logit soft-capping (None: none).

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
        if sinks is None and softcap is None:
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scaling))
        else:
            outs.append(_math_attention(q, k, v, keep, scaling, sinks, softcap).to(query.dtype))
    return torch.cat(outs, dim=2).transpose(1, 2)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


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
        packed_batch: the batch being run (None: an unpacked call, `unpacked_attention`).
        backend: ``auto``, ``cudnn``, ``varlen``, ``flex`` or ``sdpa`` (bound by `register_packed_attention`).
        kwargs: from the attention module: ``sliding_window``, ``s_aux`` ([Hq] attention-sink logits,
            gpt-oss), ``softcap`` (logit soft-capping, Gemma 2).

    A layer with soft-capping runs flex on CUDA (sdpa's written-out attention on the CPU) under
    auto/cudnn/varlen, which have no soft-capping: warned once.

    Returns:
        ([1, T, Hq, Dv] output, None).

    Raises:
        ValueError: several rows, keys that are not the row's tokens (more or fewer keys than queries: e.g. DeepSeek-V4's
            compressed keys appended to long rows, which no per-document mask covers), or attention dropout with
            auto/cudnn/varlen/flex.
    """
    if packed_batch is None:
        return unpacked_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs), None
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got a batch of {query.shape[0]} rows")
    if key.shape[-2] != query.shape[-2]:
        model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
        raise ValueError(
            f"{model_type}: its attention has {key.shape[-2]} keys for the row's {query.shape[-2]} tokens (entries of its "
            "own joined to the keys, such as compressed keys), which a packed row of several documents cannot mask per "
            "document, so it needs padded rows (one document each)"
        )
    window, sinks, softcap = kwargs.get("sliding_window"), kwargs.get("s_aux"), kwargs.get("softcap")
    if softcap is not None and backend in VARLEN_FAMILY:
        fallback = "flex" if query.device.type == "cuda" else "sdpa"
        _warn_once(f"model.attention={backend}: flash-attention and cuDNN have no logit soft-capping; "
                   f"the soft-capped layers run {fallback}")
        backend = fallback
    if backend == "sdpa":
        return sdpa_attention(query, key, value, packed_batch, scaling, window, dropout, sinks, softcap), None
    if dropout:
        raise ValueError(f"model.attention={backend} has no attention dropout (got {dropout}); use attention=sdpa")
    if backend == "flex":
        return flex_attention(query, key, value, packed_batch, scaling, window, sinks, softcap), None
    return varlen_attention(query, key, value, packed_batch, scaling, window, backend, sinks), None


def unpacked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float = 0.0,
    **kwargs,
) -> torch.Tensor:
    """Attention of a call without a packed batch (evaluation on padded rows, generation with a KV cache): [B, T, Hq, Dv].

    ``attention_mask`` is transformers' SDPA mask ([B, 1, Tq, Tk] bool: causal, padding, sliding window; None
    where plain causal attention is exact), registered for our attention by `register_packed_attention`. Transformers'
    SDPA attention runs it, but a layer with attention sinks (``s_aux``) or soft-capping (``softcap``), which
    SDPA has not, runs `_math_attention` (transformers' eager attention, written out); a query row with no key
    to attend (padding) attends every key instead of producing NaN (its output is not used).

    Raises:
        ValueError: attention dropout with sinks or soft-capping.
    """
    sinks, softcap = kwargs.get("s_aux"), kwargs.get("softcap")
    if sinks is None and softcap is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)[0]
    if dropout:
        raise ValueError("attention dropout with soft-capping or sinks is not supported on unpacked rows")
    q_len, kv_len = query.shape[-2], key.shape[-2]
    keep = attention_mask
    if keep is None:  # causal, the queries being the last q_len positions (a KV cache before them)
        keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return _math_attention(*autocast_inputs(query, key, value), keep, scaling, sinks, softcap).transpose(1, 2).contiguous()


@contextmanager
def packed_forward() -> Iterator[None]:
    """Run a model forward on a packed row without transformers' attention mask.

    Our attention names are registered with transformers' SDPA mask (`register_packed_attention`), which
    unpacked calls need (padding, sliding windows). A packed row needs none (its attention reads the batch's
    offsets), and building one would cost a [T, T] mask (4 GiB at 64K tokens) and a device sync (transformers'
    packed-sequence detection from ``position_ids``). Inside, our names are out of transformers' mask registry,
    which makes it skip both, as for any attention without a mask function.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    registry = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping  # what transformers checks ("custom attention without mask")
    removed = {name: registry.pop(name) for name in ATTENTION_NAMES.values() if name in registry}
    try:
        yield
    finally:
        registry.update(removed)


def varlen_unavailable(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    """Why `varlen_attention` cannot run on ``device`` (with weights of ``dtype``), or None when it can."""
    if device.type != "cuda":
        return f"needs CUDA, not {device.type}"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash-attention"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"flash-attention needs sm80+, {torch.cuda.get_device_name(device)} is not"
    if dtype is not None and dtype not in HALF_DTYPES:
        return f"flash-attention needs bfloat16/float16 weights, not {dtype}"
    return None


def resolve_attention_backend(backend: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """The concrete backend for ``model.attention`` on ``device`` with weights of ``dtype``, and why.

    ``auto`` stays auto (cuDNN for long documents, flash-attention 2 for the rest) where flash-attention
    runs (`varlen_unavailable`), else is sdpa.

    Raises:
        ValueError: an unknown name, ``varlen`` or ``cudnn`` where it cannot run, or ``flex`` off CUDA
            (no backward there).
    """
    check_choice("model.attention", backend, BACKENDS)
    if backend == "auto":
        reason = varlen_unavailable(device, dtype)
        if reason is None:
            return "auto", f"cuDNN for long documents, flash-attention 2 varlen for the others, on {device}"
        return "sdpa", f"auto: varlen {reason}"
    if backend in ("varlen", "cudnn") and (reason := varlen_unavailable(device)) is not None:
        alternatives = "flex or sdpa" if device.type == "cuda" else "sdpa"
        raise ValueError(f"model.attention={backend} {reason}: use model.attention={alternatives}")
    if backend == "cudnn" and torch.cuda.get_device_capability(device) < (9, 0):
        raise ValueError(f"model.attention=cudnn needs a Hopper GPU or newer (where SDPA runs cuDNN's attention), "
                         f"not {torch.cuda.get_device_name(device)}: use model.attention=varlen")
    if backend == "flex" and device.type != "cuda":  # torch's FlexAttention raises NotImplementedError in backward
        raise ValueError(
            f"model.attention=flex cannot train on {device.type}: FlexAttention has no backward there; use model.attention=sdpa"
        )
    return backend, "set by model.attention"


def register_packed_attention(backend: str = "sdpa") -> str:
    """Register the packed attention of ``backend`` with transformers (idempotent); returns its name.

    Raises:
        ValueError: ``backend`` is not one of `ATTENTION_NAMES`.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if backend not in ATTENTION_NAMES:
        raise ValueError(f"packed attention backend {backend!r}: expected one of {list(ATTENTION_NAMES)}")
    AttentionInterface.register(ATTENTION_NAMES[backend], partial(packed_attention_forward, backend=backend))
    AttentionMaskInterface.register(ATTENTION_NAMES[backend], sdpa_mask)  # for unpacked calls (`packed_forward`)
    return ATTENTION_NAMES[backend]
