"""The lightning_ft Strategy: Lightning's single-device, DDP and FSDP2 strategies plus how a step runs.

`ExecutionMixin` mixes into each of them (`SingleDeviceStrategy` here, registered as ``lightning_ft``;
`lightning_ft.strategies.ddp.DDPStrategy`, ``lightning_ft_ddp``; `lightning_ft.strategies.fsdp2.FSDP2Strategy`,
``fsdp2``) and holds the ``strategy`` config group's options (`Execution`): CUDA graphs, which saved
activations the graphed layers keep, activation offloading, the memory budget, fp8 base weights. The model is built
by `lightning_ft.model.build.ModelBuilder`, which reads them from ``trainer.strategy.execution``.

The memory plan: at the first training batch on CUDA, with graphed decoder layers and a memory budget
(`ExecutionMixin.plan_memory`), the strategy measures the layers on that batch
(`lightning_ft.strategies.profiler.StepProfiler`, before any graph is recorded), makes the plan within
``strategy.memory_budget_gib`` and ``strategy.host_budget_gib`` (`lightning_ft.strategies.planner.plan`),
applies it and logs it as a table.

``fit`` makes the strategy (`make_strategy`) from ``trainer.strategy`` (a registry name; ``auto``:
this one on one device, DDP on several) and the ``strategy`` options. The single-device strategy
learns its device from Lightning's accelerator connector, exactly as Lightning's own ``auto``
choice does: the connector hands the devices of ``trainer.devices`` to any strategy with a
``parallel_devices`` attribute.
"""

from __future__ import annotations

import io
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy as LightningSingleDeviceStrategy
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from lightning_ft.strategies.planner import GIB, Plan, budget_bytes, plan

__all__ = ["STRATEGY_NAME", "Execution", "ExecutionMixin", "check_cuda_graphs_option", "SingleDeviceStrategy", "make_strategy"]

STRATEGY_NAME = "lightning_ft"

@dataclass(frozen=True)
class Execution:
    """How a training step runs (the ``strategy`` config group; `lightning_ft.config.StrategyConfig` documents each key).

    Attributes:
        cuda_graphs: replay each checkpointed decoder layer from CUDA graphs (`lightning_ft.strategies.cuda_graphs`):
            True, False or ``auto`` (where the run allows them; `lightning_ft.model.build.ModelBuilder` resolves it to a
            bool before the model loads, and the strategy holds the resolved options from then on).
        keep_attention: with CUDA graphs, keep attention's output and log-sum-exp for the backward (`lightning_ft.strategies.kept`).
        keep_projections: with CUDA graphs, keep the projections' outputs for the backward (attention's and the
            MLP's: two kinds of `lightning_ft.strategies.kept`).
        keep_max_gib: with CUDA graphs, at most this many GiB kept (None: while the memory budget holds).
        activation_offload: with CUDA graphs, each layer's checkpointed input waits in pinned host memory
            (`lightning_ft.strategies.offload`).
        memory_budget_gib: the GPU memory a step may use, in GiB, for the memory plan
            (`lightning_ft.strategies.planner`); ``auto``: the free memory less a margin; None: no plan
            (off CUDA there is never a plan).
        host_budget_gib: the pinned host memory the plan may offload to, in GiB; ``auto``: the host's
            available memory less `HOST_MARGIN` of it, shared by the processes of the node; None: no limit.
        fp8: the frozen base weight of every LoRA linear layer in e4m3 with per-output-channel scales, its
            products in fp8 on Hopper (`lightning_ft.strategies.fp8`); likewise the MoE experts under LoRA on the
            ``triton`` MoE backend.
        fp8_lm_head: with ``fp8``, the frozen lm_head too (`lightning_ft.strategies.fp8.convert_lm_head_to_fp8`): its
            logits and input-gradient GEMMs in fp8 inside the chunked linear cross-entropy.
    """

    cuda_graphs: bool | str = "auto"
    keep_attention: bool = True
    keep_projections: bool = True
    keep_max_gib: float | None = None
    activation_offload: bool = False
    memory_budget_gib: Any = "auto"
    host_budget_gib: Any = "auto"
    fp8: bool = False
    fp8_lm_head: bool = False

    @classmethod
    def from_config(cls, options: dict[str, Any] | None) -> Execution:
        """From the ``strategy`` config node (a plain dict; unknown keys are an error)."""
        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(options) - known):
            raise ValueError(f"strategy.{unknown[0]}: not an option of the lightning_ft strategy ({', '.join(sorted(known))})")
        return cls(**options)

    def check(self, no_cuda: str | None = None, hint: str = "") -> None:
        """The options that need each other or CUDA (``fit`` checks them before writing anything).

        Args:
            no_cuda: why no CUDA device will run the model (e.g. ``"trainer.accelerator=cpu"``), or None.
            hint: appended to the no-CUDA error.

        Raises:
            ValueError: a ``strategy.cuda_graphs`` other than true, false or ``auto``; ``strategy.activation_offload``
                with ``strategy.cuda_graphs=false``, or with ``auto`` where ``no_cuda`` turns the graphs off;
                ``strategy.cuda_graphs=true`` where ``no_cuda`` says why it cannot run (naming every key to change), a ``strategy.keep_max_gib``
                that is not a number of GiB >= 0, a ``strategy.memory_budget_gib`` that is neither ``auto``,
                null nor a positive number, a ``strategy.host_budget_gib`` that is neither ``auto``, null nor a
                number >= 0, ``strategy.fp8`` where ``no_cuda`` says why it cannot run, or ``strategy.fp8_lm_head``
                without ``strategy.fp8``.
        """
        from lightning_ft.strategies.cuda_graphs import keep_max_bytes

        check_cuda_graphs_option(self.cuda_graphs)
        keep_max_bytes(self.keep_max_gib)
        budget_bytes(self.memory_budget_gib, free_bytes=0)
        host_budget_bytes(self.host_budget_gib, available=0)
        if self.activation_offload and self.cuda_graphs is False:
            raise ValueError("strategy.activation_offload=true needs strategy.cuda_graphs=true (the graphed layers offload their inputs)")
        if self.activation_offload and self.cuda_graphs == "auto" and no_cuda:
            raise ValueError(f"strategy.activation_offload=true needs CUDA graphs, which strategy.cuda_graphs=auto leaves off "
                             f"without a CUDA device ({no_cuda}): set strategy.activation_offload=false{hint}")
        if self.cuda_graphs is True and no_cuda:
            keys = "strategy.cuda_graphs=false" + (" strategy.activation_offload=false" if self.activation_offload else "")
            raise ValueError(f"strategy.cuda_graphs=true needs a CUDA device ({no_cuda}): set {keys}{hint}; the GPU model "
                             "configs set it (e.g. model=gpt_oss_20b), their *_tiny twins run on the CPU")
        if self.fp8_lm_head and not self.fp8:
            raise ValueError("strategy.fp8_lm_head=true holds the lm_head in e4m3 as strategy.fp8 does the LoRA base weights: "
                             "set strategy.fp8=true too, or strategy.fp8_lm_head=false")
        if self.fp8 and no_cuda:
            raise ValueError(
                f"strategy.fp8=true needs an NVIDIA GPU of compute capability 9.0 or newer (Hopper, sm90+); found none "
                f"({no_cuda}): set strategy.fp8=false{hint}"
            )

    def non_default(self) -> list[str]:
        """``strategy.<key>=<value>`` for each option away from its default."""
        default = asdict(Execution())
        return [f"strategy.{k}={v}" for k, v in asdict(self).items() if v != default[k]]


def check_cuda_graphs_option(value: Any) -> None:
    """Raise ValueError naming ``strategy.cuda_graphs`` and its choices where ``value`` is neither True, False nor
    ``auto`` (YAML's ``true``/``false`` are bools; any other string, or a number, is refused)."""
    if not (isinstance(value, bool) or value == "auto"):
        raise ValueError(f"strategy.cuda_graphs={value!r}: expected one of true, false, auto (auto: CUDA graphs where the "
                         "run allows them, else eager)")


#: ``host_budget_gib=auto``: the host's available memory less this share of it (the data loader, Python, the OS)
HOST_MARGIN = 0.25


def host_budget_bytes(host_budget_gib: Any, available: int, processes: int = 1) -> int | None:
    """``strategy.host_budget_gib`` in bytes.

    Args:
        host_budget_gib: a number of GiB >= 0, ``auto`` (``available`` less `HOST_MARGIN` of it, over ``processes``)
            or None (no limit).
        available: the host's available memory (`lightning_ft.strategies.profiler.available_host_bytes`), for ``auto``.
        processes: the processes of this node that offload (each gets its share of ``auto``).

    Raises:
        ValueError: anything else, naming the key.
    """
    if host_budget_gib is None:
        return None
    if host_budget_gib == "auto":
        return int(available * (1 - HOST_MARGIN) / max(processes, 1))
    if isinstance(host_budget_gib, bool) or not isinstance(host_budget_gib, (int, float)) or not host_budget_gib >= 0:
        raise ValueError(f"strategy.host_budget_gib={host_budget_gib!r}: expected a number of GiB >= 0, auto, or null for no limit")
    return int(host_budget_gib * GIB)


class ExecutionMixin:
    """Mixed into a Lightning strategy (first among the bases): holds the run's `Execution` and makes the memory plan.

    Args:
        execution: the options (default: `Execution`'s defaults).
        args, kwargs: the Lightning strategy's own arguments.

    Attributes:
        profiler: measures what the plan needs (`lightning_ft.strategies.profiler.StepProfiler`; tests put a fake one here).
        memory_plan: the plan in use (`apply_memory_plan`), for the log and summary.json; None: no plan.
    """

    def __init__(self, *args: Any, execution: Execution | None = None, **kwargs: Any):
        from lightning_ft.strategies.profiler import StepProfiler

        super().__init__(*args, **kwargs)
        self.execution = execution if execution is not None else Execution()
        self.memory_plan: Plan | None = None
        self.profiler = StepProfiler()
        self._planned = False  # `plan_memory` ran (once per fit)

    def memory_budget(self, device: torch.device) -> int | None:
        """``strategy.memory_budget_gib`` in bytes on ``device`` (`lightning_ft.strategies.planner.budget_bytes`;
        ``auto``: the memory this process could use now, `StepProfiler.free_bytes`, less the margin); None where the
        profiler has no figure (off CUDA: no plan there) or with no budget."""
        free = self.profiler.free_bytes(device)
        if free is None or self.execution.memory_budget_gib is None:
            return None
        return budget_bytes(self.execution.memory_budget_gib, free)

    def host_budget(self) -> int | None:
        """``strategy.host_budget_gib`` in bytes (`host_budget_bytes`; ``auto`` from `StepProfiler.free_host_bytes`,
        shared by this node's processes); None: no limit."""
        if self.execution.host_budget_gib is None:
            return None
        processes = getattr(self, "num_processes", 1)  # DDP and FSDP2: this node's devices
        return host_budget_bytes(self.execution.host_budget_gib, self.profiler.free_host_bytes(), processes)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Lightning's hook: at the run's first training batch, `plan_memory` (before any CUDA graph is recorded)."""
        super().on_train_batch_start(batch, batch_idx)
        if not self._planned:
            self._planned = True
            self.plan_memory(self.lightning_module, batch)

    def plan_memory(self, module: Any, batch: Any) -> Plan | None:
        """Measure ``module``'s graphed decoder layers on ``batch`` (``profiler``), make the memory plan within
        `memory_budget` and `host_budget` (`lightning_ft.strategies.planner.plan`) and `apply_memory_plan` it.

        The options constrain the plan: ``strategy.keep_attention=false`` (``keep_projections``) leaves that class
        (those two: ``projections`` and ``mlp``) out (recomputed), ``strategy.activation_offload=true`` offloads every layer input (but the last layer's).
        No plan (None) where there is no budget (off CUDA, ``strategy.memory_budget_gib=null``) or the layers are
        not graphed (``strategy.cuda_graphs=false``, FSDP2; logged). The fallbacks of the host budget are logged
        once each, and a plan that does not fit the budget is a warning (the leanest plan is used).
        """
        from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

        from lightning_ft.strategies.cuda_graphs import graphed_layers
        from lightning_ft.strategies.kept import KINDS, kinds_allowed

        budget = self.memory_budget(batch.input_ids.device)
        if budget is None:
            return None
        layers = graphed_layers(module.model)
        if not layers:
            rank_zero_info("memory plan: none (it drives the CUDA-graphed layers: strategy.cuda_graphs=true, not under fsdp2)")
            return None
        options = kinds_allowed(self.execution.keep_attention, self.execution.keep_projections)
        kinds = tuple(kind for kind in KINDS if options[kind])
        context = getattr(getattr(self, "precision_plugin", None), "train_step_context", None)
        measured = self.profiler.measure(module, batch, layers, kinds, context)
        for reason in measured.fallbacks:
            rank_zero_info(f"memory plan: {reason}")
        if self.execution.activation_offload:  # asked for: every layer input offloaded (the last one's stays)
            offload = lambda c: replace(c, actions=("offload",)) if c.name == "input" else c  # noqa: E731
            measured = replace(measured, layers=tuple(replace(p, saved=tuple(map(offload, p.saved))) for p in measured.layers))
        made = plan(measured.layers, budget, measured.base_bytes, measured.bandwidth, measured.other_s, host_budget=self.host_budget())
        made = self.broadcast(made)  # several processes: rank zero's plan for all (their timings differ a little)
        for reason in made.fallbacks:
            rank_zero_info(f"memory plan: {reason}")
        if not made.fits:
            rank_zero_warn(
                f"memory plan: even keeping nothing and offloading every layer input the predicted peak, "
                f"{made.peak_bytes / GIB:.2f} GiB, is above strategy.memory_budget_gib ({budget / GIB:.2f} GiB): "
                "training with the leanest plan; raise the budget or shorten data.max_tokens"
            )
        self.apply_memory_plan(module.model, made)
        return made

    def apply_memory_plan(self, model: torch.nn.Module, plan: Plan) -> None:
        """Use ``plan`` for ``model``'s graphed layers (`lightning_ft.strategies.cuda_graphs.apply_memory_plan`)
        and log it as a table (rank zero); summary.json reports its predicted peak beside the measured one."""
        from lightning.pytorch.utilities import rank_zero_info
        from rich.console import Console

        from lightning_ft.strategies.cuda_graphs import apply_memory_plan

        apply_memory_plan(model, plan)
        self.memory_plan = plan
        console = Console(width=120, record=True, file=io.StringIO())
        console.print(plan.table())
        rank_zero_info("memory plan:\n" + console.export_text().rstrip())


class SingleDeviceStrategy(ExecutionMixin, LightningSingleDeviceStrategy):
    """Lightning's `SingleDeviceStrategy` with the run's `Execution`, on the one device of ``trainer.devices``.

    Args:
        execution: the options.
        device: the device; None: the one Lightning's accelerator connector picks from
            ``trainer.accelerator`` and ``trainer.devices`` (through `parallel_devices`).
        kwargs: other `SingleDeviceStrategy` arguments.

    Raises:
        ValueError: (when the Trainer is built) ``trainer.devices`` names several devices.
    """

    def __init__(self, execution: Execution | None = None, device: Any = None, **kwargs: Any):
        super().__init__(execution=execution, device=device if device is not None else "cpu", **kwargs)
        self._device_chosen = device is not None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The device, once chosen (Lightning's connector reads this and sets it when it is empty)."""
        return [self.root_device] if self._device_chosen else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device]) -> None:
        if len(devices) != 1:
            raise ValueError(
                f"trainer.devices: {len(devices)} devices ({', '.join(map(str, devices))}) for one process; set "
                "trainer.devices=1, or trainer.devices=N with strategy=ddp or strategy=fsdp2"
            )
        self._root_device, self._device_chosen = torch.device(devices[0]), True


def make_strategy(name: Any, execution: Execution, processes: int) -> Any:
    """The Lightning strategy ``fit`` trains with: ``trainer.strategy`` with the run's ``execution``.

    Args:
        name: ``trainer.strategy``: ``auto`` (ours on one device: `SingleDeviceStrategy`; several:
            DDP, `lightning_ft.strategies.ddp`), a registry name, or a `Strategy` object (kept).
        execution: the ``strategy`` options.
        processes: the processes ``trainer.devices`` × ``trainer.num_nodes`` asks for (0: Lightning decides).

    Returns:
        A strategy object for a lightning_ft registry name (or ``auto``), else ``name`` unchanged.

    Raises:
        ValueError: options away from their defaults with a strategy that is not lightning_ft's.
    """
    from lightning_ft.strategies.ddp import STRATEGY_NAME as DDP_STRATEGY

    if isinstance(name, Strategy):
        return name
    if name in (None, "auto"):
        name = DDP_STRATEGY if processes > 1 else STRATEGY_NAME
    entry = StrategyRegistry[name] if name in StrategyRegistry else None
    if entry is not None and issubclass(entry["strategy"], ExecutionMixin):
        return entry["strategy"](execution=execution, **entry["init_params"])
    if changed := execution.non_default():
        raise ValueError(
            f"{' '.join(changed)}: these need a lightning_ft strategy (trainer.strategy=auto, or strategy=ddp | fsdp2), "
            f"not trainer.strategy={name}"
        )
    return name


StrategyRegistry.register(
    STRATEGY_NAME, SingleDeviceStrategy, description="One device, with lightning_ft's execution options"
)
