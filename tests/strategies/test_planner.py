"""The memory planner (`lightning_ft.strategies.planner`): pure logic on measured inputs, on the CPU."""

from __future__ import annotations

import itertools
import random

import pytest
from rich.console import Console

from lightning_ft.strategies.planner import (
    GIB,
    MIB,
    Bandwidth,
    LayerProfile,
    SavedClass,
    budget_bytes,
    plan,
)

FAST = Bandwidth(50e9, 50e9)  # copies of a few MiB hide under ms of compute
SLOW = Bandwidth(1e8, 1e8)  # 100 MB/s: nothing hides


def _layers(n=8, input_mib=64, attention_mib=96, projections_mib=256, forward_s=4e-3, backward_s=8e-3, actions=None):
    """``n`` alike decoder layers: the input (keep | offload), attention and projections (any action by default)."""
    saved = (
        SavedClass("input", input_mib * MIB, actions=("keep", "offload")),
        SavedClass("attention", attention_mib * MIB, recompute_s=2e-3, actions=actions or ("keep", "offload", "recompute")),
        SavedClass("projections", projections_mib * MIB, recompute_s=3e-3, actions=actions or ("keep", "offload", "recompute")),
    )
    return [LayerProfile(forward_s, backward_s, saved) for _ in range(n)]


def _random_layers(rng, n, projections):
    """``n`` decoder layers of random times and sizes: input (keep | offload), attention (any action) and with
    ``projections`` those (keep | recompute)."""
    def saved():
        yield SavedClass("input", rng.randint(8, 128) * MIB, actions=("keep", "offload"))
        yield SavedClass("attention", rng.randint(8, 256) * MIB, recompute_s=rng.uniform(0, 4e-3))
        if projections:
            yield SavedClass("projections", rng.randint(8, 512) * MIB, recompute_s=rng.uniform(0, 6e-3), actions=("keep", "recompute"))

    return [LayerProfile(rng.uniform(1e-3, 8e-3), rng.uniform(2e-3, 16e-3), tuple(saved())) for _ in range(n)]


def _brute_force(layers, budget, base, bandwidth):
    """The exact optimum over every combination (small cases), with the planner's cost model."""
    from lightning_ft.strategies.planner import _options, _peak

    per_layer = [_options(layer, layers[i + 1].backward_s if i + 1 < len(layers) else 0.0, bandwidth, 0.01, i == len(layers) - 1)
                 for i, layer in enumerate(layers)]
    best = None
    for combo in itertools.product(*per_layer):
        peak = _peak(base, list(combo))
        if peak <= budget:
            time = sum(o.time for o in combo)
            best = time if best is None else min(best, time)
    return best


def test_ample_memory_keeps_everything_and_a_tight_budget_is_respected():
    layers = _layers()
    everything = sum(c.nbytes for layer in layers for c in layer.saved)
    roomy = plan(layers, budget=10 * GIB, base_bytes=GIB, bandwidth=FAST)
    assert roomy.fits and all(set(acts.values()) == {"keep"} for acts in roomy.actions)
    assert roomy.peak_bytes == GIB + everything
    assert roomy.step_s == pytest.approx(8 * 12e-3)
    for budget_gib in (1.5, 2.0, 2.5, 3.0):
        tight = plan(layers, budget=int(budget_gib * GIB), base_bytes=GIB, bandwidth=FAST)
        assert tight.fits and tight.peak_bytes <= tight.budget_bytes
        assert tight.step_s >= roomy.step_s


def test_more_budget_is_never_slower():
    rng = random.Random(0)
    for _ in range(8):
        layers = _random_layers(rng, rng.randint(2, 10), projections=True)
        bandwidth = Bandwidth(rng.uniform(1e9, 60e9), rng.uniform(1e9, 60e9))
        previous = None
        for budget in range(GIB, 8 * GIB, GIB // 4):
            made = plan(layers, budget=budget, base_bytes=GIB // 2, bandwidth=bandwidth)
            if made.fits:
                assert made.peak_bytes <= budget
                assert previous is None or made.step_s <= previous + 1e-12
                previous = made.step_s


def test_near_the_exact_optimum_on_small_cases():
    """The greedy over convex hulls against every combination: within 10% of the optimum's extra time."""
    rng = random.Random(1)
    for _ in range(15):
        layers = _random_layers(rng, 3, projections=False)
        compute = sum(layer.forward_s + layer.backward_s for layer in layers)
        for budget in (GIB // 2 + 200 * MIB, GIB // 2 + 500 * MIB, GIB):
            made = plan(layers, budget=budget, base_bytes=GIB // 2, bandwidth=FAST)
            best = _brute_force(layers, budget, GIB // 2, FAST)
            if best is None:
                assert not made.fits
                continue
            assert made.fits and made.peak_bytes <= budget
            assert made.step_s - compute <= 1.1 * (best - compute) + 1e-9


def test_offload_only_where_the_copy_hides():
    """Short of memory for everything: with fast copies the plan offloads what its copies hide under
    (a layer's 256 MiB of projections take 5.4 ms at 50 GB/s, more than its 4 ms forward: recomputed or
    kept, never offloaded); with slow copies it offloads nothing; the last layer never offloads."""
    layers = _layers()
    budget = GIB + 8 * (64 + 96) * MIB  # room for the inputs and attention, not the projections
    fast = plan(layers, budget=budget, base_bytes=GIB, bandwidth=FAST)
    offloaded = {i for name in fast.names for i in fast.layers_where(name, "offload")}
    assert fast.fits and offloaded and 7 not in offloaded and not fast.layers_where("projections", "offload")
    for i in offloaded:  # its copies hide under the layer's forward and the next layer's backward
        assert fast.offloaded_bytes[i] / FAST.device_to_host <= layers[i].forward_s
        assert fast.offloaded_bytes[i] / FAST.host_to_device <= layers[i + 1].backward_s
    slow = plan(layers, budget=budget, base_bytes=GIB, bandwidth=SLOW)
    assert slow.fits and not any(slow.layers_where(name, "offload") for name in slow.names)
    assert slow.layers_where("projections", "recompute")
    assert fast.step_s < slow.step_s


def test_what_cannot_be_recomputed_is_offloaded_or_kept():
    layers = _layers(actions=("keep",))  # attention and projections kept; only the inputs may move
    budget = GIB + 8 * (96 + 256) * MIB + 3 * 64 * MIB + 2 * 64 * MIB  # all but 5 inputs, and staging
    made = plan(layers, budget=budget, base_bytes=GIB, bandwidth=FAST)
    assert made.fits and len(made.layers_where("input", "offload")) == 5 and not made.layers_where("attention", "recompute")
    too_small = plan(layers, budget=GIB, base_bytes=GIB, bandwidth=FAST)
    assert not too_small.fits and too_small.peak_bytes > GIB  # the leanest plan, said not to fit


def test_the_table_shows_runs_of_layers_the_time_and_the_peak():
    layers = _layers()
    made = plan(layers, budget=GIB + 8 * (64 + 96) * MIB, base_bytes=GIB, bandwidth=SLOW, other_s=0.01)
    console = Console(width=140, record=True)
    console.print(made.table())
    text = console.export_text()
    assert "memory plan" in text and f"predicted step {made.step_s * 1e3:.1f} ms" in text
    assert f"peak {made.peak_bytes / GIB:.2f} GiB" in text and "input" in text and "recompute" in text
    assert "0–" in text  # alike layers share a row
    summary = made.summary()
    assert summary["predicted_peak_bytes"] == made.peak_bytes and summary["layers"]["input"]["keep"] == 8
    assert made.bandwidth == SLOW  # for the run's summary: the ceiling of the copies' achieved bandwidth


def test_budget_bytes():
    assert budget_bytes(None, 10 * GIB) is None
    assert budget_bytes("auto", 10 * GIB) == 9 * GIB
    assert budget_bytes(2, 0) == 2 * GIB and budget_bytes(0.5, 0) == GIB // 2
    for bad in (0, -1, "lots", True):
        with pytest.raises(ValueError, match="strategy.memory_budget_gib=.*expected a number of GiB > 0, auto, or null"):
            budget_bytes(bad, 0)


def test_a_host_budget_bounds_what_is_offloaded_and_says_why():
    from lightning_ft.strategies.planner import host_bytes

    layers = _layers(n=8, actions=("keep", "recompute"))
    tight = GIB + 400 * MIB  # keeping every input (8 × 64 MiB) does not fit beside the base: some must be offloaded
    free = plan(layers, tight, GIB, FAST)
    assert free.fits and free.layers_offloading() and free.host_bytes == host_bytes(free.offloaded_bytes) and not free.fallbacks
    assert host_bytes([3 * MIB, 0, 64 * MIB]) == 4 * MIB + 64 * MIB  # a power of two each, as the caching host allocator
    limit = free.host_bytes - 64 * MIB
    bounded = plan(layers, tight, GIB, FAST, host_budget=limit)
    assert bounded.host_bytes <= limit and len(bounded.layers_offloading()) < len(free.layers_offloading())
    assert bounded.step_s >= free.step_s and bounded.fallbacks and "strategy.host_budget_gib=" in bounded.fallbacks[0]
    assert bounded.summary()["fallbacks"] == list(bounded.fallbacks) and bounded.summary()["host_bytes"] == bounded.host_bytes
    assert not plan(layers, tight, GIB, FAST, host_budget=free.host_bytes).fallbacks  # enough: the same plan
    assert plan(layers, tight, GIB, FAST, host_budget=0).host_bytes == 0


def test_each_offloaded_class_has_its_own_two_staging_buffers():
    """Inputs and attention offloaded: the peak has two staging buffers of each class's largest offload (attention's
    are the staging sets the layers take turns on, the inputs' the two reloads in flight), and the plan keeps to it."""
    layers = _layers(actions=("keep", "offload"), projections_mib=0)
    everything = 8 * (64 + 96) * MIB
    lean = everything - 7 * (64 + 96) * MIB + 2 * (64 + 96) * MIB  # all but the last layer's offloaded, and staging
    made = plan(layers, budget=GIB + lean, base_bytes=GIB, bandwidth=FAST)
    assert made.fits and made.layers_where("input", "offload") == made.layers_where("attention", "offload") == set(range(7))
    assert made.peak_bytes == GIB + lean
    assert not plan(layers, budget=GIB + lean - MIB, base_bytes=GIB, bandwidth=FAST).fits
