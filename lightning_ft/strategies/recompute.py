"""Which pass of a checkpointed decoder layer is running: its forward, or the recompute its backward runs.

A checkpointed layer (Chen et al., 2016) keeps its input only and runs its forward again in backward. Modules inside
it may do less in either pass where nobody reads what they skip; they ask here. Two mechanisms checkpoint layers:

* a recompute differentiated at once, ``autograd.grad(out, inputs, dout)``, whose output value nobody reads, inside
  `recomputing`: the CUDA graphs' backward graph (`lightning_ft.strategies.cuda_graphs`), the offloaded checkpoint's
  backward (`lightning_ft.strategies.offload`) and the memory plan's measuring of it
  (`lightning_ft.strategies.profiler`). `recomputing_for_backward` is True there; nothing constrains what the
  recompute saves for its backward, so a module may skip work its backward does not need (the MoE experts' down
  projection).
* ``torch.utils.checkpoint`` (non-reentrant: CUDA graphs off, and the graphs' eager calls) with `checkpoint_contexts`
  as its ``context_fn``: its forward runs with grad and drops what it saves; its recompute runs the forward again to
  save it again, and the recompute's output is discarded. `checkpoint_pass` says which of the two runs. torch checks
  that the recompute saves the same tensors as the forward did, so a module may take another path in the recompute
  only where the two save alike (the MoE experts in token chunks: `lightning_ft.kernels.moe.token_chunks`).

The state is process-wide, as autograd's own grad mode is not: the backward of a CUDA tensor runs on the autograd
engine's device thread, which must see what the training thread set.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

__all__ = ["checkpoint_contexts", "checkpoint_pass", "recomputing", "recomputing_for_backward"]

_PASS: list[str | None] = [None]  # None | "recompute" (`recomputing`) | "forward" / "checkpoint_recompute" (torch's)


@contextmanager
def _pass(name: str) -> Iterator[None]:
    previous, _PASS[0] = _PASS[0], name
    try:
        yield
    finally:
        _PASS[0] = previous


def recomputing():
    """Within: a checkpointed layer's recompute whose output only ``autograd.grad`` reads (see the module docstring)."""
    return _pass("recompute")


def recomputing_for_backward() -> bool:
    """Whether the running decoder-layer forward is a recompute inside `recomputing`.

    There the layer's output value is never read: only its autograd graph is. A module whose output feeds nothing
    but the layer's output (the residual sum after the MLP) may then skip computing its value, as long as its
    backward does not need it; the MoE experts skip their down projection and un-permute this way.
    """
    return _PASS[0] == "recompute"


def checkpoint_contexts():
    """``torch.utils.checkpoint``'s ``context_fn`` (``use_reentrant=False``): one context marking its forward, one its
    recompute (`checkpoint_pass`)."""
    return _pass("forward"), _pass("checkpoint_recompute")


def checkpoint_pass() -> str | None:
    """Inside ``torch.utils.checkpoint`` with `checkpoint_contexts`: ``"forward"`` (its first forward, whose saved
    tensors are dropped) or ``"recompute"`` (the backward's run of it, whose output is discarded); else None."""
    return {"forward": "forward", "checkpoint_recompute": "recompute"}.get(_PASS[0])
