"""Packing tokenized documents into sequences of a token budget, and the `PackedBatch` contract.

Three documents of 3, 2 and 4 tokens packed into one row of T = 9 tokens::

    input_ids     a0 a1 a2 | b0 b1 | c0 c1 c2 c3
    position_ids   0  1  2 |  0  1 |  0  1  2  3      restart at 0 in every document
    labels        -- a1 a2 | -- b1 | -- c1 c2 c3      (-- = -100; prompt tokens are -100 too)
    cu_seqlens    [0, 3, 5, 9]                        int32, num_docs + 1 offsets
    max_seqlen    4                                   Python int

The first token of every document is never a target: the loss shifts labels by one, so the
logits at ``a2`` would otherwise be trained to predict ``b0`` across the boundary.

Attention sees the block-diagonal causal mask (row = query, column = key, ``x`` = attends)::

    a0 x
    a1 x x
    a2 x x x
    b0       x
    b1       x x
    c0           x
    c1           x x
    c2           x x x
    c3           x x x x

Everything here is built on the host in the collator (no device sync); `PackedBatch.cached`
holds the attention structures derived from it (per device), built once per batch and reused by
every layer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Sequence

import torch

from lightning_ft.data.tokenization import IGNORE_INDEX


@dataclass
class PackedBatch:
    """One packed micro-batch: documents concatenated into a single row.

    Attributes:
        input_ids: [1, T] int64.
        labels: [1, T] int64, unshifted (HF convention), ``-100`` where not trained on.
        position_ids: [1, T] int64, restarting at 0 in every document.
        cu_seqlens: [num_docs + 1] int32 cumulative document lengths; always kept on the host.
        max_seqlen: the longest document, a Python int.
        num_target_tokens: how many labels are not ``-100`` (a Python int).
        step_tokens: tokens in the whole optimizer step this micro-batch belongs to, over all its
            micro-batches and all ranks (a Python int, known on the host, so normalising needs no
            collective and no device sync).
        step_target_tokens: likewise for target tokens: the divisor of the step's summed loss.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_target_tokens: int
    step_tokens: int = 0
    step_target_tokens: int = 0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        """T, the number of tokens in the row."""
        return self.input_ids.shape[1]

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The batch with its token tensors on ``device`` (``cu_seqlens`` stays on the host) and a fresh cache.

        Lightning calls this to move the batch (any object with ``.to`` is moved that way).
        """
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(
            self,
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            position_ids=move(self.position_ids),
            _cache={},
        )

    def padded(self, num_tokens: int, pad_id: int = 0) -> PackedBatch:
        """The batch grown to ``num_tokens`` tokens by one trailing document of padding (or itself).

        The padding document has ``num_tokens - T`` tokens of ``pad_id``, every label ``-100`` and
        positions restarting at 0; it is a document of its own in ``cu_seqlens``, so no real token
        attends to it, and with causal attention no real token's output changes. Its tokens are no
        targets: the loss, ``num_target_tokens`` and the step counts are the batch's. Tensors stay on
        their device (the new ones are made there); ``cu_seqlens`` stays on the host; the cache is fresh.

        Why: CUDA graphs are recorded per token count (`lightning_ft.strategies.cuda_graphs`), and packed
        rows each have their own; padded to one count, every row replays the same graphs.

        Raises:
            ValueError: ``num_tokens`` below the batch's token count.
        """
        pad = num_tokens - self.num_tokens
        if pad < 0:
            raise ValueError(f"cannot pad a batch of {self.num_tokens} tokens to {num_tokens}")
        if pad == 0:
            return self
        device = self.input_ids.device
        tail = lambda value: torch.full((1, pad), value, dtype=torch.long, device=device)  # noqa: E731
        return replace(
            self,
            input_ids=torch.cat([self.input_ids, tail(pad_id)], dim=1),
            labels=torch.cat([self.labels, tail(IGNORE_INDEX)], dim=1),
            position_ids=torch.cat([self.position_ids, torch.arange(pad, device=device)[None]], dim=1),
            cu_seqlens=torch.cat([self.cu_seqlens, torch.tensor([num_tokens], dtype=self.cu_seqlens.dtype)]),
            max_seqlen=max(self.max_seqlen, pad),
            _cache={},
        )

    def padded_rows(self, pad_id: int = 0) -> dict[str, torch.Tensor]:
        """The documents one per row, right-padded to ``max_seqlen``: the model inputs of an
        architecture that cannot take packed rows (`lightning_ft.model.support`).

        Returns ``input_ids``, ``labels`` (``-100`` on padding), ``position_ids`` (0.. per row) and
        ``attention_mask`` (1 on tokens, 0 on padding), each [N, max_seqlen] int64 on the batch's
        device. The gather index is built on the host from ``cu_seqlens`` and copied without
        blocking. With causal attention, padding after a document changes none of its outputs.
        """
        device = self.input_ids.device
        starts_N1 = self.cu_seqlens[:-1].long()[:, None]
        lengths_N1 = self.cu_seqlens.diff().long()[:, None]
        offsets_1L = torch.arange(self.max_seqlen)[None]
        mask_NL = offsets_1L < lengths_N1
        index_NL = torch.where(mask_NL, starts_N1 + offsets_1L, 0).to(device, non_blocking=True)
        mask_NL = mask_NL.to(device, non_blocking=True)
        take = lambda t, fill: torch.where(mask_NL, t[0][index_NL], fill)  # noqa: E731
        return {
            "input_ids": take(self.input_ids, pad_id),
            "labels": take(self.labels, IGNORE_INDEX),
            "position_ids": take(self.position_ids, 0),
            "attention_mask": mask_NL.long(),
        }

    def cached(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """Return ``build()`` computed once per batch for ``key`` (include the device in the key)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def pack_sequences(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group documents into bins of at most ``max_tokens`` tokens, best-fit decreasing.

    Documents are placed longest first into the fullest bin that still has room (O(n log n) with
    a sorted list of free capacities), which packs at least as tightly as first-fit decreasing.

    Args:
        lengths: token count of each document; every one must be in 1..max_tokens.
        max_tokens: the token budget of a packed row.

    Returns:
        Lists of document indices, one list per packed row, in a deterministic order.

    Raises:
        ValueError: a document is empty or longer than ``max_tokens``.
    """
    bad = [i for i, n in enumerate(lengths) if not 0 < n <= max_tokens]
    if bad:
        raise ValueError(f"document {bad[0]} has {lengths[bad[0]]} tokens; each must have 1..{max_tokens} (data.max_tokens)")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (remaining capacity, bin index), sorted
    for i in order:
        n = lengths[i]
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            room, b = free.pop(pos)
            bins[b].append(i)
            bisect.insort(free, (room - n, b))
        else:
            bins.append([i])
            bisect.insort(free, (max_tokens - n, len(bins) - 1))
    return bins


def collate_packed(
    docs: Sequence[tuple[Sequence[int], Sequence[int]]], step_tokens: int = 0, step_target_tokens: int = 0
) -> PackedBatch:
    """Build a `PackedBatch` from ``(input_ids, labels)`` documents (see the module picture).

    ``step_tokens``/``step_target_tokens`` are stored as given (see `PackedBatch`); 0 means "this
    micro-batch alone" and is replaced by its own counts.

    Raises:
        ValueError: no documents, or a document whose ids and labels differ in length.
    """
    if not docs:
        raise ValueError("cannot pack zero documents")
    input_ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    cu_seqlens = [0]
    for ids, labs in docs:
        if len(ids) != len(labs) or not ids:
            raise ValueError(f"a document has {len(ids)} input ids and {len(labs)} labels")
        input_ids.extend(ids)
        labels.append(IGNORE_INDEX)  # the first token is never predicted from the previous document
        labels.extend(labs[1:])
        positions.extend(range(len(ids)))
        cu_seqlens.append(cu_seqlens[-1] + len(ids))
    labels_t = torch.tensor(labels, dtype=torch.long)
    num_target_tokens = int((labels_t != IGNORE_INDEX).sum())
    return PackedBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long)[None],
        labels=labels_t[None],
        position_ids=torch.tensor(positions, dtype=torch.long)[None],
        cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32),
        max_seqlen=max(len(ids) for ids, _ in docs),
        num_target_tokens=num_target_tokens,
        step_tokens=step_tokens or len(input_ids),
        step_target_tokens=step_target_tokens or num_target_tokens,
    )
