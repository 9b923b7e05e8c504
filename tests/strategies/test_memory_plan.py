"""The memory plan's caller (`ExecutionMixin.plan_memory`, `lightning_ft.strategies.profiler`): measured at the
first training batch, planned within the budgets, applied, logged and reported in summary.json.

On the CPU there is no plan (no budget); these tests give the strategy a profiler that says the CPU has memory
to plan and feeds fixed timings and bandwidths, while the bytes come from the real layers (the kept stores,
the inputs); under DDP (two forked gloo processes) each rank's profiler measures other bandwidths. The GPU case
measures for real.

    python -m pytest -q tests/strategies/test_memory_plan.py            (CPU)
    python -m pytest -q -m gpu tests/strategies/test_memory_plan.py     (GPU)
"""

import json
import logging
from dataclasses import replace

import lightning as L
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from test_cuda_graphs import (
    DEVICES,
    TINY,
    _batch,
    _loss_and_grads,
    _module,
)
from test_cuda_graphs import test_every_memory_plan_gives_the_gradients_of_plain_checkpointing as _plan_gives_plain_gradients
from test_cuda_graphs import test_offloaded_kinds_give_the_gradients_of_keeping_them as _offloaded_kinds_give_kept_gradients

from lightning_ft.strategies.cuda_graphs import apply_cuda_graphs, graphed_layers
from lightning_ft.strategies.kept import KINDS
from lightning_ft.strategies.offload import ActivationOffload
from lightning_ft.strategies.planner import GIB, MIB, Bandwidth
from lightning_ft.strategies.profiler import StepProfiler, layer_kind
from lightning_ft.strategies.strategy import Execution, SingleDeviceStrategy

#: seconds each measurement takes, by what it measures (`StepProfiler.timed`'s ``what``)
TIMES = {"forward": 2e-3, "backward": 4e-3, "recompute:attention": 5e-3, "recompute:projections": 4.5e-3, "recompute:mlp": 6.5e-3}
#: seconds between two marks (`StepProfiler.mark`, `between`): the forward before the first layer and after the last
BETWEEN = {("pass", "layers"): 0.01, ("head", "end"): 0.03}


LAYERS = 6  # the tiny Llama deepened: offloading saves memory from 4 layers on (two staging buffers)


class FakeProfiler(StepProfiler):
    """A CUDA-like profiler on the CPU: the budget's free memory, fixed times and bandwidths; the bytes are measured,
    then scaled by ``scale`` (the tiny model's KiB to a GPU's MiB, the plan's unit)."""

    def __init__(self, free=8 * GIB, host=64 * GIB, scale=1, gbps=50):
        super().__init__()
        self.free, self.host, self.scale, self.gbps, self.calls = free, host, scale, gbps, []

    def measure(self, *args, **kwargs):
        measured = super().measure(*args, **kwargs)
        layers = tuple(replace(p, saved=tuple(replace(c, nbytes=c.nbytes * self.scale) for c in p.saved)) for p in measured.layers)
        return replace(measured, layers=layers)

    def free_bytes(self, device):
        return self.free

    def free_host_bytes(self):
        return self.host

    def timed(self, fn, device, layer, what):
        fn()
        self.calls.append((layer, what))
        return lambda: TIMES.get(what, 0.0)

    def mark(self, device, what):
        self.calls.append(("mark", what))
        return what

    def between(self, start, end):
        return BETWEEN[start, end]

    def bandwidth(self, device):
        return Bandwidth(self.gbps * 1e9, self.gbps * 1e9)


class Grads(L.Callback):
    """Appends each optimizer step's gradients (cloned, by parameter name) to ``grads``."""

    def __init__(self, grads: list):
        self.grads = grads

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.clone() for n, p in pl_module.model.named_parameters() if p.grad is not None})


@pytest.fixture
def deep(monkeypatch):
    monkeypatch.setitem(TINY["llama"], "num_hidden_layers", LAYERS)


def _strategy(profiler, **options):
    strategy = SingleDeviceStrategy(execution=Execution(cuda_graphs=True, **options))
    strategy.profiler = profiler
    return strategy


def test_the_profile_has_each_layers_bytes_and_times_and_the_plan_follows_the_budget(caplog, deep):
    module = _module("llama", "cpu", lora_kernel=True)
    apply_cuda_graphs(module.model)
    batch = _batch("a", "cpu")
    layers = LAYERS
    profiler = FakeProfiler()
    measured = profiler.measure(module, batch, graphed_layers(module.model), KINDS)
    assert len(measured.layers) == layers
    tokens, hidden = batch.num_tokens, TINY["llama"]["hidden_size"]
    for profile in measured.layers:
        assert (profile.forward_s, profile.backward_s) == (TIMES["forward"], TIMES["backward"])
        saved = {c.name: c for c in profile.saved}
        assert saved["input"].nbytes == tokens * hidden * 4 and saved["input"].actions == ("keep", "offload")
        # attention: the output [T, Hq·D] and the log-sum-exp; projections: Llama's v/o, mlp: its gate/up/down, with x·Aᵀ
        assert saved["attention"].nbytes >= tokens * hidden * 4 and saved["mlp"].nbytes > saved["projections"].nbytes > 0
        assert saved["attention"].recompute_s == pytest.approx(1e-3) and saved["projections"].recompute_s == pytest.approx(0.5e-3)
        assert saved["mlp"].recompute_s == pytest.approx(2.5e-3)
        assert saved["attention"].actions == saved["projections"].actions == saved["mlp"].actions == ("keep", "offload", "recompute")
    # the forward outside the layers, timed in a pass after the measuring one (before the first layer, after the
    # last), ×3 for its backward
    marks = [i for i, (layer, _) in enumerate(profiler.calls) if layer == "mark"]
    assert [profiler.calls[i][1] for i in marks] == ["pass", "layers", "head", "end"]
    assert marks[0] > max(i for i, (layer, _) in enumerate(profiler.calls) if layer != "mark")
    assert measured.other_s == pytest.approx(3 * sum(BETWEEN.values()))
    trainable = sum(p.numel() * p.element_size() for p in module.model.parameters() if p.requires_grad)
    # the CPU's memory figures are 0: gradients and AdamW's two moments, the graphs' four static [T, hidden] buffers
    assert measured.base_bytes == 3 * trainable + 4 * tokens * hidden * 4
    # the layers are alike (one kind): the first measured after a warm-up, the others given its measurement; none
    # recorded into graphs, the model's kwargs untouched
    assert sum(what == "forward" for _, what in profiler.calls) == 2
    state_graphs = getattr(graphed_layers(module.model)[0], "_lightning_ft_cuda_graphs").graphs
    assert not state_graphs

    # (scaled: 16 MiB of input per layer) ample memory: everything kept; 64 MiB: inputs offloaded (keeping all six
    # takes 96), the rest recomputed; no pinned host memory: nothing offloaded, the reason logged, and no plan fits
    scaled = dict(scale=2**10)
    strategy = _strategy(FakeProfiler(**scaled), memory_budget_gib=8.0)
    with caplog.at_level(logging.INFO):
        made = strategy.plan_memory(module, batch)
    assert strategy.memory_plan is made and made.fits and "memory plan" in caplog.text and "predicted step" in caplog.text
    assert all(made.action(i, kind) == "keep" for i in range(layers) for kind in ("input", *KINDS))
    lean = _strategy(FakeProfiler(**scaled), memory_budget_gib=64 / 1024).plan_memory(module, batch)
    assert lean.fits and len(lean.layers_where("input", "offload")) >= 4 and lean.peak_bytes <= 64 * MIB
    assert lean.layers_where("mlp", "recompute") == set(range(layers)) and lean.host_bytes > 0
    caplog.clear()
    with caplog.at_level(logging.INFO), pytest.warns(Warning, match="memory plan: even keeping nothing .* the leanest plan"):
        hostless = _strategy(FakeProfiler(**scaled), memory_budget_gib=64 / 1024, host_budget_gib=0).plan_memory(module, batch)
    assert not hostless.layers_where("input", "offload") and hostless.host_bytes == 0 and not hostless.fits
    assert ("strategy.host_budget_gib=0.00: the fastest plan offloads 0.08 GiB to pinned host memory, more than that; 0 of 6 "
            "layers offload (0.00 GiB), the others keep or recompute instead") in caplog.text
    # the options constrain it: activation_offload offloads every input but the last, keep_* false leaves a class out
    forced = _strategy(FakeProfiler(**scaled), memory_budget_gib=8.0, activation_offload=True, keep_projections=False)
    forced = forced.plan_memory(module, batch)
    assert forced.layers_where("input", "offload") == set(range(layers - 1)) and forced.action(layers - 1, "input") == "keep"
    assert forced.names == ("input", "attention") and forced.layers_where("attention", "keep") == set(range(layers))
    hostless = _strategy(FakeProfiler(**scaled), memory_budget_gib=8.0, activation_offload=True, host_budget_gib=0)
    hostless = hostless.plan_memory(module, batch)  # the host budget wins: the inputs stay, said so
    assert not hostless.layers_where("input", "offload") and hostless.fits and hostless.fallbacks
    assert _strategy(FakeProfiler(), host_budget_gib=None).host_budget() is None
    assert _strategy(FakeProfiler(host=4 * GIB)).host_budget() == 3 * GIB  # auto: 75% of what is available


def test_no_plan_without_a_budget_or_graphed_layers(caplog):
    module = _module("llama", "cpu", lora_kernel=True)
    batch = _batch("a", "cpu")
    assert SingleDeviceStrategy(execution=Execution(cuda_graphs=True)).plan_memory(module, batch) is None  # the CPU: no budget
    assert _strategy(FakeProfiler(), memory_budget_gib=None).plan_memory(module, batch) is None
    with caplog.at_level(logging.INFO):
        assert _strategy(FakeProfiler()).plan_memory(module, batch) is None  # not graphed
    assert "memory plan: none" in caplog.text


@pytest.mark.parametrize("budget_mib, offloaded", [(64, ("input",)), (120, ("input", "attention"))])
def test_fit_plans_at_the_first_batch_and_summary_json_has_the_prediction_beside_the_peak(tmp_path, deep, caplog, budget_mib, offloaded):
    """A real Lightning fit: the strategy plans once, before the second batch (where graphs record), training runs
    under the plan with the gradients of the module without one, and summary.json reports the plan. 64 MiB
    (scaled): the inputs are offloaded, the rest recomputed; 120 MiB: attention's outputs (17 MiB a layer) too, in
    most layers (two staging sets and what the last layer keeps: quicker than recomputing them)."""
    from lightning_ft.callbacks.summary import RunSummary

    module = _module("llama", "cpu", lora_kernel=True)
    reference = _module("llama", "cpu", lora_kernel=True)
    reference.model.load_state_dict(module.model.state_dict())
    apply_cuda_graphs(module.model)
    batches = [_batch(row, "cpu", seed=i) for i, row in enumerate("abab")]
    strategy = _strategy(FakeProfiler(scale=2**10), memory_budget_gib=budget_mib / 1024, host_budget_gib=None)
    planned = []
    original = strategy.plan_memory
    strategy.plan_memory = lambda m, b: planned.append(b) or original(m, b)
    grads = []

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=len(batches), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Grads(grads), RunSummary(tmp_path)])
    loader = torch.utils.data.DataLoader(batches, batch_size=1, collate_fn=lambda items: items[0])
    with caplog.at_level(logging.INFO):
        trainer.fit(module, train_dataloaders=loader)
    assert len(planned) == 1 and torch.equal(planned[0].input_ids, batches[0].input_ids)
    made = strategy.memory_plan
    assert all(len(made.layers_where(name, "offload")) >= 3 for name in offloaded) and made.layers_where("projections", "recompute")
    if "attention" in offloaded:
        assert not made.layers_where("attention", "recompute")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["predicted_peak_memory_bytes"] == made.peak_bytes and summary["peak_memory_bytes"] > 0
    assert all(summary["memory_plan"]["layers"][name]["offload"] == len(made.layers_where(name, "offload")) for name in offloaded)
    assert summary["cuda_graphs"]["replayed_layer_calls"] > 0 and summary["cuda_graphs"]["offloaded_inputs"] > 0
    assert (summary["cuda_graphs"]["offloaded_kept"] > 0) == ("attention" in offloaded)
    offloading = summary["cuda_graphs"]
    assert (f"activation offloading: {offloading['offloaded_inputs']} layer inputs and {offloading['offloaded_kept']} layer "
            "calls' kept activations") in caplog.text
    # off CUDA the copies are not timed; the ceiling is the plan's measured bandwidth (FakeProfiler's 50 GB/s)
    assert summary["offload_copies"] == {"copy_d2h_gbps": None, "copy_h2d_gbps": None, "ceiling_d2h_gbps": 50.0,
                                         "ceiling_h2d_gbps": 50.0, "compute_wait_ms_per_step": None}
    assert "copy times not measured (off CUDA)" in caplog.text
    # the same steps without a plan (plain checkpointing, transformers'): the same gradients at every step
    reference_trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(batches), logger=False, enable_checkpointing=False,
                                  enable_progress_bar=False, enable_model_summary=False, callbacks=[Grads(grads)])
    mine = grads[:]
    grads.clear()
    reference_trainer.fit(reference, train_dataloaders=loader)
    assert len(mine) == len(grads) == len(batches)
    for step, (got, want) in enumerate(zip(mine, grads)):
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), f"step {step}"


#: the collectives of `torch.distributed` a process could sync with
COLLECTIVES = ("broadcast", "broadcast_object_list", "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "reduce", "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
               "send", "recv", "isend", "irecv", "all_to_all_single")


def test_under_ddp_every_rank_applies_rank_zeros_plan_from_one_broadcast(tmp_path, deep, monkeypatch):
    """Two gloo processes (strategy=ddp, forked), each measuring its own copy bandwidth: rank 0 50 GB/s (alone it
    offloads the inputs and attention), rank 1 0.5 GB/s (alone it keeps the inputs and recomputes attention). Both
    apply rank zero's plan, which reaches rank 1 in the one broadcast (no other collective while planning), and two
    steps train with the losses and gradients of one process without a plan (plain checkpointing) accumulating the
    two ranks' batches; summary.json reports rank zero's plan."""
    import torch.distributed as dist
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    from lightning_ft.callbacks.summary import RunSummary
    from lightning_ft.strategies.cuda_graphs import cuda_graph_stats
    from lightning_ft.strategies.ddp import DDPStrategy

    gbps, budget = (50, 0.5), dict(memory_budget_gib=120 / 1024, host_budget_gib=None)

    class PerRank(FakeProfiler):
        def bandwidth(self, device):
            self.gbps = gbps[dist.get_rank()]
            return super().bandwidth(device)

    module = _module("llama", "cpu", lora_kernel=True)
    reference = _module("llama", "cpu", lora_kernel=True)
    reference.model.load_state_dict(module.model.state_dict())
    apply_cuda_graphs(module.model)
    batches = [_batch(row, "cpu", seed=i) for i, row in enumerate("abab")]

    class RankBatches(torch.utils.data.Sampler):  # rank r: batches r and r + 2 (one layout: graphs record at the second)
        def __iter__(self):
            return iter(range(dist.get_rank(), len(batches), 2))

        def __len__(self):
            return len(batches) // 2

    first = lambda items: items[0]  # noqa: E731
    ranked = torch.utils.data.DataLoader(batches, batch_size=1, sampler=RankBatches(), collate_fn=first)

    collectives, depth = [], [0]  # the outermost calls (broadcast_object_list calls broadcast)

    def counted(name, fn):
        def call(*args, **kwargs):
            if depth[0] == 0:
                collectives.append(name)
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for name in COLLECTIVES:
        wrapped = counted(name, getattr(dist.distributed_c10d, name))
        for namespace in (dist, dist.distributed_c10d):
            monkeypatch.setattr(namespace, name, wrapped)
    monkeypatch.setenv("MASTER_PORT", str(find_free_network_port()))  # Lightning's launcher sets it in this process
    # a forked child whose parent ran OpenMP regions deadlocks in its own multi-threaded ones (GNU libgomp is not
    # fork-safe): one thread in both while the ranks train (with OMP_NUM_THREADS=2 on 2 cores the test hung)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    strategy = DDPStrategy(execution=Execution(cuda_graphs=True, **budget), start_method="fork")
    strategy.profiler = PerRank(scale=2**10)
    original, planning = strategy.plan_memory, []

    def plan_memory(m, b):
        start = len(collectives)
        made = original(m, b)
        planning.extend(collectives[start:])
        return made

    strategy.plan_memory = plan_memory
    grads = []

    class Record(Grads):  # each rank's plan, what its layers apply, the collectives while planning, losses, gradients
        def on_train_end(self, trainer, pl_module):
            applied = getattr(graphed_layers(pl_module.model)[0], "_lightning_ft_cuda_graphs")
            offload = sorted(applied.offload.layers) if applied.offload else []
            torch.save({"plan": trainer.strategy.memory_plan, "applied": applied.plan, "offload": offload, "planning": planning,
                        "losses": pl_module.step_losses, "grads": grads, "stats": cuda_graph_stats(pl_module.model)},
                       tmp_path / f"rank{trainer.global_rank}.pt")

    options = dict(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False)
    torch.set_num_threads(1)
    try:
        L.Trainer(devices=2, strategy=strategy, use_distributed_sampler=False, callbacks=[Record(grads), RunSummary(tmp_path)],
                  **options).fit(module, ranked)
    finally:
        torch.set_num_threads(threads)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    alone = [_strategy(FakeProfiler(scale=2**10, gbps=g), **budget).plan_memory(module, batches[r]) for r, g in enumerate(gbps)]
    assert alone[0].layers_where("attention", "offload") and len(alone[1].layers_where("attention", "recompute")) == LAYERS - 1
    assert alone[1].actions != alone[0].actions and not alone[1].layers_where("input", "offload")
    for rank in ranks:
        assert rank["plan"] == rank["applied"] == alone[0] and rank["offload"] == sorted(alone[0].layers_where("input", "offload"))
        assert rank["planning"] == ["broadcast_object_list"]
        assert rank["stats"]["replayed_layer_calls"] > 0 and rank["stats"]["offloaded_kept"] > 0, rank["stats"]
    assert json.loads((tmp_path / "summary.json").read_text())["memory_plan"] == alone[0].summary()
    grads.clear()
    single = L.Trainer(devices=1, accumulate_grad_batches=2, callbacks=[Grads(grads)], **options)
    single.fit(reference, torch.utils.data.DataLoader(batches, batch_size=1, collate_fn=first))
    assert len(grads) == 2 and all(rank["losses"] == reference.step_losses for rank in ranks)
    for step, want in enumerate(grads):
        for rank in ranks:
            got = rank["grads"][step]
            assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), f"step {step}"


def _slow_copies(monkeypatch, device: str) -> None:
    """Make every copy of the offloaded inputs and kept activations as late as the offload allows.

    CUDA: the copy stream sleeps (``torch.cuda._sleep``, about 10 ms) before each use, so each copy to the host and
    back starts long after the compute stream queued it. CPU (copies are synchronous there): each copy of an input to
    the host lands only when the offload lets its input go (`ActivationOffload._let_go`, the latest point its design
    allows), reading the input as it is then; until then the host copy holds NaN. The copies of kept activations
    (`ActivationOffload._copy`) queue up as on a stream that runs only when the compute stream waits for one of them
    (`ActivationOffload._wait`, `wait_copies`): then it runs in order up to that one, reading and writing the buffers
    as they are then."""
    if device == "cuda":
        stream = ActivationOffload._stream

        def sleepy(self, on):
            s = stream(self, on)
            with torch.cuda.stream(s):
                torch.cuda._sleep(20_000_000)
            return s

        monkeypatch.setattr(ActivationOffload, "_stream", sleepy)
        return
    save, let_go, pending = ActivationOffload.save, ActivationOffload._let_go, {}

    def late_save(self, x, layer_index, staged=()):
        saved = save(self, x, layer_index, staged)
        if saved.host is not None and saved.source is not None:
            pending[id(saved)] = saved
            saved.host = torch.full_like(saved.host, float("nan"))
        return saved

    def late_let_go(self):
        if self.holding is not None and pending.pop(id(self.holding), None) is not None:
            self.holding.host.copy_(self.holding.source)
        let_go(self)

    monkeypatch.setattr(ActivationOffload, "save", late_save)
    monkeypatch.setattr(ActivationOffload, "_let_go", late_let_go)
    stream: list[tuple[object, list]] = []  # the copies queued and not run: (event, (destination, source) pairs)

    def run_until(event) -> None:
        while stream:
            queued, pairs = stream.pop(0)
            for destination, source in pairs:
                destination.copy_(source)
            if queued is event:
                return

    def late_copy(self, pairs, device, direction):
        event = object()
        stream.append((event, list(pairs)))
        return event

    monkeypatch.setattr(ActivationOffload, "_copy", late_copy)
    monkeypatch.setattr(ActivationOffload, "_wait", lambda self, device, event: event is not None and run_until(event))
    monkeypatch.setattr(ActivationOffload, "wait_copies", lambda self, device: run_until(None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("name", ["offload, recompute", "offload kept, gaps"])
def test_a_slow_copy_stream_gives_the_same_gradients(monkeypatch, kind, device, name):
    """`test_every_memory_plan_gives_the_gradients_of_plain_checkpointing` with every layer input but the last
    offloaded (and attention and projections in some layers) and the copies as late as possible (`_slow_copies`):
    the same loss and gradients as transformers' checkpointing, bit for bit on the CPU (within bf16's tolerance on
    the GPU), step after step."""
    _slow_copies(monkeypatch, device)
    _plan_gives_plain_gradients(kind, name, device, monkeypatch)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_a_slow_copy_stream_gives_the_gradients_of_keeping(monkeypatch, kind):
    """`test_offloaded_kinds_give_the_gradients_of_keeping_them` (two forwards before one backward among its steps)
    with the copies as late as possible: still bit for bit."""
    _slow_copies(monkeypatch, "cpu")
    _offloaded_kinds_give_kept_gradients(kind, "offload kept, gaps", monkeypatch)


@pytest.mark.gpu
def test_the_gpu_measures_the_layers_and_the_plan_fits_the_measured_peak():
    """On CUDA: real times (> 0), the copy bandwidth, and a plan made within a budget that the step then keeps to."""
    module = _module("llama", "cuda")
    apply_cuda_graphs(module.model)
    batch = _batch("a", "cuda")
    profiler = StepProfiler(copy_bytes=64 * MIB)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        measured = profiler.measure(module, batch, graphed_layers(module.model), ("attention", "projections"))
    assert all(p.forward_s > 0 and p.backward_s > 0 for p in measured.layers)
    assert measured.bandwidth.device_to_host > 1e9 and measured.bandwidth.host_to_device > 1e9
    assert measured.other_s > 0  # the embedding, head and loss, timed in their own pass
    assert measured.base_bytes >= torch.cuda.memory_allocated()
    strategy = SingleDeviceStrategy(execution=Execution(cuda_graphs=True))
    assert strategy.memory_budget(torch.device("cuda")) > 0
    made = strategy.plan_memory(module, batch)
    assert made is not None and made.fits
    torch.cuda.reset_peak_memory_stats()
    for step in range(3):
        _loss_and_grads(module, _batch("a", "cuda", seed=step), train=True)
    peak = torch.cuda.max_memory_allocated()
    assert peak <= made.budget_bytes, f"measured peak {peak / MIB:.1f} MiB, predicted {made.peak_bytes / MIB:.1f} MiB"


def test_host_budget_option_errors_name_the_key():
    from lightning_ft.strategies.strategy import host_budget_bytes

    for bad in (-1, "lots", True):
        with pytest.raises(ValueError, match=r"strategy.host_budget_gib=.*: expected a number of GiB >= 0, auto, or null for no limit"):
            Execution(host_budget_gib=bad).check()
    assert host_budget_bytes(2, available=0) == 2 * GIB and host_budget_bytes("auto", available=8 * GIB, processes=2) == 3 * GIB


def test_a_run_resumed_under_another_plan_trains_as_the_uninterrupted_one(tmp_path, deep):
    """Two steps under one plan (64 MiB, scaled: the inputs offloaded), a checkpoint, then two steps resumed under
    another (120 MiB: attention's outputs offloaded too, a new plan made at the resumed run's first batch) give the
    gradients of four steps under the first plan, bit for bit (CPU). The batches are one batch repeated, so that
    which batch a resumed epoch starts from does not matter here (tests/test_resume.py covers the data's order)."""
    loader = torch.utils.data.DataLoader([_batch("a", "cpu")] * 4, batch_size=1, collate_fn=lambda items: items[0])

    def train(budget_mib, max_steps, ckpt_path=None):
        module = _module("llama", "cpu", lora_kernel=True)
        apply_cuda_graphs(module.model)
        strategy = _strategy(FakeProfiler(scale=2**10), memory_budget_gib=budget_mib / 1024, host_budget_gib=None)
        grads = []

        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Grads(grads)])
        trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
        return trainer, strategy.memory_plan, grads

    _, plan, straight = train(64, 4)
    trainer, first_plan, first = train(64, 2)
    assert first_plan.actions == plan.actions
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    _, other_plan, resumed = train(120, 4, ckpt_path=tmp_path / "step2.ckpt")
    assert other_plan.layers_where("attention", "offload") and not plan.layers_where("attention", "offload")
    assert len(first + resumed) == len(straight) == 4
    for step, (got, expected) in enumerate(zip(first + resumed, straight), start=1):
        assert got.keys() == expected.keys() and got
        for name in expected:
            assert torch.equal(got[name], expected[name]), (step, name)


def test_the_first_layer_of_each_kind_is_warmed_up_before_it_is_timed():
    """`layer_kind`: a dense layer and an MoE layer, or a sliding and a full attention layer, run different kernels,
    whose first calls (compiling, autotuning, cuDNN's plans) must not count as the layer's time; layers alike share a
    kind."""
    model = _module("gpt_oss", "cpu").model
    apply_cuda_graphs(model)
    layers = graphed_layers(model)
    kinds = [layer_kind(layer) for layer in layers]
    types = [layer.self_attn.layer_type for layer in layers]
    assert len(set(types)) == 2 and all((kinds[i] == kinds[j]) == (types[i] == types[j])
                                        for i in range(len(layers)) for j in range(len(layers)))
    config = AutoConfig.for_model(  # GLM-4.5's layout: the first layer dense, the others MoE
        "glm4_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, vocab_size=64,
    )
    glm = AutoModelForCausalLM.from_config(config).model.layers
    assert layer_kind(glm[0]) != layer_kind(glm[1]) == layer_kind(glm[2])
    # measured once per kind (after its warm-up): the others of a kind get its measurement
    profiler = FakeProfiler()
    module = _module("gpt_oss", "cpu")
    apply_cuda_graphs(module.model)
    measured = profiler.measure(module, _batch("a", "cpu"), graphed_layers(module.model), KINDS)
    timed = [layer for layer, what in profiler.calls if what == "forward"]
    assert timed == [0, 0, 1, 1] and types[0] != types[1] and len(measured.layers) == len(layers)


class OutOfMemoryProfiler(FakeProfiler):
    """Runs out of memory keeping every kind of a layer at once (at attention's recompute), and keeping mlp alone."""

    def timed(self, fn, device, layer, what):
        if what in ("recompute:attention", "keep:mlp"):
            raise torch.OutOfMemoryError(f"CUDA out of memory (fake, at {what})")
        return super().timed(fn, device, layer, what)


def test_a_measuring_out_of_memory_keeps_the_kinds_apart_and_leaves_out_a_kind_too_large_alone(caplog, deep):
    """Keeping every kind at once does not fit: each kind is measured kept on its own (its recompute time: the backward
    with nothing kept less the backward keeping it), and one that does not fit even alone is recomputed in every layer."""
    module = _module("llama", "cpu", lora_kernel=True)
    apply_cuda_graphs(module.model)
    batch = _batch("a", "cpu")
    times = {"keep:attention": TIMES["backward"] - 1e-3, "keep:projections": TIMES["backward"] - 0.5e-3}
    profiler = OutOfMemoryProfiler()
    with pytest.MonkeyPatch.context() as patch:
        for what, seconds in times.items():
            patch.setitem(TIMES, what, seconds)
        measured = profiler.measure(module, batch, graphed_layers(module.model), KINDS)
        assert len(measured.layers) == LAYERS
        for profile in measured.layers:
            saved = {c.name: c for c in profile.saved}
            assert saved["attention"].recompute_s == pytest.approx(1e-3) and saved["projections"].recompute_s == pytest.approx(0.5e-3)
            assert saved["attention"].nbytes > 0 and saved["attention"].actions == ("keep", "offload", "recompute")
            assert saved["mlp"].nbytes == 0 and saved["mlp"].actions == ("recompute",)
            assert profile.backward_s == pytest.approx(TIMES["backward"] - 1.5e-3)
        assert measured.fallbacks == (
            "keeping every kind (attention, projections, mlp) of a layer at once ran out of GPU memory in the measuring "
            f"(decoder layer 0, {batch.num_tokens} tokens): each kind was measured kept on its own",
            f"keeping mlp of a layer ran out of GPU memory in the measuring ({batch.num_tokens} tokens) even on its own: "
            "recomputed in every layer",
        )
        strategy = _strategy(OutOfMemoryProfiler(scale=2**10), memory_budget_gib=8.0)
        with caplog.at_level(logging.INFO):
            made = strategy.plan_memory(module, batch)
    assert made.layers_where("mlp", "recompute") == set(range(LAYERS)) and made.layers_where("attention", "keep") == set(range(LAYERS))
    assert "memory plan: keeping mlp of a layer ran out of GPU memory" in caplog.text
