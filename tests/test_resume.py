"""A resumed run trains the same rows with the same losses as the uninterrupted run.

Bounded by ``trainer.max_steps`` or ``trainer.max_epochs``, with 0 or 2 data-loader workers, resumed
from a checkpoint at an epoch end or inside an epoch, and a finished run extended by an epoch. The
runs are `lightning_ft.fit.fit` in this process (the CLI's own config, composed with Hydra's compose
API): 32 arithmetic rows packed into 8 rows of ≤ 128 tokens, one micro-batch per step, so an epoch is
8 steps. LoRA dropout makes the RNG state matter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from lightning_ft.config import config_dir, register_configs

EPOCH = 8  # optimizer steps an epoch
COMMON = ("callbacks.progress_bar=null", "data.num_examples=32", "data.max_tokens=128", "trainer.log_every_n_steps=1",
          "lora.dropout=0.1", "callbacks.gradient_check=null")


def _fit(run_dir: Path, *overrides: str) -> list[float]:
    """Runs ``python -m lightning_ft fit <overrides>`` in this process into ``run_dir``; its per-step losses."""
    from lightning_ft.fit import fit

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose(config_name="fit", overrides=[*COMMON, *overrides, f"run_dir={run_dir}"])
    finally:
        GlobalHydra.instance().clear()
    fit(cfg)
    return json.loads((run_dir / "summary.json").read_text())["step_losses"]


def _bound(bound: str, epochs: int) -> tuple[str, str]:
    if bound == "max_epochs":
        return "trainer.max_steps=-1", f"trainer.max_epochs={epochs}"
    return f"trainer.max_steps={epochs * EPOCH}", "trainer.max_epochs=-1"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("bound", ["max_epochs", "max_steps"])
def test_resume_trains_the_rows_and_losses_of_the_uninterrupted_run(tmp_path, bound, workers):
    """Resumed from step 8 (epoch 0's last batch) and from step 11 (inside epoch 1), and a finished run
    (1 epoch; with max_steps also 11 steps) extended to 2 epochs: every step after the resume has the
    uninterrupted run's loss."""
    common = (*_bound(bound, 2), f"data.num_workers={workers}")
    full = _fit(tmp_path / "full", *common, "callbacks.checkpoint.every_n_train_steps=1", "callbacks.checkpoint.save_top_k=-1")
    assert len(full) == 2 * EPOCH and None not in full
    # the extended runs' learning rate is constant (a schedule is rebuilt for the new length), so their reference too
    constant = _fit(tmp_path / "constant", *common, "scheduler=null")
    runs = {}
    for step in (EPOCH, EPOCH + 3):
        checkpoint = tmp_path / "full" / "checkpoints" / f"step{step:06d}.ckpt"
        runs[f"resumed from step {step}"] = (step, _fit(tmp_path / f"from{step}", *common, f"ckpt_path={checkpoint}"))
    # a finished run extended to 2 epochs: one that ended at an epoch end and (max_steps) one that ended inside an epoch
    for steps in (EPOCH,) if bound == "max_epochs" else (EPOCH, EPOCH + 3):
        first = tmp_path / f"extended{steps}"
        shorter = _bound(bound, 1) if bound == "max_epochs" else (f"trainer.max_steps={steps}", "trainer.max_epochs=-1")
        _fit(first, *shorter, f"data.num_workers={workers}", "scheduler=null")
        runs[f"extended from step {steps}"] = (steps, _fit(first, *common, "scheduler=null", "ckpt_path=last"))
    for name, (first, losses) in runs.items():
        expected = constant if name.startswith("extended") else full
        assert len(losses) == 2 * EPOCH, name
        for step in range(first, 2 * EPOCH):
            assert abs(losses[step] - expected[step]) <= 1e-6, (name, step + 1, losses[step], expected[step])
