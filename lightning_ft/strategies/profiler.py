"""What the memory planner needs, measured at the start of training (`lightning_ft.strategies.planner`).

`StepProfiler.measure` runs the first training batch's forward once more, without gradients, and at
the first decoder layer of each kind (`layer_kind`: its modules and attention type, with its input shapes; a
forward pre-hook, so one layer input is alive at a time) times that layer eagerly on its real input and keyword
arguments (CUDA events; the graphs record nothing: the layer's own forward is called, not the patched one); the
other layers of that kind get its measurement (the same kernels on the same shapes: measured on the H100,
gpt-oss-20b's layers of one kind at 32K tokens were within ±4% of each other, the experts' routing apart; at
256K tokens measuring each of its 24 layers would take minutes):

    forward      the layer under no_grad (checkpointing's first forward)
    backward     the recompute with gradients and ``autograd.grad`` into the input and the trainable
                 weights (``.grad`` is not touched), with every saved class kept (taken back from
                 `lightning_ft.strategies.kept`'s stores instead of recomputed)
    recompute    per saved class (``attention``, ``projections``, ``mlp``): the same backward with that class
                 recomputed, less the one above
    bytes        per saved class, what its store kept (`KeptActivations.nbytes`); the input's bytes

Where keeping every kind at once runs out of GPU memory (long rows), each kind is measured kept on its own
(`StepProfiler._layer_kinds_apart`: additive savings), and a kind that does not fit even alone is recomputed in every
layer; `Measurement.fallbacks` says so for the log.

And from the pass as a whole, the memory base: what is allocated now, the trainable weights'
gradients, the optimizer's two moments per trainable weight if it has no state yet, the CUDA graphs'
static buffers (a layer's input, output, output gradient and input gradient, [T, hidden] each, shared
by the layers: measured on the H100 at 64K tokens, leaving them out under-predicted the recording
step's peak by 1.4 GiB), and the larger of one layer's backward working set with nothing kept and
the rest of the forward's working set, to which the loss's gradient buffers are added
(`FinetuneModule.loss_gradient_bytes`: this pass runs the loss without them). The peak statistics are reset after each layer's timing and
at the end, so the measuring's own allocations do not count as the training step's peak (summary.json
reads the peak of building the model before: ``peak_memory_setup_bytes``).

Then one more no-grad pass times the rest of the forward (embedding, LM head, loss): from its start
to the first layer and from the last layer's end to its end, ×3 for their backward. Not the
measuring pass: there the head's first calls compile and autotune, and the measuring's host work
between the layers can leave the device idle. Last, the device ↔ pinned host bandwidth (a timed copy
of `COPY_BYTES` each way).

Everything device-specific goes through methods a test can replace (`StepProfiler.timed`, `mark`,
`between`, `bandwidth`, `free_bytes`, `free_host_bytes`, `memory_allocated`, `peak_allocated`): off CUDA the
clock is the host's and the memory figures are 0, and `free_bytes` is None, so no plan is made there
unless a test says otherwise.

Sources: CUDA events for device timing (CUDA C++ Programming Guide); the cost model the measurements
feed is `lightning_ft.strategies.planner`'s.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lightning_ft.strategies.kept import KeptActivations, keeping
from lightning_ft.strategies.planner import Bandwidth, LayerProfile, SavedClass
from lightning_ft.strategies.recompute import recomputing

__all__ = ["COPY_BYTES", "Measurement", "StepProfiler", "available_host_bytes", "layer_kind"]

#: the bytes of the timed copy between the device and pinned host memory, each way
COPY_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Measurement:
    """What `lightning_ft.strategies.planner.plan` takes, as measured.

    Attributes:
        layers: per decoder layer, its times (seconds) and saved classes (bytes, recompute seconds).
        bandwidth: device ↔ pinned host copy bandwidth (bytes per second).
        base_bytes: the step's memory without any saved class (see the module docstring).
        other_s: the step's time outside the decoder layers (seconds).
        fallbacks: how the measuring had to keep less than every kind at once (out of GPU memory), for the log.
    """

    layers: tuple[LayerProfile, ...]
    bandwidth: Bandwidth
    base_bytes: int
    other_s: float
    fallbacks: tuple[str, ...] = ()


def available_host_bytes() -> int:
    """The host memory available to new allocations: ``MemAvailable`` of /proc/meminfo (Linux), else the free pages."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class StepProfiler:
    """Measures a model's decoder layers on a training batch for the memory planner (see the module docstring).

    Args:
        copy_bytes: the size of the timed copy for `bandwidth`.
    """

    def __init__(self, copy_bytes: int = COPY_BYTES):
        self.copy_bytes = copy_bytes

    # -- the device: replaced by tests --------------------------------------------------------------

    def free_bytes(self, device: torch.device) -> int | None:
        """The device memory this process could use: free plus what its allocator holds (bytes); None off CUDA (no plan)."""
        if device.type != "cuda":
            return None
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)

    def free_host_bytes(self) -> int:
        """The host memory available for pinned buffers (`available_host_bytes`)."""
        return available_host_bytes()

    def timed(self, fn: Callable[[], Any], device: torch.device, layer: int, what: str) -> Callable[[], float]:
        """Run ``fn`` now; returns a function that gives its seconds once the device is synchronised (`synchronize`).

        ``layer`` and ``what`` (``forward``, ``backward``, ``recompute:<class>``) name the measurement."""
        start = self.mark(device, f"{what} {layer}")
        fn()
        end = self.mark(device, f"{what} {layer} end")
        return lambda: self.between(start, end)

    def mark(self, device: torch.device, what: str) -> Any:
        """A point in time, read with `between`: a recorded CUDA event on CUDA (no sync), else the host's clock.

        ``what`` names the point (``pass``, ``layers``, ``head``, ``end``, or `timed`'s)."""
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def between(self, start: Any, end: Any) -> float:
        """The seconds from mark ``start`` to mark ``end`` (CUDA events: once the device is synchronised)."""
        if isinstance(start, torch.cuda.Event):
            return start.elapsed_time(end) / 1e3
        return end - start

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def empty_cache(self, device: torch.device) -> None:
        """Give the allocator's cached blocks back (after an out-of-memory error, before measuring leaner)."""
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0

    def peak_allocated(self, device: torch.device, reset: bool = False) -> int:
        """The peak allocated since the last reset (bytes; 0 off CUDA); ``reset``: start a new one after reading."""
        if device.type != "cuda":
            return 0
        peak = torch.cuda.max_memory_allocated(device)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak

    def bandwidth(self, device: torch.device) -> Bandwidth:
        """Device → pinned host and back, bytes per second: one timed copy of ``copy_bytes`` each way (after one untimed).

        Raises:
            ValueError: off CUDA (nothing to copy between).
        """
        if device.type != "cuda":
            raise ValueError(f"copy bandwidth: {device} has no pinned host copies to time")
        on_device = torch.empty(self.copy_bytes, dtype=torch.uint8, device=device)
        host = torch.empty(self.copy_bytes, dtype=torch.uint8, pin_memory=True)
        host.copy_(on_device, non_blocking=True)  # untimed: first-touch costs
        on_device.copy_(host, non_blocking=True)
        out = self.timed(lambda: host.copy_(on_device, non_blocking=True), device, -1, "device_to_host")
        back = self.timed(lambda: on_device.copy_(host, non_blocking=True), device, -1, "host_to_device")
        self.synchronize(device)
        return Bandwidth(self.copy_bytes / max(out(), 1e-9), self.copy_bytes / max(back(), 1e-9))

    # -- the measurement ----------------------------------------------------------------------------

    def measure(self, module: Any, batch: Any, layers: list[torch.nn.Module], kinds: tuple[str, ...], context: Any = None) -> Measurement:
        """Measure ``layers`` (the model's decoder layers, in order) on ``batch`` (see the module docstring).

        Args:
            module: the `lightning_ft.module.FinetuneModule` (its ``loss_terms`` runs the forward).
            batch: the first training batch, on the device.
            layers: the decoder layers (`lightning_ft.strategies.cuda_graphs.graphed_layers`).
            kinds: the saved classes that may be kept (`lightning_ft.strategies.kept.KINDS` the options allow).
            context: a context manager factory for the forward (the precision plugin's autocast), or None.

        Raises:
            RuntimeError: the forward did not run every layer, or not the first and last as modules (their hooks).
        """
        device = batch.input_ids.device
        allocated = self.memory_allocated(device)
        self.peak_allocated(device, reset=True)
        results: dict[int, dict[str, Any]] = {}
        forward_peak = [0]
        by_kind: dict[tuple, dict[str, Any]] = {}  # (layer kind, input shapes) -> its measurement
        fallbacks: list[str] = []  # non-empty: the kept kinds are measured one at a time (all at once ran out of memory)

        def measured(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict, index: int) -> dict[str, Any]:
            if not fallbacks:
                try:
                    return self._layer(layer, hidden, kwargs, kinds, device, index)
                except torch.OutOfMemoryError:
                    pass  # out of the except block: the exception's frames (and their tensors) are gone
                self.empty_cache(device)
                fallbacks.append(
                    f"keeping every kind ({', '.join(kinds)}) of a layer at once ran out of GPU memory in the measuring "
                    f"(decoder layer {index}, {hidden.shape[-2]} tokens): each kind was measured kept on its own"
                )
            return self._layer_kinds_apart(layer, hidden, kwargs, kinds, device, index, fallbacks)

        def hook(layer: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            index = layers.index(layer)
            forward_peak[0] = max(forward_peak[0], self.peak_allocated(device))
            kwargs = dict(kwargs)
            hidden = args[0] if args else kwargs.pop("hidden_states")
            kind = (layer_kind(layer), _shapes(hidden, kwargs))
            if kind not in by_kind:  # measured once per kind, after a warm-up: its kernels' first calls (compiling,
                measured(layer, hidden, kwargs, index)  # autotuning, cuDNN's plans, workspaces) are not its time
                by_kind[kind] = measured(layer, hidden, kwargs, index)
            results[index] = by_kind[kind]
            self.peak_allocated(device, reset=True)

        self._forward(module, batch, context, [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers])
        forward_peak[0] = max(forward_peak[0], self.peak_allocated(device, reset=True))
        rest = self._rest(module, batch, layers, context, device)
        bandwidth = self.bandwidth(device)
        self.synchronize(device)
        self.peak_allocated(device, reset=True)  # the measuring's own memory is not the training step's peak
        if len(results) != len(layers):
            raise RuntimeError(f"memory plan: the forward ran {len(results)} of the {len(layers)} decoder layers")
        profiles, working = [], 0
        for index in range(len(layers)):
            r = results[index]
            forward, backward = r["forward"](), r["backward"]()
            saved = [SavedClass("input", r["input_bytes"], actions=("keep", "offload"))]
            for kind in kinds:
                if r["bytes"].get(kind):  # a kind this layer has no kept call for is left out
                    recompute = max(0.0, r["recompute"][kind]() - backward)
                    saved.append(SavedClass(kind, r["bytes"][kind], recompute_s=recompute))  # keep, offload or recompute
                elif kind in r.get("unmeasured", ()):  # too large to keep even on its own: recomputed (in the backward's time)
                    saved.append(SavedClass(kind, 0, actions=("recompute",)))
            profiles.append(LayerProfile(forward, backward, tuple(saved)))
            working = max(working, r["working_bytes"])
        rest_s = 3 * rest()  # ×3 for its backward
        trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        optimizers = getattr(getattr(module, "_trainer", None), "optimizers", None) or []
        moments = 0 if any(o.state for o in optimizers) else 2 * trainable  # allocated after the first step
        statics = 4 * max(r["input_bytes"] for r in results.values())  # `cuda_graphs._StaticInputs`: x, out, dout, dx
        loss_gradient = module.loss_gradient_bytes(module.pad_for_graphs(batch))  # the measuring pass has no gradients
        base = allocated + trainable + moments + statics + max(working, forward_peak[0] - allocated + loss_gradient)
        return Measurement(tuple(profiles), bandwidth, base, rest_s, tuple(dict.fromkeys(fallbacks)))

    def _rest(self, module: Any, batch: Any, layers: list[torch.nn.Module], context: Any, device: torch.device) -> Callable[[], float]:
        """The forward outside the decoder layers (embedding, LM head, loss), seconds once synchronised: one more
        no-grad pass, timed from its start to the first layer and from the last layer's end to its end. Not the
        measuring pass: the head's first calls compile and autotune there, and the measuring's host work between
        the layers would count."""
        marks: dict[str, Any] = {}

        def mark(name: str) -> Callable[..., None]:
            return lambda *_: marks.__setitem__(name, self.mark(device, name))

        mark("pass")()
        hooks = [layers[0].register_forward_pre_hook(mark("layers")), layers[-1].register_forward_hook(mark("head"))]
        self._forward(module, batch, context, hooks)
        mark("end")()
        if "layers" not in marks or "head" not in marks:
            raise RuntimeError("memory plan: the forward did not call the first and last decoder layers as modules (their hooks did not run)")
        return lambda: self.between(marks["pass"], marks["layers"]) + self.between(marks["head"], marks["end"])

    @staticmethod
    def _forward(module: Any, batch: Any, context: Any, handles: list[Any]) -> None:
        """The training forward of ``batch`` under no_grad (and ``context``), then the hook ``handles`` removed."""
        try:
            with torch.no_grad(), context() if context is not None else contextlib.nullcontext():
                module.loss_terms(module.pad_for_graphs(batch), aux=False)
        finally:
            for handle in handles:
                handle.remove()

    def _layer(
        self, layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any], kinds: tuple[str, ...], device: torch.device,
        index: int,
    ) -> dict[str, Any]:
        """One decoder layer's times (functions, read after `synchronize`), bytes and backward working set."""
        forward = functools.partial(type(layer).forward, layer)  # the layer's own: the graphs' patched one would count a call
        x = hidden.detach()

        def backward(keeps: list[KeptActivations]) -> None:  # the input as the output's gradient: no RNG drawn
            self._backward(layer, x, kwargs, keeps)

        result: dict[str, Any] = {"input_bytes": x.numel() * x.element_size()}
        with torch.no_grad():
            result["forward"] = self.timed(lambda: forward(x, **kwargs), device, index, "forward")
        before = self.memory_allocated(device)
        self.peak_allocated(device, reset=True)
        # nothing kept: with no kinds to keep, that is the backward itself
        nothing_kept = self.timed(lambda: backward([]), device, index, "recompute:all" if kinds else "backward")
        result["working_bytes"] = max(0, self.peak_allocated(device) - before)
        if not kinds:
            return {**result, "bytes": {}, "backward": nothing_kept, "recompute": {}}
        keeps = {kind: KeptActivations(kind, allow=lambda nbytes: True) for kind in kinds}
        with torch.no_grad(), keeping(*keeps.values(), recompute=False):
            forward(x, **kwargs)
        result["bytes"] = {kind: keep.nbytes for kind, keep in keeps.items()}
        result["backward"] = self.timed(lambda: backward(list(keeps.values())), device, index, "backward")
        result["recompute"] = {
            kind: self.timed(lambda: backward([k for name, k in keeps.items() if name != kind]), device, index, f"recompute:{kind}")
            for kind in kinds if result["bytes"][kind]
        }
        return result

    def _layer_kinds_apart(
        self, layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any], kinds: tuple[str, ...], device: torch.device,
        index: int, fallbacks: list[str],
    ) -> dict[str, Any]:
        """`_layer`'s result with each kind kept on its own (less memory than all at once): a kind's recompute time
        is the backward with nothing kept less the backward keeping that kind alone, and the backward with everything
        kept is the one with nothing kept less all those savings (additive; exact where the kinds' recomputes do not
        overlap). A kind that does not fit even on its own is left out (recomputed), said in ``fallbacks``."""
        result = self._layer(layer, hidden, kwargs, (), device, index)  # the forward, the backward with nothing kept
        nothing_kept = result["backward"]
        forward = functools.partial(type(layer).forward, layer)
        alone: dict[str, Callable[[], float]] = {}
        for kind in kinds:
            try:
                keep = KeptActivations(kind, allow=lambda nbytes: True)
                with torch.no_grad(), keeping(keep, recompute=False):
                    forward(hidden.detach(), **kwargs)
                if keep.nbytes:
                    alone[kind] = self.timed(lambda: self._backward(layer, hidden, kwargs, [keep]), device, index, f"keep:{kind}")
                    result["bytes"][kind] = keep.nbytes
                continue
            except torch.OutOfMemoryError:
                pass  # the exception's frames are gone here
            keep = None
            self.empty_cache(device)
            result.setdefault("unmeasured", []).append(kind)
            fallbacks.append(f"keeping {kind} of a layer ran out of GPU memory in the measuring ({hidden.shape[-2]} tokens) "
                             f"even on its own: recomputed in every layer")
        saving = {kind: (lambda t=t: max(0.0, nothing_kept() - t())) for kind, t in alone.items()}
        result["backward"] = lambda: nothing_kept() - sum(s() for s in saving.values())
        result["recompute"] = {kind: (lambda s=s: result["backward"]() + s()) for kind, s in saving.items()}
        return result

    @staticmethod
    def _backward(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any], keeps: list[KeptActivations]) -> None:
        """The layer's recompute with gradients (reusing what ``keeps`` kept) and ``autograd.grad`` into its input and
        trainable weights (``.grad`` is not touched)."""
        forward = functools.partial(type(layer).forward, layer)
        params = [p for p in layer.parameters() if p.requires_grad]
        with torch.enable_grad(), keeping(*keeps, recompute=True), recomputing():  # as the backward graph's
            inputs = hidden.detach().requires_grad_()  # as in training past the first layer: the input's gradient too
            out = forward(inputs, **kwargs)
        torch.autograd.grad(out, [inputs, *params], hidden.detach(), allow_unused=True)  # the input as the output's gradient


def _shapes(hidden: torch.Tensor, kwargs: dict[str, Any]) -> tuple:
    """A layer call's input shapes and non-tensor keywords: with `layer_kind`, what makes two layers' measurements the same."""
    return tuple(hidden.shape), tuple(
        (name, tuple(v.shape) if isinstance(v, torch.Tensor) else v if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__)
        for name, v in sorted(kwargs.items())
    )


def layer_kind(layer: torch.nn.Module) -> tuple:
    """What decides which kernels a decoder layer runs: its modules' types (a dense or an MoE MLP: GLM's and
    DeepSeek-V3's first layers) and its attention type (``layer_types``: sliding or full attention, as gpt-oss and
    Gemma 3 alternate). `StepProfiler.measure` warms up the first layer of each kind before timing it: measured on
    the H100, GLM-4.7-Flash's first MoE layer took 4.3 s without it (its kernels' first calls) against ~21 ms."""
    attention = tuple(getattr(owner, name, None) for owner in (layer, getattr(layer, "self_attn", None))
                      for name in ("attention_type", "layer_type", "sliding_window"))
    return tuple(type(m).__name__ for m in layer.modules()), attention
