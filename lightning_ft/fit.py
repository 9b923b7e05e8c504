"""The main job: build data, model, callbacks and a Lightning Trainer from a composed config, then fit."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import signal
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import get_object, instantiate
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException
from omegaconf import DictConfig, OmegaConf

from lightning_ft.atomic import out_of_space
from lightning_ft.callbacks.generation_eval import GenerationEval
from lightning_ft.callbacks.hydra_record import HydraRecord
from lightning_ft.callbacks.resumed_metrics import ResumedMetrics
from lightning_ft.callbacks.sigterm import SigtermAtStepEnd
from lightning_ft.callbacks.summary import RunSummary
from lightning_ft.config import trainer_key_hint, unknown_schema_keys
from lightning_ft.data.datamodule import OVERFLOWS, PackedDataModule
from lightning_ft.data.formats import FORMATS, check_data_path
from lightning_ft.data.tokenization import load_tokenizer
from lightning_ft.device import model_type_of
from lightning_ft.errors import (
    MEMORY_HINT,
    Interrupted,
    SigtermBeforeTraining,
    TrainingStopped,
    check_choice,
    check_local_path,
    check_logger_installed,
    out_of_memory,
)
from lightning_ft.kernels.moe.experts import BACKENDS as EXPERT_BACKENDS, QUANTISED_EXPERT_BACKENDS
from lightning_ft.model.attention import BACKENDS as ATTENTION_BACKENDS
from lightning_ft.model.build import DTYPES, INITS, ModelBuilder, check_model_folder
from lightning_ft.model.lora import adapter_folder
from lightning_ft.model.moe import check_chunk_tokens
from lightning_ft.model.mxfp4 import no_mxfp4_experts
from lightning_ft.model.quantization import QUANTIZATIONS, check_quantized_training
from lightning_ft.module import ON_NONFINITE, FinetuneModule
from lightning_ft.run_dir import (
    absolute_local_paths,
    check_checkpoint_readable,
    check_new_run_dir,
    check_resume_dir,
    check_resumed_config,
    checkpoint_dirs,
    checkpoint_file,
    exported,
    finished_at,
    first_process,
    keep_previous_metrics,
    last_checkpoint,
    restore_failure,
    run_dir_lock,
    stopped_message,
)
from lightning_ft.strategies.checkpoint_io import AtomicCheckpointIO, remove_partial_checkpoints
from lightning_ft.strategies.ddp import STRATEGY_NAME as DDP_STRATEGY  # registers it with Lightning
import lightning_ft.strategies.fsdp2  # noqa: F401  registers trainer.strategy=fsdp2 with Lightning
from lightning_ft.strategies.strategy import Execution, make_strategy

log = logging.getLogger(__name__)

#: config keys with a fixed set of values → those values; `_check_option_values` refuses any other before
#: anything loads (the modules that read them check again with the same `check_choice`)
CHOICES = {
    "model.init": INITS,
    "model.dtype": tuple(DTYPES),
    "model.attention": ATTENTION_BACKENDS,
    "model.quantization": QUANTIZATIONS,
    "data.format": ("auto", *FORMATS),
    "data.overflow": OVERFLOWS,
    "moe.backend": ("hf", "auto", *EXPERT_BACKENDS),
    "train.on_nonfinite": ON_NONFINITE,
}
_INT_TRAINER_KEYS = (
    "max_steps", "min_steps", "max_epochs", "min_epochs", "accumulate_grad_batches", "log_every_n_steps",
    "num_nodes", "num_sanity_val_steps",
)


def fit(cfg: DictConfig, sigterm: SigtermAtStepEnd | None = None) -> dict[str, Any]:
    """Fine-tune as ``cfg`` says; returns the run summary (also written to ``run_dir/summary.json``).

    Validation (``data.val_fraction`` or ``data.val_path``) runs every ``eval.every_n_steps``
    optimizer steps (default: at every epoch end) and once more after the last step, over all validation rows
    or the first ``eval.limit_batches``.

    Raises:
        ValueError: no tokenizer can be named (neither ``model.tokenizer`` nor ``model.name_or_path``),
            strategy options that need a GPU or each other (`Execution.check`) or a lightning_ft strategy
            (`make_strategy`),
            ``eval.generate`` without validation data or with ``strategy=fsdp2``, ``ckpt_path=last``
            with no last checkpoint or in a folder this run created (`check_resume_dir`), a ``trainer.`` value of
            the wrong type or ``trainer.max_steps=0``,
            or a new run (no ``ckpt_path``) in a folder that holds a run already.
        FileNotFoundError: the tokenizer, a data file or ``ckpt_path`` cannot be found.
        ModuleNotFoundError: the logger's package is not installed (`check_logger_installed`).

    Nothing is written into ``run_dir`` before every check that can be made without the model has
    passed: a refused run leaves the folder (a finished run's files too) as it was. Hydra's record
    (``.hydra/``) is written at once only where the folder has none, otherwise when training starts
    (`HydraRecord`). A resume of a run whose checkpoint has reached ``trainer.max_steps`` or
    ``trainer.max_epochs`` (`finished_at`) trains nothing, writes nothing and returns the run's
    ``summary.json`` (logged as a warning).

    From the first check until training starts a SIGTERM raises `lightning_ft.errors.SigtermBeforeTraining`
    (``sigterm``'s handler, `SigtermAtStepEnd.raise_until_training`; the CLI installs it before it resolves the
    device), then Lightning's handler stops the run at a step end.
    """
    sigterm = sigterm or SigtermAtStepEnd()
    sigterm.raise_until_training()  # a SIGTERM from here on is reported, not a silent end
    try:
        return _checked_fit(cfg, sigterm)
    finally:
        sigterm.restore()


def _checked_fit(cfg: DictConfig, sigterm: SigtermAtStepEnd) -> dict[str, Any]:
    """`fit` with ``sigterm`` in place: the checks, the run folder, then `_train`."""
    hydra_record = HydraRecord.of_job(cfg)  # configs/fit.yaml leaves .hydra/ to us: hydra.output_subdir=null
    if hydra_record is not None and first_process() and not hydra_record.folder.exists():
        hydra_record.write()  # a folder without a record: written at once, as Hydra does; nothing is replaced
        hydra_record = None
    _quiet_library_notices(resuming=bool(cfg.ckpt_path))
    if logging.getLogger().hasHandlers():
        # `import lightning` adds its own console handler that also propagates to the root logger,
        # which Hydra has configured: without this every Lightning message prints twice.
        logging.getLogger("lightning").handlers.clear()
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(f"required but not set: {', '.join(missing)} (e.g. data.path=train.jsonl)")
    unknown = unknown_schema_keys(cfg)
    if unknown:
        raise ValueError(
            f"not keys of the config, nothing would read them: {', '.join(unknown)}. `+key=value` adds keys only where any "
            "key goes (trainer., callbacks., model.config., optimizer.); `python -m lightning_ft fit --cfg job` shows the keys"
        )
    run_dir = Path(cfg.run_dir)
    absolute_local_paths(cfg)  # config.json and the resume command name the same files from any folder
    if cfg.model.init == "pretrained" and not cfg.model.name_or_path:
        raise ValueError("model.name_or_path is required with model.init=pretrained: a local checkpoint folder or a hub name")
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    _check_trainer_arguments(trainer_kwargs)
    on_cpu = trainer_kwargs.get("accelerator") == "cpu"
    no_cuda = "trainer.accelerator=cpu" if on_cpu else None if torch.cuda.is_available() else "no CUDA device here"
    execution = Execution.from_config(OmegaConf.to_container(cfg.strategy, resolve=True))
    execution.check(no_cuda=no_cuda, hint="" if on_cpu else " (and trainer=cpu precision=fp32 for the GPU experiments)")
    _check_option_values(cfg, no_cuda)
    strategy_name = trainer_kwargs.get("strategy", "auto")
    if strategy_name == "auto" and _processes(trainer_kwargs) > 1 and os.environ.get("LOCAL_RANK", "0") == "0":
        log.info("trainer.strategy=auto with several devices: %s (strategy=ddp)", DDP_STRATEGY)
    trainer_kwargs["strategy"] = make_strategy(strategy_name, execution, _processes(trainer_kwargs))
    # compared unresolved: paths derived from ${run_dir} stay equal when a run resumes elsewhere
    written = OmegaConf.to_container(cfg, resolve=False)
    if cfg.ckpt_path == "last":
        check_resume_dir(run_dir)
    if cfg.ckpt_path:
        check_resumed_config(written, cfg.ckpt_path, run_dir)
        if cfg.ckpt_path != "last" and not Path(cfg.ckpt_path).is_file():
            raise FileNotFoundError(
                f"ckpt_path={cfg.ckpt_path!r}: no such checkpoint file (relative paths start from {Path.cwd()}); "
                "ckpt_path=last resumes the run in hydra.run.dir"
            )
    check_local_path("model.name_or_path", cfg.model.name_or_path)
    check_local_path("model.tokenizer", cfg.model.tokenizer)
    check_data_path("data.path", cfg.data.path)
    check_data_path("data.val_path", cfg.data.val_path)
    check_logger_installed(cfg.logger)
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_dir_lock(run_dir):
        if not cfg.ckpt_path:
            check_new_run_dir(run_dir)
        elif cfg.ckpt_path != "last" and not Path(cfg.ckpt_path).resolve().is_relative_to(run_dir.resolve()):
            check_new_run_dir(run_dir, resumed_from=cfg.ckpt_path)  # another run's checkpoint: a new folder
        return _train(cfg, run_dir, trainer_kwargs, written, hydra_record, sigterm)


def _quiet_library_notices(resuming: bool) -> None:
    """Hide notices the libraries print on every run that ask nothing of the user: deprecations inside
    transformers and Lightning, Lightning's "💡 Tip:" advertisements of its cloud services
    (`_not_a_lightning_tip`), and (on a resume, where the folders are expected to hold files)
    Lightning's "directory exists and is not empty" notices, whose "previous log files ... will be
    deleted" `keep_previous_metrics` makes untrue for the metrics."""
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated")
    # logged (not warned) at INFO by every Trainer; adding the same function again is a no-op
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_a_lightning_tip)
    if resuming:
        warnings.filterwarnings("ignore", message=r"(Experiment logs|Checkpoint) directory .* exists and is not empty")


def _not_a_lightning_tip(record: logging.LogRecord) -> bool:
    """A `logging` filter: False for the tips Lightning 2.6 logs when no ``LitLogger`` is used ("try
    installing [litlogger]") or when it adds its own ModelCheckpoint ("[litmodels]"); every other
    record, warnings included, passes."""
    return not record.getMessage().startswith("💡 Tip: For seamless cloud")


def _check_option_values(cfg: DictConfig, no_cuda: str | None) -> None:
    """Values the libraries would refuse only after the data and model are loaded, with their own
    names for the keys (PEFT's ``r``, torch's "Invalid learning rate").

    Raises:
        ValueError: a value of a `CHOICES` key that is not one of its values (naming them and the closest),
            ``lora.rank`` < 1, ``lora.alpha`` ≤ 0, ``lora.dropout`` outside [0, 1), ``eval.every_n_steps`` or
            ``eval.limit_batches`` < 1, a ``moe.chunk_tokens`` other than auto, null or a positive int, an
            ``optimizer.lr`` that is negative or not a number, or
            ``moe.backend=triton`` or ``model.quantization=mxfp4`` (whose experts only ``triton`` reads) where no CUDA
            device will run Triton (without ``TRITON_INTERPRET=1``), or ``lora.init_from`` with LoRA off.
        FileNotFoundError: a ``lora.init_from`` folder without a PEFT adapter (`adapter_folder`).
    """
    from lightning_ft.kernels._utils import interpreter_requested

    for key, choices in CHOICES.items():
        check_choice(key, OmegaConf.select(cfg, key), choices)
    check_chunk_tokens(OmegaConf.select(cfg, "moe.chunk_tokens", default="auto"))
    if cfg.lora.enabled and cfg.lora.rank < 1:
        raise ValueError(f"lora.rank={cfg.lora.rank}: must be at least 1 (lora=none for full fine-tuning)")
    if cfg.lora.enabled and not cfg.lora.init_from and cfg.lora.alpha <= 0:
        raise ValueError(f"lora.alpha={cfg.lora.alpha}: must be positive (the LoRA update is scaled by alpha / rank)")
    if cfg.lora.enabled and cfg.lora.init_from:
        adapter_folder(cfg.lora.init_from)
    if not cfg.lora.enabled and cfg.lora.get("init_from"):
        raise ValueError(
            f"lora.init_from={cfg.lora.init_from}: an adapter to continue needs LoRA, and lora.enabled=false (lora=none) "
            "trains the whole model; to fine-tune a trained model fully, export it merged (`python -m lightning_ft "
            "export <run> --merge`) and start from model=pretrained model.name_or_path=<run>/export/merged"
        )
    if cfg.lora.enabled and not 0 <= cfg.lora.dropout < 1:
        raise ValueError(f"lora.dropout={cfg.lora.dropout}: expected a probability in [0, 1)")
    lr = cfg.optimizer.get("lr") if cfg.optimizer else None
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))):
        raise ValueError(f"optimizer.lr={lr!r}: expected a number, such as 2e-4")
    if lr is not None and lr < 0:
        raise ValueError(f"optimizer.lr={lr}: must be at least 0")
    if lr == 0:
        rank_zero_warn("optimizer.lr=0: the weights will not change (the run measures the loss only); set e.g. optimizer.lr=2e-4 to train")
    for key in ("eval.every_n_steps", "eval.limit_batches"):
        if (value := OmegaConf.select(cfg, key)) is not None and value < 1:
            raise ValueError(f"{key}={value}: must be at least 1 (null: {'every epoch end' if 'every' in key else 'all rows'})")
    for group in ("optimizer", "scheduler"):
        _check_factory_keys(group, cfg.get(group))
    quantization, backend = cfg.model.get("quantization"), cfg.moe.backend
    if quantization in ("nf4", "mxfp4") and not cfg.lora.enabled:
        check_quantized_training(quantization, lora=False, sharded=False)  # raises: only LoRA trains a 4-bit base
    if quantization == "mxfp4" and (model_type := model_type_of(cfg.model)) not in (None, "gpt_oss"):
        raise no_mxfp4_experts(f"model_type {model_type}")
    if quantization == "mxfp4" and backend not in ("auto", *QUANTISED_EXPERT_BACKENDS):  # before the data loads
        raise ValueError(f"model.quantization=mxfp4 keeps the experts in MXFP4, which moe.backend=triton or grouped_mm "
                         f"reads (moe.backend={backend}): set moe=grouped_mm, or moe=triton on a GPU")
    if no_cuda and not interpreter_requested():
        interpreter = "or TRITON_INTERPRET=1 (Triton's CPU interpreter, slow)"
        if quantization == "mxfp4" and backend in ("auto", "triton"):
            # before moe.backend's own refusal, which would send it back here
            chosen = "moe.backend=auto takes triton, which reads them, and" if backend == "auto" else \
                "moe.backend=triton reads them, and"
            raise ValueError(f"model.quantization=mxfp4 keeps the experts in MXFP4; {chosen} Triton needs a CUDA device "
                             f"({no_cuda}) {interpreter}: run on a GPU, set moe=grouped_mm (reads them too, and runs "
                             f"here), or set model.quantization=none (the experts in model.dtype)")
        if backend == "triton":
            raise ValueError(f"moe.backend=triton needs a CUDA device ({no_cuda}) {interpreter}: use moe=grouped_mm or "
                             f"moe=native_torch")


def _check_factory_keys(group: str, node: DictConfig | None) -> None:
    """Refuse ``<group>.<key>`` that ``<group>._target_`` takes no argument for, before anything loads.

    A switched optimizer keeps the default's keys (``optimizer._target_=torch.optim.SGD`` still has
    AdamW's ``betas``): torch would raise a bare TypeError once the model is built.

    Raises:
        ValueError: naming the key, the target's arguments and how to drop the key; or a target
            that cannot be imported.
    """
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    target = node._target_
    try:
        parameters = inspect.signature(get_object(target)).parameters
    except Exception as err:  # ImportError, AttributeError, ValueError from Hydra's lookup
        raise ValueError(f"{group}._target_={target}: cannot be imported ({err})") from err
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    for key in node:
        if not str(key).startswith("_") and key not in parameters:
            accepted = ", ".join(n for n, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL)
            raise ValueError(
                f"{group}.{key}: {target} takes no argument {key!r} (it takes: {accepted}); "
                f"drop it with '~{group}.{key}'"
            )


def _train(
    cfg: DictConfig, run_dir: Path, trainer_kwargs: dict[str, Any], written: dict[str, Any], hydra_record: HydraRecord | None,
    sigterm: SigtermAtStepEnd,
) -> dict[str, Any]:
    """Everything after the checks of `fit`: data, model, callbacks, Trainer, fit; ``sigterm`` takes SIGTERM over
    (it raises until training starts: `SigtermAtStepEnd.raise_until_training`).

    ``written`` goes to ``config.json`` and ``hydra_record`` (None: written already, or not ours to
    write) to ``.hydra/`` when training starts (`RunSummary`, `HydraRecord`): a run refused or failed
    before that (a resume too) leaves the folder's config and Hydra record as they were.
    """
    resolved = OmegaConf.to_container(cfg, resolve=True)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if not cfg.model.tokenizer:  # the tokenizer comes from model.name_or_path: a folder that is no model says so first
        check_model_folder(cfg.model.name_or_path)
    tokenizer_name = cfg.model.tokenizer or cfg.model.name_or_path
    if not tokenizer_name:
        raise ValueError("set model.tokenizer (a path, a hub name, or `builtin`) or model.name_or_path")
    try:
        tokenizer = load_tokenizer(tokenizer_name)
    except (OSError, ValueError) as err:  # transformers raises OSError, or a ValueError for a malformed hub name
        key = "model.tokenizer" if cfg.model.tokenizer else "model.name_or_path"
        raise FileNotFoundError(f"{key}={tokenizer_name!r}: cannot load a tokenizer from it ({err})") from err
    datamodule = PackedDataModule(
        tokenizer=tokenizer,
        accumulate_grad_batches=trainer_kwargs.get("accumulate_grad_batches", 1),
        seed=cfg.seed,
        **OmegaConf.to_container(cfg.data, resolve=True),
    )
    builder = ModelBuilder(
        model=OmegaConf.to_container(cfg.model, resolve=True),
        lora=OmegaConf.to_container(cfg.lora, resolve=True),
        kernels=OmegaConf.to_container(cfg.kernels, resolve=True),
        moe=OmegaConf.to_container(cfg.moe, resolve=True),
        vocab_size=len(tokenizer),
        seed=cfg.seed,
    )
    module = FinetuneModule(
        builder,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.scheduler) if cfg.scheduler else None,
        on_nonfinite=cfg.train.on_nonfinite,
    )
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    if cfg.eval.generate:
        if not datamodule.has_validation:
            raise ValueError("eval.generate=true needs validation data: set data.val_fraction or data.val_path")
        callbacks.append(GenerationEval(cfg.eval.num_examples, cfg.eval.max_new_tokens))
    summary = RunSummary(run_dir, resolved, resuming=bool(cfg.ckpt_path), run_config=written)
    callbacks.append(summary)
    callbacks.append(sigterm)
    if hydra_record is not None:
        callbacks.append(hydra_record)
    # callbacks.progress_bar=null means no progress bar at all (not Lightning's default one)
    trainer_kwargs.setdefault("enable_progress_bar", cfg.callbacks.get("progress_bar") is not None)
    if not datamodule.has_validation:
        trainer_kwargs["limit_val_batches"] = 0
        if set_keys := [f"eval.{k}={cfg.eval[k]}" for k in ("every_n_steps", "limit_batches") if cfg.eval[k]]:
            rank_zero_warn(f"{', '.join(set_keys)}: no validation data, so no validation runs; set data.val_fraction or "
                           "data.val_path")
    else:
        if cfg.eval.every_n_steps:
            # counted in micro-batches over the whole run rather than within each epoch
            trainer_kwargs["val_check_interval"] = cfg.eval.every_n_steps * datamodule.accumulate_grad_batches
            trainer_kwargs["check_val_every_n_epoch"] = None
        if cfg.eval.limit_batches:  # a batch is one packed row on each process
            trainer_kwargs["limit_val_batches"] = cfg.eval.limit_batches
    # ckpt_path=last: last.ckpt, or the newest step checkpoint where a kill left last.ckpt unfinished
    ckpt_path = last_checkpoint(callbacks) if cfg.ckpt_path == "last" else cfg.ckpt_path
    if ckpt_path:
        if (resumed := checkpoint_file(ckpt_path, callbacks)) is not None:
            check_checkpoint_readable(resumed)
        finished = finished_at(ckpt_path, callbacks, trainer_kwargs)
        if finished is not None and exported(run_dir, finished[2]):  # a scheduler re-running a finished job
            checkpoint, reached, _ = finished
            log.warning(
                "ckpt_path=%s: %s %s: the run is finished, nothing is trained and the run folder is left as it was; "
                "to train on, resume with a larger %s",
                cfg.ckpt_path, checkpoint, " and ".join(reached.values()), " and ".join(reached),
            )
            summary_file = run_dir / "summary.json"
            return json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        if finished is not None:  # trained to the end, stopped while exporting: RunSummary.on_fit_end exports
            log.warning("ckpt_path=%s: %s %s, but the run's adapter and summary were not written: nothing is trained, "
                        "they are exported from the checkpoint", cfg.ckpt_path, finished[0], " and ".join(finished[1].values()))
    if first_process():
        for partial in remove_partial_checkpoints(checkpoint_dirs(callbacks)):
            log.info("removed %s, a checkpoint write the interrupted run did not finish", partial)
    _check_strategy(trainer_kwargs.get("strategy"), cfg.eval.generate)
    try:
        trainer = L.Trainer(
            **trainer_kwargs,
            callbacks=callbacks,
            logger=instantiate(cfg.logger) if cfg.logger else False,
            plugins=[AtomicCheckpointIO()],
            use_distributed_sampler=False,  # PackedDataModule shards optimizer steps across ranks itself
            default_root_dir=str(run_dir),
        )
    except (MisconfigurationException, ValueError, TypeError) as err:
        settings = OmegaConf.to_container(cfg.trainer)
        named = [k for k in settings if re.search(rf"\b{k}\b", str(err))]  # the keys it names
        if "gpu backend" in str(err).lower():  # a GPU config on a machine without one
            named = ["accelerator"]
            hint = (
                "; no GPU here: trainer=cpu precision=fp32 (and strategy.cuda_graphs=false strategy.activation_offload=false "
                "for the GPU model configs)"
            )
        else:
            hint = "; several devices: strategy=ddp or strategy=fsdp2" if "strategy" in named else ""
        shown = ", ".join(f"trainer.{k}={settings[k]}" for k in named) or "the trainer.* settings"
        raise ValueError(f"{shown}: Lightning refused it: {err}{hint}") from err
    # after the Trainer is built (a resume it refuses leaves logs/ as it was), before the CSVLogger starts its file
    # not another run's: ``last`` is this folder's last.ckpt (Lightning finds it), a path is resolved from the working directory
    own_resume = bool(ckpt_path) and (ckpt_path == "last" or Path(ckpt_path).resolve().is_relative_to(run_dir.resolve()))
    earlier = keep_previous_metrics(run_dir, resuming=own_resume)
    if own_resume and earlier is not None:
        trainer.callbacks.append(ResumedMetrics(earlier))
    elif earlier is not None:
        log.info("%s: moved to %s (an earlier run's metrics; this run writes its own)", earlier.with_name("metrics.csv"), earlier.name)
        # the metrics were moved aside; Lightning rewrites only hparams.yaml
        warnings.filterwarnings("ignore", message=r"Experiment logs directory .* exists and is not empty")
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    except SIGTERMException as err:  # a SystemExit with status 0: a scheduler would take it for success
        raise Interrupted("interrupted: " + stopped_message(trainer, summary, run_dir, "SIGTERM"), signal.SIGTERM) from err
    except Exception as err:
        if (full := out_of_space(err)) is not None:
            # every write here is atomic (checkpoints, adapter, summary): what was written before is whole
            what = f"a write that found no room ({full.filename or 'a file'}: {os.strerror(full.errno)})"
            raise TrainingStopped(stopped_message(trainer, summary, run_dir, what)
                                  + "; free disk space first (what was written before is intact)") from err
        if (oom := out_of_memory(err)) is not None:
            raise TrainingStopped(stopped_message(trainer, summary, run_dir, f"running out of memory ({oom})")
                                  + f"; to fit: {MEMORY_HINT}") from err
        if ckpt_path and (refused := restore_failure(err, checkpoint_file(ckpt_path, callbacks))) is not None:
            raise refused from err
        raise
    except SystemExit as err:
        if not trainer.interrupted:
            raise
        # Ctrl-C (or SIGTERM while setting up): Lightning tore the run down and exits with status 1 after its notice
        if isinstance(err.__context__, SigtermBeforeTraining):
            raise Interrupted("interrupted: " + stopped_message(trainer, summary, run_dir, "SIGTERM"), signal.SIGTERM) from err
        raise Interrupted("interrupted: " + stopped_message(trainer, summary, run_dir, "Ctrl-C (SIGINT)"), signal.SIGINT) from err
    return summary.summary


def _processes(trainer_kwargs: dict[str, Any]) -> int:
    """How many processes ``trainer.devices`` × ``trainer.num_nodes`` asks for; 0 when Lightning decides
    (``devices=auto`` or ``-1``) or the values are not counts (Lightning then says what it expects)."""
    devices, nodes = trainer_kwargs.get("devices", "auto"), trainer_kwargs.get("num_nodes", 1)
    if isinstance(devices, str):
        devices = devices.strip()
        devices = devices.split(",") if "," in devices else int(devices) if devices.lstrip("-").isdigit() else 0
    if isinstance(devices, (list, tuple)):
        devices = len([d for d in devices if str(d).strip()])
    if type(devices) is not int or type(nodes) is not int:
        return 0
    return max(devices, 0) * nodes


def _check_strategy(strategy: Any, generate: bool) -> None:
    """Refuse what the sharded strategies cannot run, before the Trainer is built.

    Args:
        strategy: ``trainer.strategy`` as configured (a Lightning registry name, or None/"auto"),
            resolved to its class through Lightning's `StrategyRegistry`; or a `Strategy` object.

    Raises:
        ValueError: Lightning's FSDP1 strategy (``trainer.strategy=fsdp``), or ``eval.generate`` with FSDP2.
    """
    if isinstance(strategy, Strategy):
        strategy_class, name = type(strategy), type(strategy).__name__
    elif isinstance(strategy, str) and strategy in StrategyRegistry:
        strategy_class, name = StrategyRegistry[strategy]["strategy"], strategy
    else:
        return
    if issubclass(strategy_class, FSDPStrategy):
        raise ValueError(
            f"trainer.strategy={name}: FSDP1 is not supported; lightning_ft shards with FSDP2, "
            "one unit per decoder layer: use strategy=fsdp2"
        )
    if generate and issubclass(strategy_class, ModelParallelStrategy):
        raise ValueError(
            "eval.generate=true does not work with strategy=fsdp2: every forward pass all-gathers weights, so the ranks "
            "must run in lockstep, and greedy generations stop at different lengths; use strategy=ddp, or generate from "
            "the exported adapter after training"
        )


def _check_trainer_arguments(kwargs: dict[str, Any]) -> None:
    """Lightning raises a bare TypeError for an unknown argument, and a confusing one for a count
    given as text; name the key, the closest ones, or what is expected."""
    for key, value in kwargs.items():
        if unknown := trainer_key_hint(key):
            raise ValueError(unknown[0])
        if key in _INT_TRAINER_KEYS and value is not None and type(value) is not int:
            raise ValueError(f"trainer.{key}={value!r}: expected an integer")
    if kwargs.get("max_steps") == 0:
        raise ValueError("trainer.max_steps=0 trains nothing: set at least 1 (or -1 to run trainer.max_epochs)")
    if kwargs.get("max_epochs") == 0:
        raise ValueError("trainer.max_epochs=0 trains nothing: set at least 1 (or -1 to run trainer.max_steps)")


