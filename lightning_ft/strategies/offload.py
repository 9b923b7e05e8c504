"""Activation offloading: checkpointed decoder-layer inputs, and kept activations, wait in pinned host memory for the backward.

With gradient checkpointing a decoder layer keeps only its input x ([batch, T, hidden], the
residual stream) from its forward to its backward, but all L layers' inputs are alive at once: on
the Qwen3-30B-A3B shape at 32K tokens that is 128 MiB per layer, 6 GiB over 48 layers. Here each
input is copied to the host in forward and back in backward, overlapped with compute:

- forward (`ActivationOffload.save`, called before the layer's kernels are queued): a side copy
  stream waits for the compute stream (x is written), then copies x to a pinned host tensor
  without blocking, while the layer's forward computes. x is held until the next layer's
  ``save``, which makes the compute stream wait for that copy's event and then lets x go: its
  memory returns to the compute stream's pool at once, ordered after the copy. (``record_stream``
  would instead keep the block from being reused until the allocator sees the copy finish, which
  with the host running ahead of the GPU means new segments: more reserved memory, not less.)
- backward (`ActivationOffload.load`): layers run in reverse. Loading layer i's input also starts
  the copy of layer i-1's (prefetch, one layer ahead), so it overlaps layer i's backward; the
  compute stream waits only on the event of the copy it needs. Two reloaded inputs are alive at a
  time (double buffering): the one in use and the one arriving.
- the last layer's input stays on the GPU: its backward comes first, with nothing to hide a copy;
  so do the inputs of the layers a memory plan keeps (``layers``; `lightning_ft.strategies.planner`).

No host-device sync in steady state: non-blocking copies between device and pinned memory, CUDA
events. Host tensors come from torch's caching host allocator, which does not hand a block out
again before the copies that used it have run, and keeps it for reuse across steps (the first step
allocates: slower; sizes are rounded up to powers of two; the memory is not returned): about
(L-1) × T × hidden × 2 bytes of pinned host memory per process, 12 GiB at 64K tokens on
Qwen3-30B-A3B. The allocator checks that a block's copies have run without waiting: a host far ahead
of the GPU at the next step allocates new blocks (up to twice that memory), and each power-of-two size
keeps its own blocks (rows of varying length). Each saved input owns its host tensor, so two forwards
before one backward are safe.
Off CUDA (tests) a saved input is a copy on its own device and the prefetch bookkeeping is the same.

Kept activations (`lightning_ft.strategies.kept`) that a memory plan offloads ride along with the
input of the same layer call (`OffloadedTensor.staged`): per kind, the graphed layers that offload it take
turns between two staging buffer sets of it (`lightning_ft.strategies.cuda_graphs.apply_memory_plan`), static
device buffers the forward graph writes and the backward graph reads. `ActivationOffload.save` makes
the compute stream wait for the copies that still read or write the layer's sets (the copy out of the
layer that used a set before it; a reload into it); `save_staged`, after the forward is queued,
copies the sets to the call's own host tensors on the copy stream. `load` copies them back unless the
sets still hold them (its forward was their last writer), starts the previous layer's (prefetch,
into its own sets: for each kind the other set of that kind when the previous layer offloads it too, whose
last reader, the backward of a layer after, is already queued) and makes the compute stream wait for the
copies on this layer's sets. The inputs share the copy stream with them: measured on the H100 (gpt-oss-20b
at 32K tokens), a second stream for the inputs made the step 5% slower (two copies to the host at once) and
the memory of the inputs it let go came back to the pool later. Every buffer set records whose values it
holds and the event of its last copy, so any order of forwards and backwards (two forwards before one
backward) reads its own values, with less overlap when the order is not the reverse of the forward's.
Off CUDA the copies are done when they are queued.
Layers are told their index (their order in the model): a model that calls them in another order
gets the right values with less overlap.

Over pinned memory's host-device bandwidth a layer's input moves in well under the layer's forward
or backward at long rows (32K tokens on Qwen3-30B-A3B); at short rows the copies are small but so
is the saving (turn it on for long contexts).

What it costs is measured as it runs (`CopyMeter`, `ActivationOffload.stats`): CUDA events around each
copy on the copy stream give its time (the bytes are known), and an event recorded on the compute stream
just before each wait on a copy's event and one just after give the wait: the one after completes only
once the copy has, so the time between them is what the compute stream stalled (the copies not hidden
under compute). The events are read without a sync: once per forward (at layer 0's `save`) and in
`stats`, only those that have completed (``Event.query``); the others stay for a later read.

Sources: CUDA streams and events (CUDA C++ Programming Guide); the caching allocators' stream
semantics (``torch.cuda`` memory management notes); the offloaded checkpoints of Unsloth (a side
stream, one staging buffer plus a second when memory allows) and torchtune's ``OffloadActivations``
(saved-tensor hooks, reload on demand): ours prefetches
one layer ahead and skips the last layer.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Callable

import torch

from lightning_ft.strategies.recompute import recomputing

__all__ = ["ActivationOffload", "CopyMeter", "OffloadedTensor", "offloaded_checkpoint"]

DIRECTIONS = ("d2h", "h2d")  # device to host (save), host to device (load)


def _check_version(saved: OffloadedTensor, x: torch.Tensor) -> None:
    if x._version != saved.version:
        raise RuntimeError(
            f"decoder layer {saved.layer_index}'s input was changed in place after its forward started; activation "
            "offloading keeps (or copies) it as it was then: set strategy.activation_offload=false"
        )


class OffloadedTensor:
    """One decoder layer's input, in host memory from its forward to its backward.

    Attributes:
        host: the host copy (pinned on CUDA), same shape and dtype as the input; None for the last
            layer's input (kept on the device) and once loaded.
        device: where the input came from and is loaded back to.
        layer_index: the decoder layer it is the input of.
        previous: the input saved just before it (layer ``layer_index - 1`` of the same forward),
            whose reload this one's load starts; None once started or when there is none.
        source: the input itself, held until the copy to the host is ordered before its reuse.
        version: the input's version counter when saved (an in-place change later is an error).
        copied: the copy stream's event after the copy to the host (CUDA).
        loaded: the input on the device: the last layer's, or a reload in flight or not used yet.
        ready: the copy stream's event after that reload (CUDA).
        consumed: `ActivationOffload.load` has returned it.
        staged: the layer's offloaded kept activations: the staging buffer sets its forward wrote
            (`lightning_ft.strategies.kept`; tuples whose tensors are shared with other layers), or ().
        staged_host: their tensors' host copies (pinned on CUDA), in order; None once loaded.
    """

    __slots__ = (
        "host", "device", "layer_index", "previous", "source", "version", "copied", "loaded", "ready", "consumed",
        "staged", "staged_host", "__weakref__",
    )  # fmt: skip

    def __init__(self, x: torch.Tensor, host: torch.Tensor | None, layer_index: int, previous: OffloadedTensor | None):
        self.host = host
        self.device = x.device
        self.layer_index = layer_index
        self.previous = previous
        self.source: torch.Tensor | None = x if host is not None else None
        self.version = x._version
        self.copied: torch.cuda.Event | None = None
        self.loaded: torch.Tensor | None = None if host is not None else x
        self.ready: torch.cuda.Event | None = None
        self.consumed = False
        self.staged: tuple[tuple, ...] = ()
        self.staged_host: list[torch.Tensor] | None = None


class CopyMeter:
    """Bytes, copy times and compute-stream waits of an `ActivationOffload`, timed by events read without a sync.

    `copied` takes the events around a copy (on the copy stream), `waited` those around a wait of the compute
    stream on a copy's event (the later one completes once that copy has: the time between them is the stall).
    `resolve` adds up the elapsed times of the entries whose later event has completed (``query()``) and keeps
    the others for a later call. Events are anything with ``query()`` and ``elapsed_time(end)`` (milliseconds),
    as `torch.cuda.Event` with ``enable_timing=True``; None: untimed (off CUDA, where the copies are done when
    queued and nothing waits).

    Args:
        max_pending: the most timed entries kept unread (a host far ahead of the GPU); beyond it, copies and
            waits are counted but not timed (their events are not kept).
    """

    def __init__(self, max_pending: int = 8192):
        self.max_pending = max_pending
        self.bytes = dict.fromkeys(DIRECTIONS, 0)  # copied, per direction
        self.timed_bytes = dict.fromkeys(DIRECTIONS, 0)  # of the copies timed so far
        self.copy_ms = dict.fromkeys(DIRECTIONS, 0.0)  # their summed times
        self.waits = 0
        self.wait_ms = 0.0  # the timed waits' summed times
        self.forwards = 0
        self.timed = False  # any copy or wait had events (on CUDA)
        self.pending: deque[tuple[str | None, int, Any, Any]] = deque()  # (direction, or None for a wait; bytes; events)

    def copied(self, direction: str, nbytes: int, start: Any = None, end: Any = None) -> None:
        """A copy of ``nbytes`` in ``direction`` (``d2h`` or ``h2d``) between the events ``start`` and ``end``."""
        self.bytes[direction] += nbytes
        self._keep(direction, nbytes, start, end)

    def waited(self, before: Any = None, after: Any = None) -> None:
        """A wait of the compute stream on a copy, between the events ``before`` and ``after``."""
        self.waits += 1
        self._keep(None, 0, before, after)

    def _keep(self, direction: str | None, nbytes: int, start: Any, end: Any) -> None:
        if start is not None and len(self.pending) < self.max_pending:
            self.pending.append((direction, nbytes, start, end))
            self.timed = True

    def forward(self) -> None:
        """A forward begins (layer 0's `ActivationOffload.save`): read the entries that have completed."""
        self.forwards += 1
        self.resolve()

    def resolve(self, everything: bool = False) -> None:
        """Add up the completed entries, from the oldest to the first that has not completed (the GPU runs them
        in about that order); with ``everything``, all that have completed. No sync: ``query`` only."""
        left: deque = deque()
        while self.pending:
            entry = self.pending.popleft()
            direction, nbytes, start, end = entry
            if not end.query():
                left.append(entry)
                if not everything:
                    break
                continue
            ms = start.elapsed_time(end)
            if direction is None:
                self.wait_ms += ms
            else:
                self.copy_ms[direction] += ms
                self.timed_bytes[direction] += nbytes
        left.extend(self.pending)
        self.pending = left

    def stats(self) -> dict[str, float | int | None]:
        """The entries completed so far read (`resolve`), then:

        ``copy_d2h_gbps``, ``copy_h2d_gbps``: the achieved bandwidth of the copies to the host and back, GB/s
        (1e9 bytes per second: the timed copies' bytes over their summed times), None where none was timed (off
        CUDA, or none has completed yet); ``compute_waits``: the compute stream's waits on copies (none off
        CUDA); ``compute_wait_ms``: the timed waits' summed stall, ms, and ``compute_wait_ms_per_forward`` (over
        the forwards, layer 0's saves), None where nothing was timed (off CUDA). The run's first steps (recording,
        the first pinned allocations) count too.
        """
        self.resolve(everything=True)
        gbps = {d: self.timed_bytes[d] / self.copy_ms[d] / 1e6 if self.copy_ms[d] > 0 else None for d in DIRECTIONS}
        wait_ms = self.wait_ms if self.timed else None
        return {
            "copy_d2h_gbps": gbps["d2h"], "copy_h2d_gbps": gbps["h2d"], "compute_waits": self.waits,
            "compute_wait_ms": wait_ms,
            "compute_wait_ms_per_forward": wait_ms / self.forwards if wait_ms is not None and self.forwards else None,
        }


class ActivationOffload:
    """Offloads the checkpointed inputs of ``num_layers`` decoder layers (see the module docstring).

    Args:
        num_layers: decoder layers in the model; the last one's input is not offloaded.
        layers: the layers whose inputs are offloaded (a memory plan, `lightning_ft.strategies.planner`);
            the others stay on the device as the last one's does. None: every layer but the last.

    Attributes (counters over the run): ``saved`` inputs offloaded, ``prefetched`` loads whose copy had
    been started by the next layer's load, ``staged_saves`` layer calls whose kept activations went to the
    host, ``staged_loads`` copies of kept activations back into their staging buffers; ``meter``, the
    `CopyMeter` of every copy (bytes, times) and of the compute stream's waits on them.
    """

    def __init__(self, num_layers: int, layers: set[int] | None = None):
        self.num_layers = num_layers
        self.layers = layers
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.last: weakref.ref[OffloadedTensor] | None = None  # the input saved last (not kept alive)
        self.holding: OffloadedTensor | None = None  # the one input whose device memory is still held
        self.inflight: list[OffloadedTensor] = []  # reloads started whose event the compute stream has not waited on
        # staging buffer sets (by id): whose values they hold, or will in stream order, and the copy event after
        # the last copy that reads or writes them
        self.holder: dict[int, weakref.ref[OffloadedTensor]] = {}
        self.busy: dict[int, torch.cuda.Event | None] = {}
        self.saved = 0
        self.meter = CopyMeter()
        self.prefetched = 0
        self.staged_saves = 0
        self.staged_loads = 0

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def _let_go(self) -> None:
        """Order the held input's reuse after its copy (compute stream waits on it), then drop it.

        Raises:
            RuntimeError: the input was changed in place after `save` (the copy may have raced it).
        """
        saved, self.holding = self.holding, None
        if saved is None or saved.source is None:
            return
        self._wait(saved.device, saved.copied)
        source, saved.source = saved.source, None
        _check_version(saved, source)

    def _wait_abandoned(self) -> None:
        """Reloads of a backward that stopped early: order their memory's reuse after their copies."""
        for saved in self.inflight:
            self._wait(saved.device, saved.ready)
            saved.loaded = saved.ready = None
        self.inflight.clear()

    def save(self, x: torch.Tensor, layer_index: int, staged: tuple[tuple, ...] = ()) -> OffloadedTensor:
        """Start copying decoder layer ``layer_index``'s input ``x`` to the host (the last layer's stays).

        Call it when ``x`` is written and before the layer's kernels are queued. ``x`` is held
        until the next call (the next layer's input), which orders its reuse after the copy.
        ``staged``: the staging buffer sets the layer's forward is about to write (its offloaded kept
        activations); the compute stream waits for the copies that still read or write them, and
        `save_staged` copies them out once written.

        Returns:
            the `OffloadedTensor` to `load` in the backward.

        Raises:
            RuntimeError: the input saved before was changed in place since.
        """
        if layer_index == 0:
            self.meter.forward()
        self._let_go()
        self._wait_abandoned()
        x = x.detach()
        if not x.is_contiguous():  # made here, on the compute stream (the copy would make one on the side stream)
            x = x.contiguous()
        last = self.last() if self.last is not None else None
        previous = last if last is not None and last.layer_index == layer_index - 1 and not last.consumed else None
        if layer_index >= self.num_layers - 1 or (self.layers is not None and layer_index not in self.layers):
            saved = OffloadedTensor(x, None, layer_index, previous)
        elif x.is_cuda:
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            copied = self._copy([(host, x)], x.device, "d2h")
            saved = self.holding = OffloadedTensor(x, host, layer_index, previous)
            saved.copied = copied
        else:
            saved = self.holding = OffloadedTensor(x, x.clone(), layer_index, previous)
            self.meter.copied("d2h", x.nbytes)
        if saved.host is not None:
            self.saved += 1
        if staged:
            saved.staged = staged
            self._wait_staging(saved)
            for entry in staged:
                self.holder[id(entry)] = weakref.ref(saved)
        self.last = weakref.ref(saved)
        return saved

    def save_staged(self, saved: OffloadedTensor) -> None:
        """Start copying the staging buffers `save` was given to the host, once the layer's forward has
        written them (queued): each call owns its host copies, so two forwards before one backward are safe."""
        tensors = _tensors(saved.staged)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in tensors]
        copied = self._copy(list(zip(host, tensors)), saved.device, "d2h")
        saved.staged_host = host
        for entry in saved.staged:
            self.busy[id(entry)] = copied
        self.staged_saves += 1

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, direction: str) -> torch.cuda.Event | None:
        """Copy each (destination, source) on the copy stream after the compute stream's work queued so far,
        ``direction`` ``d2h`` or ``h2d`` (for the `CopyMeter`, with the events around them); the event after
        them (None off CUDA, where the copies are done on return)."""
        nbytes = sum(destination.nbytes for destination, _ in pairs)
        if device.type != "cuda":
            for destination, source in pairs:
                destination.copy_(source)
            self.meter.copied(direction, nbytes)
            return None
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            start = stream.record_event(torch.cuda.Event(enable_timing=True))
            for destination, source in pairs:
                destination.copy_(source, non_blocking=True)
            end = stream.record_event(torch.cuda.Event(enable_timing=True))
        self.meter.copied(direction, nbytes, start, end)
        return end

    def _wait(self, device: torch.device, event: torch.cuda.Event | None) -> None:
        """The compute stream waits for ``event`` (a copy's), between two events for the `CopyMeter` (the stall)."""
        if event is None:
            return
        stream = torch.cuda.current_stream(device)
        before = stream.record_event(torch.cuda.Event(enable_timing=True))
        stream.wait_event(event)
        self.meter.waited(before, stream.record_event(torch.cuda.Event(enable_timing=True)))

    def _wait_staging(self, saved: OffloadedTensor) -> None:
        """The compute stream waits for the copies that read or write ``saved``'s staging buffers."""
        for entry in saved.staged:
            self._wait(saved.device, self.busy.pop(id(entry), None))

    def _load_staged(self, saved: OffloadedTensor) -> None:
        """Copy ``saved``'s kept activations back into its staging buffers, unless they hold them already
        (its forward was their last writer, or a prefetch is on its way)."""
        holders = [self.holder.get(id(entry)) for entry in saved.staged]
        if all(holder is not None and holder() is saved for holder in holders):
            return
        loaded = self._copy(list(zip(_tensors(saved.staged), saved.staged_host)), saved.device, "h2d")
        for entry in saved.staged:
            self.holder[id(entry)], self.busy[id(entry)] = weakref.ref(saved), loaded
        self.staged_loads += 1

    def wait_copies(self, device: torch.device) -> None:
        """The compute stream waits for every copy queued so far (before buffers are written outside `save`'s
        order, e.g. while a layer is recorded)."""
        if device in self.streams:
            self._wait(device, self.streams[device].record_event())

    def _start_load(self, saved: OffloadedTensor) -> None:
        if saved.device.type != "cuda":
            saved.loaded = saved.host
            self.meter.copied("h2d", saved.host.nbytes)  # the copy the device would make
            return
        # allocated on the compute stream, which may have just freed that memory: the copy waits for it
        loaded = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=saved.device)
        saved.ready = self._copy([(loaded, saved.host)], saved.device, "h2d")
        saved.loaded = loaded
        self.inflight.append(saved)

    def load(self, saved: OffloadedTensor) -> torch.Tensor:
        """The input `save` took, back on its device; starts reloading the previous layer's input.

        The compute stream waits for this input's copy (an event, no host sync). Each saved input
        is loaded once.

        Raises:
            RuntimeError: ``saved`` was loaded before (a second backward through the same forward),
                or the input was changed in place since `save` (checked where it stayed on the device).
        """
        if saved.consumed:
            raise RuntimeError(f"decoder layer {saved.layer_index}'s offloaded input was loaded already (one backward per forward)")
        saved.consumed = True
        if self.holding is saved:  # the last input saved, still on the device: no reload
            saved.loaded = saved.source
            self._let_go()
        elif saved.loaded is None:
            self._start_load(saved)
        elif saved.host is not None:
            self.prefetched += 1
        else:  # an input kept on the device (the last layer's, or one a memory plan keeps)
            _check_version(saved, saved.loaded)
        self._load_staged(saved)
        previous, saved.previous = saved.previous, None
        if previous is not None and previous.loaded is None and not previous.consumed:
            self._start_load(previous)  # overlaps this layer's backward
        if previous is not None and not previous.consumed:
            self._load_staged(previous)  # into its own sets, whose last readers' backwards are queued already
        loaded, saved.loaded, saved.host = saved.loaded, None, None
        if saved.ready is not None:
            self._wait(saved.device, saved.ready)
            saved.ready = None
            self.inflight.remove(saved)
        self._wait_staging(saved)
        saved.staged_host = None
        return loaded

    def stats(self) -> dict[str, float | int | None]:
        """So far: ``offloaded_inputs``, ``offloaded_bytes`` (copied to the host: inputs and kept activations),
        ``reloaded_bytes`` (copied back), ``prefetched_loads``, ``offloaded_kept`` (layer calls whose kept
        activations were offloaded), ``reloaded_kept`` (their copies back), ``forwards`` (layer 0's saves) and
        the copies' achieved bandwidth and the compute stream's waits on them (`CopyMeter.stats`: GB/s and ms,
        None off CUDA)."""
        return {
            "offloaded_inputs": self.saved, "offloaded_bytes": self.meter.bytes["d2h"], "reloaded_bytes": self.meter.bytes["h2d"],
            "prefetched_loads": self.prefetched, "offloaded_kept": self.staged_saves, "reloaded_kept": self.staged_loads,
            "forwards": self.meter.forwards, **self.meter.stats(),
        }


def _tensors(staged: tuple[tuple, ...]) -> list[torch.Tensor]:
    return [v for entry in staged for v in entry if isinstance(v, torch.Tensor)]


class _OffloadedCheckpoint(torch.autograd.Function):
    """Checkpointing whose one saved tensor, the input, is offloaded (see `offloaded_checkpoint`)."""

    @staticmethod
    def forward(ctx, run: Callable, offload: ActivationOffload, layer_index: int, hidden: torch.Tensor, *params):
        device_type = hidden.device.type
        ctx.amp = dict(
            device_type=device_type,
            dtype=torch.get_autocast_dtype(device_type),
            enabled=torch.is_autocast_enabled(device_type),
        )
        ctx.run, ctx.offload, ctx.params = run, offload, params
        ctx.saved = offload.save(hidden, layer_index)
        return run(hidden)  # autograd is off inside a Function's forward: nothing else is saved

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x = ctx.offload.load(ctx.saved).detach().requires_grad_(ctx.needs_input_grad[3])
        params = [p for p, needed in zip(ctx.params, ctx.needs_input_grad[4:]) if needed]
        with torch.enable_grad(), torch.autocast(**ctx.amp), recomputing():
            out = ctx.run(x)
        inputs = [x, *params] if x.requires_grad else params
        grads = iter(torch.autograd.grad(out, inputs, grad_out, allow_unused=True))
        grad_in = next(grads) if x.requires_grad else None
        return (None, None, None, grad_in, *(next(grads) if needed else None for needed in ctx.needs_input_grad[4:]))


def offloaded_checkpoint(
    run: Callable[[torch.Tensor], torch.Tensor],
    offload: ActivationOffload,
    layer_index: int,
    hidden: torch.Tensor,
    params: list[torch.nn.Parameter],
) -> torch.Tensor:
    """``run(hidden)`` checkpointed, its input ``hidden`` offloaded by ``offload`` until the backward.

    Like ``torch.utils.checkpoint`` (Chen et al., 2016), the forward keeps nothing but the input;
    the backward loads it (`ActivationOffload.load`), runs ``run`` again with gradients under the
    forward's autocast state and returns the gradients of ``hidden`` and ``params`` (the weights
    ``run`` reads that require grad) as this function's own, so they reach ``.grad`` (and DDP's
    hooks) as any other gradient. The RNG state is not restored: ``run`` must draw no random
    numbers (no dropout; `lightning_ft.strategies.cuda_graphs.check_cuda_graphs` refuses it).

    Args:
        run: the layer's forward with its keyword arguments bound; ``hidden`` [batch, T, hidden].
        offload: the model's `ActivationOffload`.
        layer_index: the decoder layer's position in the model (its input order in forward).
        hidden: the layer input.
        params: the trainable weights ``run`` reads.

    Returns:
        ``run(hidden)``.
    """
    return _OffloadedCheckpoint.apply(run, offload, layer_index, hidden, *params)
