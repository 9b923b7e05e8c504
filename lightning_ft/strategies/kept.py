"""Kept activations: results a decoder layer's forward keeps for its backward's recompute (CUDA graphs).

A checkpointed layer recomputes its forward in backward to rebuild the autograd graph. Some of that
recompute is expensive and its values are the forward's exactly (the same kernels on the same
inputs): attention's output, the outputs of the projections (GEMMs). `lightning_ft.strategies.cuda_graphs`
gives each recorded layer one `KeptActivations` per kind; inside `keeping`, every call of that kind
in the forward offers its results (`KeptActivations.store`) and the recompute's same call takes
them back (`KeptActivations.take`) instead of computing them. This is selective activation
checkpointing: keep the outputs of the compute-bound ops, recompute the memory-bound ones (the
policy of PyTorch's selective activation checkpointing, ``torch.utils.checkpoint``; Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models"), under a memory budget.

Kinds and the calls that keep:

    attention     `lightning_ft.model.attention`: the attention output and log-sum-exp
    projections   `lightning_ft.kernels.lora` (through `lightning_ft.model.patching`): the output and thin
                  x·Aᵀ of a LoRA linear layer of attention (q/k/v/o, as the patch table lists them)
    mlp           the same of a LoRA linear layer of a dense MLP (gate/up/down, shared experts);
                  `lightning_ft.model.moe`: the experts' gate/up output (split LoRA added) and its thin
                  s·x·Aᵀ (scaled by the LoRA scaling), where the row is not run in token chunks

Each kind is one class of the memory plan (`lightning_ft.strategies.planner`): attention's projections
and the MLP's differ in bytes and recompute time per layer (on gpt-oss-20b at 32K tokens, v/o are
~0.2 GiB a layer, the experts' gate/up ~1.4 GiB), so the plan can keep, offload or recompute each on
its own.

Budget: the layer's first forward asks ``allow`` with each call's bytes, until it refuses once; the
calls from there on keep nothing (the layer keeps a prefix of its calls, but for calls that reuse
shared buffers, below) and are computed in the recompute as before. The first forward's tensors
become the buffers; later forwards copy into them, so a forward recorded into a CUDA graph writes
memory allocated outside the graph's pool (which other graphs may use as scratch): run the first
forward eagerly.

Shared buffers: the keeps of one layer's recordings for other inputs (CUDA graphs record per input
signature, e.g. per packed-batch layout) may share one ``shared`` store. A first forward's call
whose results have the shapes and dtypes a call at the same position already kept there copies
into those buffers and asks no budget, so a layer keeps one set of buffers for all its signatures
of one token count instead of one per signature. Whoever replays must then know which input the
buffers hold (`lightning_ft.strategies.cuda_graphs` tracks it per buffer set). The same mechanism
gives offloaded kinds their staging sets: the layers that offload a kind share a store per staging
set (two, taken in turns), so their buffers are one set's, whose values go to pinned host memory
between a layer's forward and its backward (`lightning_ft.strategies.offload`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

__all__ = ["KINDS", "KeptActivations", "active", "keeping", "kinds_allowed", "stored_nbytes"]

KINDS = ("attention", "projections", "mlp")


def kinds_allowed(keep_attention: bool, keep_projections: bool) -> dict[str, bool]:
    """Per kind (`KINDS`), whether it may be kept under the options ``strategy.keep_attention`` and
    ``strategy.keep_projections`` (which covers attention's projections and the MLP's)."""
    return {"attention": keep_attention, "projections": keep_projections, "mlp": keep_projections}


@dataclass
class KeptActivations:
    """One decoder layer's kept results of one kind (`KINDS`), one entry per call in call order.

    Attributes:
        kind: what is kept (one of `KINDS`), for the active lookup and messages.
        allow: asked with a call's bytes in the layer's first forward (a memory budget), until it
            says no; the calls refused keep nothing and are recomputed as before.
        nbytes: the bytes kept (tensors only).
        kept: per call, the flat tuple stored (tensors are the buffers, other entries as they were),
            or None for a call that keeps nothing.
        recompute: inside `keeping`: a recompute (take) rather than a forward (store).
        calls: stores or takes so far inside the current `keeping`.
        shared: buffers by (call position, shapes and dtypes), shared with the keeps of the same
            layer's other recordings (None: not shared); ``nbytes`` counts only those this keep made.

    Raises:
        RuntimeError: a first store under CUDA-graph capture, or a recompute whose calls do not
            match the forward's.
    """

    kind: str
    allow: Callable[[int], bool]
    nbytes: int = 0
    kept: list[tuple[Any, ...] | None] = field(default_factory=list)
    recompute: bool = False
    calls: int = 0
    shared: dict[tuple, tuple[Any, ...]] | None = None

    @property
    def enabled(self) -> bool | None:
        """Whether this layer keeps anything of its kind: None until its first forward offered a call."""
        return any(entry is not None for entry in self.kept) if self.kept else None

    def store(self, values: tuple[Any, ...]) -> bool:
        """Offer ``values`` of this call (a forward); True when kept, False when this call keeps nothing.

        In the layer's first forward the tensors become the buffers (the caller must not change them
        in place afterwards); in a later forward they are copied into the buffers.
        """
        index, self.calls = self.calls, self.calls + 1
        if index < len(self.kept):  # a later forward (a graph's recording or replay): into the buffers
            buffers = self.kept[index]
            if buffers is None:
                return False
            _copy_to_buffers(buffers, values)
            return True
        key = (index, tuple(_layout(v) for v in values))
        buffers = self.shared.get(key) if self.shared is not None else None
        if buffers is not None:  # the same call of another recording of this layer kept alike: its buffers
            self.kept.append(buffers)
            _copy_to_buffers(buffers, values)
            return True
        refused = any(entry is None for entry in self.kept)  # a prefix of the calls keeps
        if refused or not self.allow(_nbytes(values)):
            self.kept.append(None)
            return False
        first = next((v for v in values if isinstance(v, torch.Tensor)), None)
        if first is not None and first.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"kept {self.kind}: a layer's first forward must run eagerly (its buffers would land in the graph's pool)"
            )
        self.kept.append(values)
        self.nbytes += _nbytes(values)
        if self.shared is not None:
            self.shared[key] = values
        return True

    def buffers(self) -> tuple[Any, ...] | None:
        """In a later forward, the buffers the next `store` copies into (a caller may compute into
        them and store them: no copy; or store a buffer first and write it later, before anything
        reads it); None in the first forward or where the call keeps nothing."""
        return self.kept[self.calls] if not self.recompute and self.calls < len(self.kept) else None

    def take(self) -> tuple[Any, ...] | None:
        """What the forward's call at this position stored (a recompute); None: it kept nothing, compute it."""
        if self.calls >= len(self.kept):
            raise RuntimeError(f"kept {self.kind}: the recompute made more {self.kind} calls than the layer's first forward")
        values = self.kept[self.calls]
        self.calls += 1
        return values


_ACTIVE: dict[str, KeptActivations] = {}


def _nbytes(values: tuple[Any, ...]) -> int:
    return sum(v.nbytes for v in values if isinstance(v, torch.Tensor))


def stored_nbytes(shared: dict[tuple, tuple[Any, ...]]) -> int:
    """The bytes of the buffers in a shared store (`KeptActivations.shared`), each set once."""
    return sum(_nbytes(values) for values in shared.values())


def _copy_to_buffers(buffers: tuple[Any, ...], values: tuple[Any, ...]) -> None:
    for buffer, value in zip(buffers, values):
        if isinstance(buffer, torch.Tensor) and value is not buffer:  # not computed into it (`buffers`)
            buffer.copy_(value)


def _layout(value: Any) -> Any:
    """What a buffer for ``value`` must match to be shared: a tensor's shape, strides, dtype, device; else the value."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.device)
    return value


@contextmanager
def keeping(*keeps: KeptActivations, recompute: bool) -> Iterator[None]:
    """Within: each keep's kind stores its calls' results in it (a forward) or takes them back (``recompute``).

    Raises:
        RuntimeError: on exit, a keep that saw another number of calls than its first forward made.
    """
    for keep in keeps:
        keep.recompute, keep.calls = recompute, 0
        _ACTIVE[keep.kind] = keep
    try:
        yield
    finally:
        for keep in keeps:
            _ACTIVE.pop(keep.kind, None)
    for keep in keeps:
        if keep.calls != len(keep.kept):
            raise RuntimeError(
                f"kept {keep.kind}: {keep.calls} {keep.kind} calls, the layer's first forward made {len(keep.kept)}"
            )


def active(kind: str) -> KeptActivations | None:
    """The `KeptActivations` of ``kind`` inside `keeping`, else None."""
    return _ACTIVE.get(kind)
