"""End of a run: export the adapter, write ``summary.json`` and plot the loss curve (rank 0 only)."""

from __future__ import annotations

import logging
import math
import os
import resource
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_ft.atomic import atomic_file, atomic_folder, out_of_space, recover_folder, write_json_atomic
from lightning_ft.callbacks.throughput import TokenThroughput
from lightning_ft.errors import SigtermBeforeTraining, TrainingStopped
from lightning_ft.strategies.cuda_graphs import cuda_graph_stats
from lightning_ft.strategies.fsdp2 import gather_state_dict
from lightning_ft.strategies.kept import KINDS

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"  # the run's config as composed (unresolved), for a resume to compare with


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """Peak memory of this process: allocated on the CUDA device, else the resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"


def allocator_settings() -> dict[str, str]:
    """The PyTorch allocator variables of this process's environment (``PYTORCH_*ALLOC_CONF``):
    they move the reserved-memory figures (the CLI sets ``expandable_segments:True`` by default)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("PYTORCH_") and k.endswith("ALLOC_CONF")}


def loss_curve_figure(
    losses: list[float | None],
    val_losses: list[tuple[int, float]] = (),
    learning_rates: list[float] = (),
    title: str = "training loss",
) -> Any:
    """A matplotlib figure of the run: the training loss of every optimizer step (None: a skipped step, left as
    a gap) with the validation loss as a point at each validation's step, and below it (where given) the
    learning rate of every step.

    Args:
        losses: per optimizer step, nats per target token.
        val_losses: ``(optimizer step, loss)`` of each validation.
        learning_rates: the learning rate of each optimizer step (the first parameter group's).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if learning_rates else 1
    fig, axes = plt.subplots(panels, 1, figsize=(6, 3.5 + 1.5 * (panels - 1)), dpi=120, sharex=True, squeeze=False,
                             height_ratios=[2.5, 1][:panels])
    ax = axes[0, 0]
    ax.plot(range(1, len(losses) + 1), [float("nan") if x is None else x for x in losses], lw=1.2, label="train")
    if val_losses:
        steps, values = zip(*val_losses)
        ax.plot(steps, values, "o", ms=4, label="validation")
        ax.legend()
    ax.set_ylabel("loss (nats / target token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if learning_rates:
        lr_ax = axes[1, 0]
        lr_ax.plot(range(1, len(learning_rates) + 1), learning_rates, lw=1.2, color="tab:gray")
        lr_ax.set_ylabel("learning rate")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        lr_ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    fig.tight_layout()
    return fig


def plot_loss_curve(
    losses: list[float | None], path: Path, val_losses: list[tuple[int, float]] = (), learning_rates: list[float] = ()
) -> None:
    """Save `loss_curve_figure` as a PNG at ``path``, whole or not at all."""
    import matplotlib.pyplot as plt

    fig = loss_curve_figure(losses, val_losses, learning_rates)
    with atomic_file(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def result_line(summary: dict[str, Any]) -> str:
    """The run's outcome in one line for the terminal, from a ``summary.json`` dict: first and last training
    loss, the last validation loss, tokens trained and tokens/s, and the data's packing efficiency (tokens of
    the packed documents over the packed rows' capacity, ``data.max_tokens`` each; ``PackingStats``). A run
    that did not complete says so first (``failed after 0 steps``); the packing efficiency is left out when no
    row was packed (the data did not load)."""
    status = summary["status"]
    steps = _steps(summary["steps"])
    parts = [steps if status == "completed" else f"{status} after {steps}"]
    if summary["final_loss"] is not None:
        parts.append(f"loss {summary['initial_loss']:.3f} → {summary['final_loss']:.3f}")
    if summary["val_loss"] is not None:
        parts.append(f"val loss {summary['val_loss']:.3f}")
    if summary["train_tokens"]:
        parts.append(f"{summary['train_tokens']:,} tokens at {summary['tokens_per_s']:,.0f} tokens/s")
    if summary["data"] and summary["data"]["packed_rows"]:
        parts.append(f"packing efficiency {100 * summary['data']['packing_efficiency']:.1f}% (tokens / rows × data.max_tokens)")
    return "; ".join(parts)


def offload_copies(graphs: dict[str, Any] | None, steps: int, plan: Any = None) -> dict[str, float | None] | None:
    """How activation offloading's copies went (`lightning_ft.strategies.offload.ActivationOffload.stats`, in
    ``graphs``: `cuda_graph_stats`), for summary.json and the log: the achieved bandwidth of the copies to the host
    and back, ``copy_d2h_gbps`` and ``copy_h2d_gbps`` (GB/s, 1e9 bytes per second), beside the ceiling the memory
    plan measured, ``ceiling_d2h_gbps`` and ``ceiling_h2d_gbps`` (``plan.bandwidth``; None without a plan), and
    ``compute_wait_ms_per_step``: what the compute stream stalled on copies per optimizer step (ms; 0: the copies
    were hidden under compute), over the ``steps`` run. None where nothing was offloaded; the timings are None off
    CUDA (nothing timed)."""
    if not graphs or "offloaded_inputs" not in graphs:
        return None
    bandwidth = getattr(plan, "bandwidth", None)
    wait_ms = graphs["compute_wait_ms"]
    return {
        "copy_d2h_gbps": graphs["copy_d2h_gbps"],
        "copy_h2d_gbps": graphs["copy_h2d_gbps"],
        "ceiling_d2h_gbps": bandwidth.device_to_host / 1e9 if bandwidth is not None else None,
        "ceiling_h2d_gbps": bandwidth.host_to_device / 1e9 if bandwidth is not None else None,
        "compute_wait_ms_per_step": wait_ms / steps if wait_ms is not None and steps else None,
    }


def offload_line(graphs: dict[str, Any], copies: dict[str, float | None]) -> str:
    """The log's line on activation offloading: what waited in host memory (``graphs``, `cuda_graph_stats`) and
    how the copies went (`offload_copies`)."""
    line = (
        f"activation offloading: {graphs['offloaded_inputs']} layer inputs and {graphs['offloaded_kept']} layer calls' "
        f"kept activations ({graphs['offloaded_bytes'] / 2**30:.2f} GiB in all) waited in host memory for the backward; "
        f"{graphs['prefetched_loads']} of the inputs' reloads were prefetched"
    )
    if copies["copy_d2h_gbps"] is None and copies["compute_wait_ms_per_step"] is None:
        return line + "; copy times not measured (off CUDA)"

    def gbps(key: str) -> str:
        return "n/a" if copies[key] is None else f"{copies[key]:.1f} GB/s"

    ceiling = "" if copies["ceiling_d2h_gbps"] is None else (
        f" (measured ceiling {gbps('ceiling_d2h_gbps')} and {gbps('ceiling_h2d_gbps')})"
    )
    wait = copies["compute_wait_ms_per_step"]
    return (
        f"{line}; copies to the host at {gbps('copy_d2h_gbps')} and back at {gbps('copy_h2d_gbps')}{ceiling}; "
        f"the compute stream waited {'n/a' if wait is None else f'{wait:.2f}'} ms per step on copies (0: all hidden "
        "under compute)"
    )


def _steps(count: int) -> str:
    """``1 step``, ``2 steps``."""
    return f"{count} step{'' if count == 1 else 's'}"


def planned_steps(trainer: L.Trainer) -> str:
    """How many optimizer steps the run takes and what bounds them (``trainer.max_epochs`` or ``trainer.max_steps``),
    from Lightning's ``estimated_stepping_batches``; after the data is set up (``on_train_start``)."""
    per_epoch = math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches)
    total = trainer.estimated_stepping_batches
    if math.isinf(total):
        return "no bound: set trainer.max_epochs or trainer.max_steps"
    if trainer.max_steps >= 0 and trainer.max_steps == total:
        bound = f"trainer.max_steps={trainer.max_steps}; an epoch is {_steps(per_epoch)}"
    else:
        bound = f"trainer.max_epochs={trainer.max_epochs} of {_steps(per_epoch)}; trainer.max_steps=N stops after N"
    resumed = f", resumed at step {trainer.global_step}" if trainer.global_step else ""
    return f"{int(total)} optimizer step{'' if total == 1 else 's'} ({bound}){resumed}"


def _save_inference_configs(model: torch.nn.Module, tokenizer: Any, folder: Path) -> None:
    """Over the configs ``save_pretrained`` wrote to ``folder``: copies of the model's with
    `lightning_ft.export.inference_settings` (the KV cache on, the special tokens), so the folder generates as
    the merged export does; the training model keeps its own."""
    import copy

    from lightning_ft.export import inference_settings

    config, generation = copy.deepcopy(model.config), copy.deepcopy(getattr(model, "generation_config", None))
    inference_settings(config, generation, tokenizer)
    config.save_pretrained(folder)
    if generation is not None:
        generation.save_pretrained(folder)


def planned_validation(trainer: L.Trainer) -> str | None:
    """How many packed rows each validation runs and when (``eval.limit_batches``, ``eval.every_n_steps``), from the
    `lightning_ft.data.datamodule.PackedDataModule`'s validation rows; None without validation data."""
    stats = getattr(getattr(trainer, "datamodule", None), "stats", None)
    if stats is None or not stats.val_rows or trainer.limit_val_batches == 0:
        return None
    per_process = -(-stats.val_rows // trainer.world_size)
    limit = trainer.limit_val_batches
    rows = min(limit, per_process) if isinstance(limit, int) else math.ceil(per_process * limit)
    shown = f"{rows} of {per_process} packed rows" if rows < per_process else f"{rows} packed rows"
    if trainer.world_size > 1:
        shown += " on each process"
    every = trainer.check_val_every_n_epoch
    if every is None:
        steps = int(trainer.val_check_interval) // trainer.accumulate_grad_batches
        when = f"after every {_steps(steps)} and the last"
    else:
        when = "at each epoch's end and after the last step" if every == 1 else f"at the end of every {every} epochs"
    cap = "; eval.limit_batches=N runs the first N" if isinstance(limit, float) and limit == 1.0 else ""
    return f"{shown} {when}{cap}"


class RunSummary(L.Callback):
    """Writes the run's results into ``run_dir`` when training ends (or stops on an error).

    - ``adapter/``: the PEFT adapter (``save_pretrained``; loads with ``PeftModel.from_pretrained``)
      or, for full fine-tuning, the whole model; plus the tokenizer. Not written when training
      stopped on an error. Under FSDP2 the weights are first gathered to rank 0, which writes them.
      Written into ``adapter.tmp/`` and swapped in whole (`lightning_ft.atomic.atomic_folder`): a
      crash or a full disk leaves the previous ``adapter/`` (if any) as it was.
    - ``summary.json``: ``status`` (``completed``; ``stopped`` by SIGTERM, Ctrl-C, one of our checks
      (`TrainingStopped`) or a write that found no room (`lightning_ft.atomic.out_of_space`); ``failed``
      on any other error; the last two with ``error``),
      ``initial_loss``, ``final_loss`` (first and last optimizer step that was not skipped),
      ``step_losses`` (every optimizer step; null for a skipped one), ``skipped_steps``
      (``no_target_tokens``, ``nonfinite``), ``steps``, ``train_tokens``, ``tokens_per_s``,
      ``peak_memory_bytes`` (on CUDA also split into ``peak_memory_setup_bytes``, building and
      sharding the model, and ``peak_memory_train_bytes``), ``predicted_peak_memory_bytes`` and
      ``memory_plan`` (with a memory plan, `lightning_ft.strategies.planner.Plan.summary`; else null),
      ``adapter_dir``, ``checkpoint_path``,
      ``val_loss``, ``val_perplexity``, ``val_exact_match`` (with ``eval.generate``; the last
      validation's), ``val_losses`` (``[optimizer step, loss]`` of every validation),
      ``learning_rates`` (every optimizer step's, the first parameter group's), the data
      statistics (``data``: examples, truncated, dropped, ``packing_efficiency``: the packed
      documents' tokens over the rows' capacity, ``data.max_tokens`` each, ...), ``cuda_graphs``
      (with the layers graphed, ``strategy.cuda_graphs`` true or ``auto`` resolved on: layer calls replayed from graphs and run eagerly, signatures
      recorded, attention outputs and attention's and the MLP's projection outputs kept; `lightning_ft.strategies.cuda_graphs.cuda_graph_stats`),
      ``offload_copies`` (with activation offloading: the copies' achieved bandwidth against the memory plan's
      measured one and the compute stream's wait on them per step; `offload_copies`; else null),
      ``world_size`` (``tokens_per_s`` counts every rank's tokens; the peaks are rank 0's), ``device``,
      ``allocator`` (`allocator_settings`) and the resolved ``config``.
    - ``loss_curve.png``: training loss, validation points and learning rate (`loss_curve_figure`).

    The outcome is also logged in one line (`result_line`): losses, tokens/s and packing efficiency.

    - ``config.json`` (``run_config``), when training starts (after the checkpoint of a resume is
      restored).

    Each file is written whole or not at all (`lightning_ft.atomic`), ``summary.json`` last: a
    ``completed`` summary says the adapter and the plot are there. On an error a summary that cannot
    be written (a full disk) is logged, not raised over the error.

    A resume of a run whose training finished but whose export did not (killed while writing the
    adapter) trains nothing: Lightning then calls no ``on_train_*`` hook, and the export is done in
    ``on_fit_end`` from the restored checkpoint (``tokens_per_s`` and the peaks are then unknown).

    A resumed run that fails before training starts (a checkpoint that does not load) leaves the
    interrupted run's ``summary.json`` and ``config.json`` as they were: the error is the CLI's message.

    Args:
        run_dir: the Hydra run directory.
        config: the resolved config, stored in summary.json.
        resuming: this run resumes from a checkpoint (``ckpt_path``).
        run_config: the config as composed (unresolved), written to ``config.json``.
    """

    def __init__(
        self,
        run_dir: str | Path,
        config: dict[str, Any] | None = None,
        resuming: bool = False,
        run_config: dict[str, Any] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.config = config or {}
        self.resuming = resuming
        self.run_config = run_config
        self.summary: dict[str, Any] = {}
        self._setup_peak: int | None = None
        self._started = False
        self.val_losses: list[tuple[int, float]] = []  # (optimizer step, loss) of each validation
        self.learning_rates: list[float] = []  # of each optimizer step, the first parameter group's

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"val_losses": list(self.val_losses), "learning_rates": list(self.learning_rates)}  # a resume keeps the curves

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.val_losses = [tuple(v) for v in state_dict.get("val_losses", [])]
        self.learning_rates = list(state_dict.get("learning_rates", []))

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self.learning_rates.append(float(optimizer.param_groups[0]["lr"]))

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.state.fn == "fit" and not trainer.sanity_checking and loss is not None:
            self.val_losses.append((trainer.global_step, float(loss)))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._started = True
        if trainer.is_global_zero:
            log.info("training: %s", planned_steps(trainer))
            if (validation := planned_validation(trainer)) is not None:
                log.info("validation: %s", validation)
            if self.run_config is not None:
                write_json_atomic(self.run_dir / CONFIG_FILE, self.run_config)
        if pl_module.device.type == "cuda":  # the peak of building (and sharding) the model, apart from training's
            self._setup_peak = torch.cuda.max_memory_allocated(pl_module.device)
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # before teardown, which moves the model back to the CPU (tens of GB for big models).
        # Lightning runs checkpoint callbacks last, so let them write last.ckpt now (their own
        # on_train_end then finds it saved) and the summary can name it.
        for callback in trainer.checkpoint_callbacks:
            callback.on_train_end(trainer, pl_module)
        # FSDP2: every rank takes part in gathering the adapter (or, without LoRA, every weight) to rank 0
        gathered = gather_state_dict(pl_module.model, trainable_only=hasattr(pl_module.model, "peft_config"))
        self._write(trainer, pl_module, state_dict=gathered)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._started or trainer.global_step == 0:
            return
        # a resume from a checkpoint whose training was done: Lightning ran no batch and no on_train_* hook
        log.info("training was finished at step %d: exporting the adapter and the summary", trainer.global_step)
        self._write(trainer, pl_module, state_dict=gather_state_dict(pl_module.model, trainable_only=hasattr(pl_module.model, "peft_config")))

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if trainer.state.fn != "fit":
            return
        if self.resuming and not self._started and (self.run_dir / "summary.json").exists():
            log.info("the run stopped before training resumed: %s is left as it was", self.run_dir / "summary.json")
            return
        # as in on_train_end: checkpoint callbacks run last, so let them save now (StepCheckpoint does on
        # SIGTERM; the others return) and the summary names the checkpoint to resume from
        for callback in trainer.checkpoint_callbacks:
            callback.on_exception(trainer, pl_module, exception)
        self._write(trainer, pl_module, exception)

    @rank_zero_only
    def _write(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        error: BaseException | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        adapter_dir = self.run_dir / "adapter"
        datamodule = trainer.datamodule
        if error is None:
            with atomic_folder(adapter_dir) as tmp:
                # state_dict: the full weights gathered from FSDP2 shards (None: the model's own)
                model = pl_module.model
                model.save_pretrained(tmp, **({} if state_dict is None else {"state_dict": state_dict}))
                tokenizer = getattr(datamodule, "tokenizer", None) if datamodule is not None else None
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                if tokenizer is not None and not hasattr(model, "peft_config"):  # lora=none: the whole model, to serve
                    _save_inference_configs(model, tokenizer, tmp)
        else:
            recover_folder(adapter_dir)  # an export a crash interrupted: the previous adapter back in place
        throughput = next((c for c in trainer.callbacks if isinstance(c, TokenThroughput)), None)
        losses = pl_module.step_losses
        trained = [x for x in losses if x is not None]
        peak, peak_kind = peak_memory_bytes(pl_module.device)
        train_peak = peak if self._setup_peak is not None else None
        peak = max(peak, self._setup_peak or 0)
        ckpt = trainer.checkpoint_callback
        metrics = trainer.callback_metrics
        plan = getattr(trainer.strategy, "memory_plan", None)  # lightning_ft.strategies.strategy.ExecutionMixin
        self.summary = {
            "status": _status(error),
            "error": None if error is None else _describe(error),
            "initial_loss": trained[0] if trained else None,
            "final_loss": trained[-1] if trained else None,
            "step_losses": losses,
            "skipped_steps": dict(getattr(pl_module, "skipped_steps", {})),
            # optimizer steps run (skipped ones too); not global_step, which also counts a
            # non-finite step that stopped training after its (skipped) update was queued
            "steps": len(losses),
            "train_tokens": throughput.train_tokens if throughput else None,
            "tokens_per_s": throughput.tokens_per_s if throughput else None,
            "peak_memory_bytes": peak,
            "peak_memory_setup_bytes": self._setup_peak,
            "peak_memory_train_bytes": train_peak,
            "peak_memory_kind": peak_kind,
            # the memory plan's prediction of the training peak (None: no plan), beside the measured one above
            "predicted_peak_memory_bytes": plan.peak_bytes if plan is not None else None,
            "memory_plan": plan.summary() if plan is not None else None,
            "adapter_dir": str(adapter_dir) if error is None else None,
            "checkpoint_path": _written_checkpoint(ckpt),
            "val_loss": _float(metrics.get("val/loss")),
            "val_losses": [list(v) for v in self.val_losses],
            "learning_rates": list(self.learning_rates),
            "val_perplexity": _float(metrics.get("val/perplexity")),
            "val_exact_match": _float(metrics.get("val/exact_match")),
            "data": asdict(datamodule.stats) if datamodule is not None and hasattr(datamodule, "stats") else None,
            "cuda_graphs": cuda_graph_stats(pl_module.model) if getattr(pl_module, "model", None) is not None else None,
            "offload_copies": None,
            "world_size": trainer.world_size,
            "device": str(pl_module.device),
            "allocator": allocator_settings(),
            "config": self.config,
        }
        graphs = self.summary["cuda_graphs"]
        self.summary["offload_copies"] = offload_copies(graphs, len(losses), plan)
        if graphs and (calls := graphs["replayed_layer_calls"] + graphs["eager_layer_calls"]):
            log.info(
                "cuda graphs: %.0f%% of %d layer calls replayed from graphs (%d input signatures recorded; "
                "rows of new shapes run eagerly); %d layer recordings keep attention's outputs (%.2f GiB), %d "
                "attention's projection outputs (%.2f GiB), %d the MLP's (%.2f GiB)",
                100 * graphs["replayed_layer_calls"] / calls, calls, graphs["signatures"],
                *(graphs[f"kept_{kind}_{what}"] / (2**30 if what == "bytes" else 1) for kind in KINDS for what in ("recordings", "bytes")),
            )
        if self.summary["offload_copies"] is not None:
            log.info("%s", offload_line(graphs, self.summary["offload_copies"]))
        if error is not None:  # a full disk must not hide the error that stopped the run
            try:
                self._write_files(losses)
            except OSError as err:
                log.warning("could not write the run's summary: %s", err)
            return
        self._write_files(losses)

    def _write_files(self, losses: list[float | None]) -> None:
        if losses:
            plot_loss_curve(losses, self.run_dir / "loss_curve.png", self.val_losses, self.learning_rates)
        write_json_atomic(self.run_dir / "summary.json", self.summary)  # last: a completed summary means all is there
        log.info("result: %s", result_line(self.summary))
        log.info("summary: %s", self.run_dir / "summary.json")
        if self.summary.get("status") == "completed":
            log.info("next: %s", export_hint(self.run_dir, (self.summary.get("config") or {}).get("lora", {}).get("enabled", True)))


def export_hint(run_dir: Path, lora: bool) -> str:
    """The export command of a finished run, its path quoted for the shell where it must be: a LoRA run's adapter (or
    with ``--merge`` a merged model), a full fine-tuning run's model (``--merge``)."""
    if lora:
        return f"{shlex.join(['python', '-m', 'lightning_ft', 'export', str(run_dir)])} [--merge] (the adapter, or a merged " \
            "model that serves, in its export/ folder)"
    return f"{shlex.join(['python', '-m', 'lightning_ft', 'export', str(run_dir), '--merge'])} (the trained model, " \
        "which serves, in its export/ folder)"


def _status(error: BaseException | None) -> str:
    if error is None:
        return "completed"
    stopped = isinstance(error, (KeyboardInterrupt, SIGTERMException, TrainingStopped)) or out_of_space(error) is not None
    return "stopped" if stopped else "failed"


def _describe(error: BaseException) -> str:
    if isinstance(error, SigtermBeforeTraining):
        return "SIGTERM: stopped before training started"
    if isinstance(error, KeyboardInterrupt):
        return "KeyboardInterrupt: stopped by Ctrl-C (SIGINT)"
    if isinstance(error, SIGTERMException):  # Lightning's, raised with no message
        return "SIGTERM: stopped at the end of a step"
    return f"{type(error).__name__}: {error}"


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _written_checkpoint(ckpt: Any) -> str | None:
    """The checkpoint callback's last (else best) checkpoint that exists: a write that failed (a full disk) leaves the
    path it was writing named in the callback, and none there; None where no checkpoint was written."""
    if ckpt is None:
        return None
    return next((p for p in (ckpt.last_model_path, ckpt.best_model_path) if p and get_filesystem(p).exists(p)), None)
