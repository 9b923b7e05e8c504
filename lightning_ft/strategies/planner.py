"""The memory plan: for each decoder layer and each class of saved tensor, keep it, offload it or recompute it.

A checkpointed decoder layer's backward needs tensors its forward made. Each class of them (the
layer input, attention's output and softmax statistics, attention's and the MLP's projection outputs: the classes
`lightning_ft.strategies.kept` and `lightning_ft.strategies.offload` handle) can be

    keep        on the GPU from the forward to the backward: costs its bytes for the whole step;
    offload     to pinned host memory in the forward, back in the backward: costs a staging buffer
                and the part of the copies that the layer's compute does not hide;
    recompute   again in the backward: costs its compute time.

`plan` picks one action per (layer, class) minimising the predicted step time within a memory budget.
Its inputs are measured by the caller in the first steps (`LayerProfile`: per-layer compute times and
the bytes and recompute times of each class; `Bandwidth`: the copy bandwidths); nothing here is per GPU.

The cost model (per layer i of L, in seconds and bytes):

    time_i   = forward_i + backward_i + Σ recompute_s (recomputed classes)
               + max(0, offloaded_i / d2h − forward_i)           copy out, hidden under layer i's forward
               + max(0, offloaded_i / h2d − backward_{i+1})      copy in, hidden under layer i+1's backward
               + copy_overhead × copy time                       a hidden copy still costs a little
    peak     = base + Σ kept_i + 2 · Σ_c max_i offloaded_i,c     two staging buffers per class (double buffering)

so for offloaded layers the step takes about c + (L−1)·max(c, g) + g with c a layer's compute and g
its copy (the published model of double-buffered offloading). Each class offloaded has its own two
staging buffers: the inputs' reloads in flight, the kept kinds' staging sets that the offloading layers
take turns on (`lightning_ft.strategies.cuda_graphs.apply_memory_plan`). The last layer offloads nothing (its
backward comes first, with nothing to hide a copy under), as `lightning_ft.strategies.offload` does.
The small ``copy_overhead`` makes keeping win a tie with a hidden copy when the memory is there.

The search: for each staging size (per class, the distinct per-layer offloaded bytes), a dynamic program over the
bytes kept (a multiple-choice knapsack: one option per layer, the least total time within the room
left; bytes rounded up to 1/4096 of the most that can be kept, so exact up to that rounding, and more
budget never gives a slower plan); the fastest of those. `Plan.table` renders the plan for the start log.

Sources: Chen et al. 2016 (checkpointing), Korthikanti et al. 2022 (selective recomputation), the
double-buffered offload model of Beaumont et al. 2021 ("Efficient combination of rematerialization
and offloading for training DNNs").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

GIB = 2**30
MIB = 2**20
#: ``memory_budget_gib=auto``: the free GPU memory less this share of it, for the allocator's
#: fragmentation and the kernels' workspaces that the plan does not see
AUTO_MARGIN = 0.10
ACTIONS = ("keep", "offload", "recompute")

__all__ = ["ACTIONS", "AUTO_MARGIN", "Bandwidth", "LayerProfile", "Plan", "SavedClass", "budget_bytes", "host_bytes", "plan"]


def budget_bytes(memory_budget_gib: Any, free_bytes: int, margin: float = AUTO_MARGIN) -> int | None:
    """``strategy.memory_budget_gib`` in bytes.

    Args:
        memory_budget_gib: a number of GiB > 0, ``auto`` (``free_bytes`` less ``margin`` of it) or None (no plan).
        free_bytes: the device's free memory (``torch.cuda.mem_get_info``), for ``auto``.
        margin: the share of ``free_bytes`` that ``auto`` leaves alone.

    Raises:
        ValueError: anything else, naming the key.
    """
    if memory_budget_gib is None:
        return None
    if memory_budget_gib == "auto":
        return int(free_bytes * (1 - margin))
    if isinstance(memory_budget_gib, bool) or not isinstance(memory_budget_gib, (int, float)) or not memory_budget_gib > 0:
        raise ValueError(f"strategy.memory_budget_gib={memory_budget_gib!r}: expected a number of GiB > 0, auto, or null for no plan")
    return int(memory_budget_gib * GIB)


def host_bytes(offloaded: Iterable[int]) -> int:
    """The pinned host memory that tensors of these sizes (bytes) take: each rounded up to a power of two
    (torch's caching host allocator; `lightning_ft.strategies.offload`)."""
    return sum(1 << (n - 1).bit_length() for n in offloaded if n > 0)


@dataclass(frozen=True)
class SavedClass:
    """One class of tensors a decoder layer's forward saves for its backward.

    Attributes:
        name: ``input`` (the checkpointed layer input), or a kept kind (``attention``, ``projections``, ``mlp``:
            `lightning_ft.strategies.kept.KINDS`).
        nbytes: its bytes in one layer.
        recompute_s: seconds to recompute it in the backward (ignored where ``recompute`` is not allowed).
        actions: what may happen to it (a non-empty subset of `ACTIONS`; a class that may only be offloaded is
            kept in the last layer, which offloads nothing).
    """

    name: str
    nbytes: int
    recompute_s: float = 0.0
    actions: tuple[str, ...] = ACTIONS

    def __post_init__(self):
        if not self.actions or not set(self.actions) <= set(ACTIONS):
            raise ValueError(f"saved class {self.name}: actions {self.actions} must be some of {ACTIONS}")
        if self.nbytes < 0 or self.recompute_s < 0:
            raise ValueError(f"saved class {self.name}: negative bytes or recompute time")


@dataclass(frozen=True)
class LayerProfile:
    """One decoder layer as measured: compute times (seconds) with everything kept, and its saved classes."""

    forward_s: float
    backward_s: float
    saved: tuple[SavedClass, ...]


@dataclass(frozen=True)
class Bandwidth:
    """Copy bandwidth between the GPU and pinned host memory, bytes per second (measured)."""

    device_to_host: float
    host_to_device: float


@dataclass(frozen=True)
class _Option:
    actions: tuple[str, ...]  # per saved class, in the layer's order
    kept: int
    time: float
    staged: dict[str, int]  # per saved class offloaded, its bytes

    @property
    def offloaded(self) -> int:
        return sum(self.staged.values())


@dataclass(frozen=True)
class Plan:
    """A memory plan (`plan`): per layer, an action per saved class, and what it is predicted to cost.

    Attributes:
        actions: per layer, saved class name → action.
        layer_s: per layer, the predicted seconds (compute, recompute, exposed copies).
        kept_bytes: per layer, the bytes kept.
        offloaded_bytes: per layer, the bytes offloaded.
        step_s: the predicted step time: Σ ``layer_s`` + ``other_s``.
        peak_bytes: the predicted peak: base + Σ kept + per class, two staging buffers of its largest offload.
        budget_bytes: the budget it was made for.
        fits: whether ``peak_bytes`` fits ``budget_bytes`` (else the leanest plan, which does not).
        base_bytes: the step's memory without any saved class (`plan`'s ``base_bytes``).
        names: the saved classes, in the layers' order.
        host_bytes: the pinned host memory the offloaded tensors take (`host_bytes`).
        fallbacks: why the plan is not the fastest one (a pinned-host budget that took offloading away), for the log.
        bandwidth: the measured copy bandwidths it was made with (`plan`'s ``bandwidth``), the ceiling of the
            offloading copies' achieved ones (`lightning_ft.strategies.offload.CopyMeter`).
    """

    actions: tuple[dict[str, str], ...]
    layer_s: tuple[float, ...]
    kept_bytes: tuple[int, ...]
    offloaded_bytes: tuple[int, ...]
    step_s: float
    peak_bytes: int
    budget_bytes: int
    fits: bool = True
    base_bytes: int = 0
    names: tuple[str, ...] = field(default=())
    host_bytes: int = 0
    fallbacks: tuple[str, ...] = ()
    bandwidth: Bandwidth | None = None

    def action(self, layer: int, name: str) -> str:
        """What happens to ``name`` in ``layer`` (``keep`` for a class or layer the plan does not know)."""
        return self.actions[layer].get(name, "keep") if 0 <= layer < len(self.actions) else "keep"

    def layers_offloading(self) -> list[int]:
        """The layers that offload anything, in order."""
        return [i for i, n in enumerate(self.offloaded_bytes) if n > 0]

    def layers_where(self, name: str, action: str) -> set[int]:
        """The layers whose ``name`` gets ``action``."""
        return {i for i, acts in enumerate(self.actions) if acts.get(name) == action}

    def summary(self) -> dict[str, Any]:
        """For summary.json: ``predicted_step_s``, ``predicted_peak_bytes``, ``budget_bytes``, ``fits``,
        ``host_bytes``, ``fallbacks``, and per class the layers kept, offloaded and recomputed (counts)."""
        counts = {
            name: {action: len(self.layers_where(name, action)) for action in ACTIONS} for name in self.names
        }
        return {
            "predicted_step_s": self.step_s,
            "predicted_peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "host_bytes": self.host_bytes,
            "fallbacks": list(self.fallbacks),
            "layers": counts,
        }

    def table(self) -> Any:
        """A `rich.table.Table` of the plan: runs of layers with the same actions on one row, with their
        mean bytes kept and offloaded and predicted time per layer; the caption has the step time, the peak and
        the budget."""
        from rich.table import Table

        table = Table(title="memory plan", caption=(
            f"predicted step {self.step_s * 1e3:.1f} ms, peak {self.peak_bytes / GIB:.2f} GiB of a "
            f"{self.budget_bytes / GIB:.2f} GiB budget" + ("" if self.fits else " (does not fit: the leanest plan)")
        ))
        table.add_column("layers")
        for name in self.names:
            table.add_column(name)
        for column in ("kept MiB/layer", "offloaded MiB/layer", "ms/layer"):
            table.add_column(column, justify="right")
        rows = zip(self.actions, self.kept_bytes, self.offloaded_bytes, self.layer_s)
        start = 0
        for acts, run in itertools.groupby(rows, key=lambda r: tuple(r[0].get(n, "-") for n in self.names)):
            run = list(run)
            end = start + len(run) - 1
            kept, offloaded, seconds = (sum(r[k] for r in run) / len(run) for k in (1, 2, 3))
            table.add_row(
                f"{start}" if start == end else f"{start}–{end}", *acts, f"{kept / MIB:.1f}", f"{offloaded / MIB:.1f}",
                f"{seconds * 1e3:.2f}",
            )
            start = end + 1
        return table


def _options(layer: LayerProfile, window_s: float, bandwidth: Bandwidth, copy_overhead: float, no_offload: bool) -> list[_Option]:
    """Every combination of actions for ``layer``, with its bytes kept and offloaded and its time; ``no_offload``
    (the last layer, or a pinned-host budget): a class that may only be offloaded is kept."""
    choices = [[a for a in c.actions if not (no_offload and a == "offload")] or ["keep"] for c in layer.saved]
    options = []
    for actions in itertools.product(*choices):
        kept = sum(c.nbytes for c, a in zip(layer.saved, actions) if a == "keep")
        staged = {c.name: c.nbytes for c, a in zip(layer.saved, actions) if a == "offload"}
        offloaded = sum(staged.values())
        recompute = sum(c.recompute_s for c, a in zip(layer.saved, actions) if a == "recompute")
        out_s, in_s = offloaded / bandwidth.device_to_host, offloaded / bandwidth.host_to_device
        exposed = max(0.0, out_s - layer.forward_s) + max(0.0, in_s - window_s)
        time = layer.forward_s + layer.backward_s + recompute + exposed + copy_overhead * (out_s + in_s)
        options.append(_Option(actions, kept, time, staged))
    return options


def _knapsack(per_layer: list[list[_Option]], room: int, unit: int) -> list[_Option] | None:
    """One option per layer, the least total time with Σ kept ≤ ``room`` (bytes rounded up to ``unit``s: a
    dynamic program over "at most c units", exact up to the rounding, non-increasing in ``room``); None: none fits."""
    import numpy as np

    if room < 0:
        return None
    cap = min(room // unit, sum(max(-(-o.kept // unit) for o in options) for options in per_layer))
    best = np.zeros(cap + 1)  # best[c]: the least time of the layers so far within c units
    picks = []
    for options in per_layer:
        new, pick = np.full(cap + 1, np.inf), np.full(cap + 1, -1)
        for k, option in enumerate(options):
            w = -(-option.kept // unit)
            if w > cap:
                continue
            candidate = np.full(cap + 1, np.inf)
            candidate[w:] = best[: cap + 1 - w] + option.time
            better = candidate < new
            new[better], pick[better] = candidate[better], k
        best = new
        picks.append(pick)
    if not np.isfinite(best[cap]):
        return None
    chosen, c = [], cap
    for options, pick in zip(reversed(per_layer), reversed(picks)):
        option = options[int(pick[c])]
        chosen.append(option)
        c -= -(-option.kept // unit)
    return chosen[::-1]


def plan(
    layers: Iterable[LayerProfile],
    budget: int,
    base_bytes: int,
    bandwidth: Bandwidth,
    other_s: float = 0.0,
    copy_overhead: float = 0.01,
    host_budget: int | None = None,
) -> Plan:
    """The fastest predicted plan within ``budget`` bytes (see the module docstring for the model).

    Args:
        layers: each decoder layer's `LayerProfile`, in forward order.
        budget: the GPU memory a step may use, bytes (`budget_bytes`).
        base_bytes: the step's peak without any saved class (weights, gradients, optimizer state, the
            working set of one layer's backward, the loss): what the plan adds to.
        bandwidth: the measured copy bandwidths.
        other_s: the rest of the step (embedding, loss, optimizer), seconds, added to the prediction.
        copy_overhead: the share of a hidden copy's time still counted (keeping wins ties).
        host_budget: the pinned host memory the offloaded tensors may take, bytes (`host_bytes`); None: no limit.

    Returns:
        The `Plan`; where even the leanest plan does not fit, that one with ``fits=False``.

    Raises:
        ValueError: no layers, or a non-positive bandwidth.
    """
    layers = list(layers)
    if not layers:
        raise ValueError("memory plan: no decoder layers")
    if not (bandwidth.device_to_host > 0 and bandwidth.host_to_device > 0):
        raise ValueError(f"memory plan: copy bandwidth must be positive, got {bandwidth}")
    def per_layer(limited: int) -> list[list[_Option]]:  # layers before ``limited`` offload nothing
        return [
            _options(layer, layers[i + 1].backward_s if i + 1 < len(layers) else 0.0, bandwidth, copy_overhead,
                     i == len(layers) - 1 or i < limited)
            for i, layer in enumerate(layers)
        ]

    made = fastest = _plan(layers, per_layer(0), budget, base_bytes, other_s)
    limited = 0  # layers, first to last, that may not offload
    while host_budget is not None and made.host_bytes > host_budget and limited < len(layers):
        limited = max(limited + 1, min(made.layers_offloading()) + 1)
        made = _plan(layers, per_layer(limited), budget, base_bytes, other_s)
    if limited:
        reason = (
            f"strategy.host_budget_gib={host_budget / GIB:.2f}: the fastest plan offloads {fastest.host_bytes / GIB:.2f} GiB "
            f"to pinned host memory, more than that; {len(made.layers_offloading())} of {len(layers)} layers offload "
            f"({made.host_bytes / GIB:.2f} GiB), the others keep or recompute instead"
        )
        made = replace(made, fallbacks=(*made.fallbacks, reason))
    return replace(made, bandwidth=bandwidth)


def _peak(base_bytes: int, chosen: list[_Option]) -> int:
    """The predicted peak of one option per layer: the base, what they keep, per class two staging buffers of its largest offload."""
    staging = {}
    for option in chosen:
        for name, nbytes in option.staged.items():
            staging[name] = max(staging.get(name, 0), nbytes)
    return base_bytes + sum(o.kept for o in chosen) + 2 * sum(staging.values())


def _plan(layers: list[LayerProfile], per_layer: list[list[_Option]], budget: int, base_bytes: int, other_s: float) -> Plan:
    """`plan`'s search over ``per_layer``'s options (see the module docstring)."""
    # the bytes' unit of the search: fine enough to be exact to a fraction of a percent, coarse enough to be quick
    unit = max(MIB, sum(max(o.kept for o in options) for options in per_layer) // 4096)
    names = tuple(dict.fromkeys(c.name for layer in layers for c in layer.saved))
    sizes = [sorted({0} | {o.staged.get(name, 0) for options in per_layer for o in options}) for name in names]
    best: tuple[float, int, list[_Option]] | None = None
    for staging in itertools.product(*sizes):  # per class, the staging size
        limit = dict(zip(names, staging))
        allowed = [[o for o in options if all(n <= limit[c] for c, n in o.staged.items())] for options in per_layer]
        if not all(allowed):  # a layer that must offload more than this staging size
            continue
        chosen = _knapsack(allowed, budget - base_bytes - 2 * sum(staging), unit)
        if chosen is not None:
            time = sum(o.time for o in chosen)
            peak = _peak(base_bytes, chosen)
            if best is None or (time, peak) < best[:2]:
                best = (time, peak, chosen)
    fits = best is not None
    # none fits: the leanest plan (least peak), said not to fit
    chosen = best[2] if best is not None else [min(options, key=lambda o: (o.kept + 2 * o.offloaded, o.time)) for options in per_layer]
    return Plan(
        actions=tuple({c.name: a for c, a in zip(layer.saved, o.actions)} for layer, o in zip(layers, chosen)),
        layer_s=tuple(o.time for o in chosen),
        kept_bytes=tuple(o.kept for o in chosen),
        offloaded_bytes=tuple(o.offloaded for o in chosen),
        step_s=sum(o.time for o in chosen) + other_s,
        peak_bytes=_peak(base_bytes, chosen),
        budget_bytes=budget,
        fits=fits,
        base_bytes=base_bytes,
        names=names,
        host_bytes=host_bytes(n for o in chosen for n in o.staged.values()),
    )
