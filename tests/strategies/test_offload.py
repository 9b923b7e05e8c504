"""Offloaded layer inputs come back unchanged, one layer ahead, and checkpointing through them gives autograd's gradients.

    python -m pytest -q tests/strategies/test_offload.py            (CPU)
    python -m pytest -q -m gpu tests/strategies/test_offload.py     (GPU: streams, pinned memory, no sync)
"""

import pytest
import torch

from lightning_ft.strategies.offload import ActivationOffload, CopyMeter, offloaded_checkpoint

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _forward(offload: ActivationOffload, inputs: list[torch.Tensor]) -> list:
    return [offload.save(x, i) for i, x in enumerate(inputs)]


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_come_back_unchanged_and_each_load_prefetches_the_layer_before(device):
    offload = ActivationOffload(num_layers=4)
    inputs = [torch.randn(1, 37, 29, device=device, dtype=torch.bfloat16) for _ in range(4)]
    saved = _forward(offload, [x.clone() for x in inputs])
    assert saved[3].host is None and saved[3].loaded is not None  # the last layer's stays on the device
    assert all(isinstance(s.host, torch.Tensor) and s.loaded is None for s in saved[:3])
    if device == "cuda":
        assert all(s.host.is_pinned() and s.host.device.type == "cpu" for s in saved[:3])
    loaded = [None] * 4
    for i in reversed(range(4)):  # the backward's order
        loaded[i] = offload.load(saved[i])
        if i > 0:
            assert saved[i - 1].loaded is not None  # its copy was started by this load
    assert all(torch.equal(got, want) for got, want in zip(loaded, inputs))
    assert all(got.device == want.device for got, want in zip(loaded, inputs))
    stats = offload.stats()
    timing = {k: stats.pop(k) for k in ("copy_d2h_gbps", "copy_h2d_gbps", "compute_wait_ms", "compute_wait_ms_per_forward")}
    nbytes = 37 * 29 * 2
    assert stats == {
        "offloaded_inputs": 3, "offloaded_bytes": 3 * nbytes, "reloaded_bytes": 3 * nbytes, "prefetched_loads": 3,
        "offloaded_kept": 0, "reloaded_kept": 0, "forwards": 1,
        # CUDA: layers 0-2's loads wait on their copies and saves 1-3 on the copy before (off CUDA: done when queued)
        "compute_waits": 6 if device == "cuda" else 0,
    }
    if device == "cpu":  # nothing to time
        assert set(timing.values()) == {None}
    else:
        assert all(v is not None and v >= 0 for v in timing.values()), timing
    with pytest.raises(RuntimeError, match="decoder layer 2's offloaded input was loaded already"):
        offload.load(saved[2])


def test_two_forwards_before_one_backward_keep_their_own_inputs():
    """The second forward's inputs do not overwrite the first's; nothing links across forwards."""
    offload = ActivationOffload(num_layers=3)
    first = [torch.full((2, 5), float(i)) for i in range(3)]
    second = [torch.full((2, 5), 10.0 + i) for i in range(3)]
    saved_first, saved_second = _forward(offload, first), _forward(offload, second)
    assert saved_second[0].previous is None  # layer 0 of the second forward: not linked to layer 1 of the first
    for saved, inputs in ((saved_second, second), (saved_first, first)):
        assert all(torch.equal(offload.load(s), x) for s, x in zip(reversed(saved), reversed(inputs)))


@pytest.mark.parametrize(
    "device, dtype", [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)]
)
def test_checkpointing_through_offloaded_inputs_gives_the_plain_autograd_gradients(device, dtype):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(23, 23, device=device) for _ in range(3))
    layers[1].weight.requires_grad_(False)  # a frozen weight gets no gradient
    x = torch.randn(2, 7, 23, device=device, requires_grad=True)
    autocast = dict(device_type=device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)

    def run(checkpointed: bool):
        offload = ActivationOffload(num_layers=3)
        with torch.autocast(**autocast):
            h = x
            for i, layer in enumerate(layers):
                fn = lambda t, layer=layer: torch.nn.functional.silu(layer(t)) + t  # noqa: E731
                params = [p for p in layer.parameters() if p.requires_grad]
                h = offloaded_checkpoint(fn, offload, i, h, params) if checkpointed else fn(h)
        h.float().square().sum().backward()
        grads = [x.grad.clone(), *(p.grad.clone() for p in layers.parameters() if p.grad is not None)]
        x.grad = None
        layers.zero_grad(set_to_none=True)
        return h.detach(), grads, offload

    want_out, want = run(checkpointed=False)[:2]
    got_out, got, offload = run(checkpointed=True)
    assert layers[1].weight.grad is None and len(got) == len(want) == 6
    if device == "cpu":  # the same kernels on the same values
        assert torch.equal(got_out, want_out) and all(torch.equal(g, w) for g, w in zip(got, want))
    else:  # the same too, but cuBLAS may pick another algorithm on a second call
        assert torch.allclose(got_out, want_out, rtol=1e-2, atol=1e-2)
        assert all(torch.allclose(g, w, rtol=1e-3, atol=1e-4) for g, w in zip(got, want))
    assert offload.stats()["offloaded_inputs"] == 2


@pytest.mark.gpu
def test_offloading_frees_the_inputs_on_the_gpu_and_never_syncs():
    """Two forwards and backwards (the second's first save reads the first's copy and wait events): no sync;
    then the stats: every copy and wait timed, at a plausible bandwidth."""
    mib = 2**20
    offload = ActivationOffload(num_layers=5)
    rounds = []
    try:
        for _ in range(2):
            inputs = [torch.randn(4 * mib, device="cuda", dtype=torch.bfloat16) for _ in range(5)]  # 8 MiB each
            want = [x.clone() for x in inputs]
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.set_sync_debug_mode("error")
            saved = [offload.save(x, i) for i, x in enumerate(inputs)]
            del inputs
            freed = before - torch.cuda.memory_allocated()
            loaded = [offload.load(s) for s in reversed(saved)][::-1]
            torch.cuda.set_sync_debug_mode("default")
            rounds.append((freed, loaded, want))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for freed, loaded, want in rounds:
        assert freed == 4 * 8 * mib  # all but the last layer's
        assert all(torch.equal(got, w) for got, w in zip(loaded, want))
    torch.cuda.synchronize()
    stats = offload.stats()
    assert stats["offloaded_bytes"] == stats["reloaded_bytes"] == 2 * 4 * 8 * mib and stats["forwards"] == 2
    assert stats["compute_waits"] == 2 * 8 and not offload.meter.pending  # per round: saves 1-4 and loads 0-3
    assert 1 < stats["copy_d2h_gbps"] < 1000 and 1 < stats["copy_h2d_gbps"] < 1000, stats  # pinned memory: tens of GB/s
    assert stats["compute_wait_ms"] >= 0 and stats["compute_wait_ms_per_forward"] == stats["compute_wait_ms"] / 2


def test_an_input_changed_in_place_during_its_forward_is_an_error():
    offload = ActivationOffload(num_layers=3)
    x = torch.randn(4, 5)
    offload.save(x, 0)
    x.mul_(2)  # the asynchronous copy to the host may have read either value
    with pytest.raises(RuntimeError, match="decoder layer 0's input was changed in place"):
        offload.save(torch.randn(4, 5), 1)


def test_a_forward_without_backward_keeps_nothing_alive():
    import gc
    import weakref

    offload = ActivationOffload(num_layers=3)
    saved = _forward(offload, [torch.randn(4, 5) for _ in range(3)])
    refs = [weakref.ref(s) for s in saved]
    del saved
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.gpu
def test_offloading_lowers_reserved_memory_while_the_gpu_lags_behind_the_host():
    """Under CUDA graphs the host runs ahead of the GPU. An input's memory must be reusable at once
    by the compute stream (ordered after its copy), not kept back until the allocator sees the copy
    finish (``record_stream``), which would make the allocator reserve new memory for every layer."""

    def reserved_peak(offload: ActivationOffload | None) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_reserved()  # what other tests still hold
        x = torch.randn(4 * 2**20, device="cuda")  # 16 MiB
        saved = []
        for i in range(16):
            torch.cuda._sleep(5_000_000)  # the layer's work (a few ms): the GPU falls behind the host
            saved.append(offload.save(x, i) if offload else x)
            x = x * 1.001  # the layer's output, the next layer's input
        for s in reversed(saved):
            y = offload.load(s) if offload else s
            torch.cuda._sleep(5_000_000)
            x = x + y
        del saved, s, y
        torch.cuda.synchronize()
        return torch.cuda.max_memory_reserved() - before

    offload = ActivationOffload(num_layers=16)
    reserved_peak(offload)  # warms the pinned host cache: later saves allocate no host memory
    plain, offloaded = reserved_peak(None), reserved_peak(offload)
    assert offloaded < 0.5 * plain, (offloaded, plain)


def test_the_inputs_kept_on_the_device_are_checked_for_in_place_changes_too():
    offload = ActivationOffload(num_layers=2)
    first, last = torch.randn(3), torch.randn(3)
    saved = [offload.save(first, 0), offload.save(last, 1)]  # the last layer's stays on the device
    last.add_(1)
    with pytest.raises(RuntimeError, match="decoder layer 1's input was changed in place"):
        offload.load(saved[1])


def test_the_last_input_saved_is_returned_as_it_is_when_no_layer_came_after():
    offload = ActivationOffload(num_layers=4)  # only two of the four layers run (e.g. a truncated model)
    inputs = [torch.randn(2, 3), torch.randn(2, 3)]
    saved = _forward(offload, inputs)
    assert offload.holding is saved[1]
    loaded = offload.load(saved[1])
    assert loaded.data_ptr() == inputs[1].data_ptr() and offload.holding is None  # no round trip through the host
    assert torch.equal(offload.load(saved[0]), inputs[0])


def test_a_memory_plan_offloads_only_its_layers():
    """``layers`` (a memory plan): the others stay on the device as the last layer's does; all come back unchanged."""
    offload = ActivationOffload(num_layers=4, layers={0, 2})
    inputs = [torch.randn(3, 5) for _ in range(4)]
    saved = _forward(offload, [x.clone() for x in inputs])
    assert [s.host is not None for s in saved] == [True, False, True, False]
    assert all(torch.equal(offload.load(s), x) for s, x in zip(reversed(saved), reversed(inputs)))
    assert offload.stats()["offloaded_inputs"] == 2


class _FakeEvent:
    """An event at ``ms`` on a fake clock, completed once ``clock["now"]`` reaches it."""

    def __init__(self, clock: dict, ms: float):
        self.clock, self.ms = clock, ms

    def query(self) -> bool:
        return self.clock["now"] >= self.ms

    def elapsed_time(self, end: "_FakeEvent") -> float:
        assert self.query() and end.query(), "elapsed_time of an event that has not completed (CUDA raises)"
        return end.ms - self.ms


def test_the_copy_meter_adds_up_only_the_completed_copies_and_waits_and_keeps_the_rest():
    clock = {"now": 0.0}
    meter = CopyMeter(max_pending=3)
    event = lambda ms: _FakeEvent(clock, ms)  # noqa: E731
    meter.forward()
    meter.copied("d2h", 4_000_000, event(0), event(2))  # 4 MB in 2 ms: 2 GB/s
    meter.waited(event(1), event(2.5))  # the compute stream stalled 1.5 ms on it
    meter.copied("h2d", 1_000_000, event(3), event(3.5))  # done after the wait's entry: read in order
    meter.copied("h2d", 1_000_000, event(4), event(5))  # over max_pending: counted, not timed
    assert meter.bytes == {"d2h": 4_000_000, "h2d": 2_000_000} and meter.waits == 1 and len(meter.pending) == 3
    clock["now"] = 3.5
    meter.forward()  # the next forward reads the completed entries, never waits for the others
    assert len(meter.pending) == 0 and meter.forwards == 2
    meter.copied("d2h", 4_000_000, event(6), event(7))  # 4 GB/s, not completed when the stats are read
    assert meter.stats() == {
        "copy_d2h_gbps": 2.0, "copy_h2d_gbps": 2.0, "compute_waits": 1, "compute_wait_ms": 1.5,
        "compute_wait_ms_per_forward": 0.75,
    }
    clock["now"] = 7.0
    assert meter.stats()["copy_d2h_gbps"] == 8_000_000 / 3 / 1e6  # both copies' bytes over both copies' times
    assert len(meter.pending) == 0


def test_the_copy_meter_reads_every_completed_entry_at_stats_time_even_behind_one_that_is_not():
    clock = {"now": 0.0}
    meter = CopyMeter()
    meter.copied("h2d", 10**6, _FakeEvent(clock, 0), _FakeEvent(clock, 10))  # a slow copy, still running
    meter.waited(_FakeEvent(clock, 0), _FakeEvent(clock, 0.5))  # a wait on an earlier one, done
    clock["now"] = 1.0
    meter.resolve()  # in order: stops at the running copy
    assert len(meter.pending) == 2
    stats = meter.stats()  # everything completed: the wait, and the copy stays for later
    assert stats["compute_wait_ms"] == 0.5 and stats["copy_h2d_gbps"] is None and len(meter.pending) == 1
