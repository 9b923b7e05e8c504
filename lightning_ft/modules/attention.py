"""Packed attention behind the transformers attention interface.

`register_packed_attention` registers `packed_attention_forward` under the name ``lightning_ft``;
a model loaded with ``attn_implementation="lightning_ft"`` then calls it in every layer with the
`PackedBatch` that `FinetuneModule` passes as the ``packed_batch`` keyword (transformers forwards
unknown keywords from the model call down to the attention function). transformers builds no
mask of its own for a name it has no mask function for, so nothing is derived from
``position_ids`` per forward (its packed-sequence detection would cost a device sync).

Backend ``sdpa``: `torch.nn.functional.scaled_dot_product_attention` with the block-diagonal causal
mask of the batch (picture in `lightning_ft.data.packing`), built once per batch and device and
reused by all layers. Without a ``packed_batch`` (e.g. generation with a KV cache), the call goes
to transformers' own SDPA attention.

Shapes: query [B, Hq, T, D], key/value [B, Hkv, T, D] (GQA when Hkv < Hq); output [B, T, Hq, D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_ft.data.packing import PackedBatch

ATTENTION_NAME = "lightning_ft"


def block_causal_mask(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[1, 1, T, T] bool mask, True where a query may attend a key (same document, not in the future).

    Args:
        cu_seqlens: [num_docs + 1] int32 on the host.
        device: where the mask is needed. The document ids are computed on the host and copied,
            so building it never waits on the device.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc_T = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(device, non_blocking=True)
    T = doc_T.numel()
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=device).tril_()
    return ((doc_T[:, None] == doc_T[None, :]) & causal_TT)[None, None]


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packed_batch: PackedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over a packed row; the signature transformers' attention interface expects.

    Raises:
        ValueError: a sliding-window layer (not supported by this backend yet).
    """
    if packed_batch is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("model.attention=sdpa: sliding-window layers are not supported on packed batches")
    mask = packed_batch.cached(("sdpa_mask", query.device), lambda: block_causal_mask(packed_batch.cu_seqlens, query.device))
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def register_packed_attention() -> str:
    """Register `packed_attention_forward` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention_forward)
    return ATTENTION_NAME
