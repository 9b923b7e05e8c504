"""The main job: build data, model, callbacks and a Lightning Trainer from a composed config, then fit."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_ft.callbacks.summary import RunSummary
from lightning_ft.data.datamodule import PackedDataModule
from lightning_ft.data.tokenization import load_tokenizer
from lightning_ft.modules.finetune_module import FinetuneModule
from lightning_ft.strategies.checkpoint_io import AtomicCheckpointIO

log = logging.getLogger(__name__)


def fit(cfg: DictConfig) -> dict[str, Any]:
    """Fine-tune as ``cfg`` says; returns the run summary (also written to ``run_dir/summary.json``).

    Raises:
        ValueError: no tokenizer can be named (neither ``model.tokenizer`` nor ``model.name_or_path``).
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
    tokenizer = load_tokenizer(tokenizer_name)
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
    )
    callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
    summary = RunSummary(run_dir, OmegaConf.to_container(cfg, resolve=True))
    callbacks.append(summary)
    if cfg.data.val_fraction == 0:
        trainer_kwargs["limit_val_batches"] = 0
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
