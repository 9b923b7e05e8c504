"""Which pass of a checkpointed decoder layer is running: its forward, or the recompute its backward runs.

A checkpointed layer (Chen et al., 2016) keeps its input only and runs its forward again in backward. Modules inside
it may do less in either pass where nobody reads what they skip; they ask here. Two mechanisms checkpoint one decoder
layer at a time:

* a recompute differentiated at once, ``autograd.grad(out, inputs, dout)``, whose output value nobody reads, inside
  `recomputing`: the CUDA graphs' backward graph (`lightning_ft.strategies.cuda_graphs`), the offloaded checkpoint's
  backward (`lightning_ft.strategies.offload`) and the memory plan's measuring of it
  (`lightning_ft.strategies.profiler`). `recomputing_for_backward` is True there; nothing constrains what the
  recompute saves for its backward, so a module may skip work its backward does not need (the MoE experts' down
  projection).
* ``torch.utils.checkpoint`` (non-reentrant: CUDA graphs off, and the graphs' eager calls) with `checkpoint_contexts`
  of the layer as its ``context_fn`` (`checkpoint_each_layer` sets it on transformers' checkpointed layers): its
  forward runs with grad and drops what it saves; its recompute runs the layer again to save it again, and the
  recompute's output is discarded. `checkpoint_pass` says which of the two runs and `checkpointed_layer` which layer
  it is (a module's output is unread there only if it feeds nothing but that layer's output). torch checks that the
  recompute saves the same tensors as the forward did (their number, shapes and dtypes, not their values), so a module
  may take another path in the recompute only where the two save alike (the MoE experts in token chunks:
  `lightning_ft.kernels.moe.token_chunks`).

The state is per thread: each pass sets and reads it on one thread (the training thread, or the autograd engine's
thread that runs a recompute).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

__all__ = [
    "checkpoint_contexts", "checkpoint_each_layer", "checkpoint_pass", "checkpointed_layer", "recomputing",
    "recomputing_for_backward",
]

_STATE = threading.local()  # .pass_: None | ("recompute", None) | ("forward" | "checkpoint_recompute", layer)


def _current() -> tuple[str, Any] | None:
    return getattr(_STATE, "pass_", None)


class _Pass:
    """A context that marks a pass while it is entered; re-enterable (torch enters a checkpoint's recompute context
    once per recompute: a second backward through a retained graph recomputes again), nested ones restore in turn."""

    def __init__(self, name: str, layer: torch.nn.Module | None) -> None:
        self.mark, self.previous = (name, layer), []

    def __enter__(self) -> None:
        self.previous.append(_current())
        _STATE.pass_ = self.mark

    def __exit__(self, *exc: Any) -> None:
        _STATE.pass_ = self.previous.pop()


def recomputing() -> _Pass:
    """Within: one checkpointed decoder layer's recompute whose output only ``autograd.grad`` reads (see the module
    docstring)."""
    return _Pass("recompute", None)


def recomputing_for_backward() -> bool:
    """Whether the running decoder-layer forward is a recompute inside `recomputing`.

    There the layer's output value is never read: only its autograd graph is. A module whose output feeds nothing
    but the layer's output (the residual sum after the MLP) may then skip computing its value, as long as its
    backward does not need it; the MoE experts skip their down projection and un-permute this way.
    """
    current = _current()
    return current is not None and current[0] == "recompute"


def checkpoint_contexts(layer: torch.nn.Module | None = None) -> tuple[_Pass, _Pass]:
    """``torch.utils.checkpoint``'s ``context_fn`` (``use_reentrant=False``) for a checkpoint of ``layer``
    (``functools.partial(checkpoint_contexts, layer)``): one context marking its forward, one its recompute."""
    return _Pass("forward", layer), _Pass("checkpoint_recompute", layer)


def checkpoint_pass() -> str | None:
    """Inside ``torch.utils.checkpoint`` with `checkpoint_contexts`: ``"forward"`` (its first forward, whose saved
    tensors are dropped) or ``"recompute"`` (the backward's run of it, whose output is discarded); else None."""
    current = _current()
    return {"forward": "forward", "checkpoint_recompute": "recompute"}.get(current[0]) if current is not None else None


def checkpointed_layer() -> torch.nn.Module | None:
    """The layer whose ``torch.utils.checkpoint`` pass runs (`checkpoint_pass`), where `checkpoint_contexts` was given
    it; else None."""
    current = _current()
    return current[1] if current is not None and current[0] != "recompute" else None


def checkpoint_each_layer(model: torch.nn.Module) -> int:
    """Give every checkpointed decoder layer of ``model`` (transformers' ``GradientCheckpointingLayer`` with
    ``gradient_checkpointing`` on, after ``gradient_checkpointing_enable``) a non-reentrant ``torch.utils.checkpoint``
    whose ``context_fn`` is its own `checkpoint_contexts` (transformers' documented seam: the layer's
    ``_gradient_checkpointing_func``).

    Returns:
        The number of layers set.
    """
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for layer in layers:
        contexts = functools.partial(checkpoint_contexts, layer)
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False, context_fn=contexts)
    return len(layers)
