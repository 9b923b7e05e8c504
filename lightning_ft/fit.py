"""The main job: build data, model, callbacks and a Lightning Trainer from a composed config, then fit."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from lightning_ft.callbacks.generation_eval import GenerationEval
from lightning_ft.callbacks.summary import RunSummary
from lightning_ft.data.datamodule import PackedDataModule
from lightning_ft.data.tokenization import load_tokenizer
from lightning_ft.modules.finetune_module import FinetuneModule
from lightning_ft.strategies.checkpoint_io import AtomicCheckpointIO

log = logging.getLogger(__name__)


def fit(cfg: DictConfig) -> dict[str, Any]:
    """Fine-tune as ``cfg`` says; returns the run summary (also written to ``run_dir/summary.json``).

    Validation (``data.val_fraction`` or ``data.val_path``) runs every ``eval.every_n_steps``
    optimizer steps (default: at every epoch end) and once more after the last step.

    Raises:
        ValueError: no tokenizer can be named (neither ``model.tokenizer`` nor ``model.name_or_path``),
            ``eval.generate`` without validation data, or ``ckpt_path=last`` with no last checkpoint.
        FileNotFoundError: the tokenizer cannot be loaded from the named path.
    """
    if logging.getLogger().hasHandlers():
        # `import lightning` adds its own console handler that also propagates to the root logger,
        # which Hydra has configured: without this every Lightning message prints twice.
        logging.getLogger("lightning").handlers.clear()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    tokenizer_name = cfg.model.tokenizer or cfg.model.name_or_path
    if not tokenizer_name:
        raise ValueError("set model.tokenizer (a path, a hub name, or `builtin`) or model.name_or_path")
    try:
        tokenizer = load_tokenizer(tokenizer_name)
    except (OSError, ValueError) as err:  # transformers raises OSError, or a ValueError for a malformed hub name
        key = "model.tokenizer" if cfg.model.tokenizer else "model.name_or_path"
        raise FileNotFoundError(f"{key}={tokenizer_name!r}: cannot load a tokenizer from it ({err})") from err
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    datamodule = PackedDataModule(
        tokenizer=tokenizer,
        accumulate_grad_batches=trainer_kwargs.get("accumulate_grad_batches", 1),
        seed=cfg.seed,
        **OmegaConf.to_container(cfg.data, resolve=True),
    )
    module = FinetuneModule(
        model=OmegaConf.to_container(cfg.model, resolve=True),
        lora=OmegaConf.to_container(cfg.lora, resolve=True),
        kernels=OmegaConf.to_container(cfg.kernels, resolve=True),
        moe=OmegaConf.to_container(cfg.moe, resolve=True),
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.scheduler) if cfg.scheduler else None,
        vocab_size=len(tokenizer),
        on_nonfinite=cfg.train.on_nonfinite,
    )
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    if cfg.eval.generate:
        if not datamodule.has_validation:
            raise ValueError("eval.generate=true needs validation data: set data.val_fraction or data.val_path")
        callbacks.append(GenerationEval(cfg.eval.num_examples, cfg.eval.max_new_tokens))
    summary = RunSummary(run_dir, OmegaConf.to_container(cfg, resolve=True))
    callbacks.append(summary)
    # callbacks.progress_bar=null means no progress bar at all (not Lightning's default one)
    trainer_kwargs.setdefault("enable_progress_bar", cfg.callbacks.get("progress_bar") is not None)
    if not datamodule.has_validation:
        trainer_kwargs["limit_val_batches"] = 0
    elif cfg.eval.every_n_steps:
        # counted in micro-batches over the whole run rather than within each epoch
        trainer_kwargs["val_check_interval"] = cfg.eval.every_n_steps * datamodule.accumulate_grad_batches
        trainer_kwargs["check_val_every_n_epoch"] = None
    if cfg.ckpt_path == "last":
        _check_last_checkpoint(callbacks)
    trainer = L.Trainer(
        **trainer_kwargs,
        callbacks=callbacks,
        logger=instantiate(cfg.logger) if cfg.logger else False,
        plugins=[AtomicCheckpointIO()],
        use_distributed_sampler=False,  # PackedDataModule shards optimizer steps across ranks itself
        default_root_dir=str(run_dir),
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    return summary.summary


def _check_last_checkpoint(callbacks: list[Any]) -> None:
    """Lightning only warns when ``ckpt_path=last`` finds nothing and then trains from scratch."""
    dirs = [Path(c.dirpath) for c in callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
    if not any(any(d.glob("last*.ckpt")) for d in dirs):
        raise ValueError(
            f"ckpt_path=last: no last checkpoint in {', '.join(map(str, dirs)) or 'the run (no ModelCheckpoint callback)'}; "
            "resume inside the interrupted run's folder with hydra.run.dir=<that folder>, or pass the checkpoint's path"
        )
