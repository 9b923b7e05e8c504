"""Tokens per second of training, per optimizer step and over the run."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from typing_extensions import override

from lightning_ft.data.packing import PackedBatch
from lightning_ft.module import host_scalar


class TokenThroughput(L.Callback):
    """Logs ``train/tokens_per_s`` (all ranks' tokens over wall time) at every optimizer step.

    A step's time runs from the end of the previous step to the end of this one; the module's
    per-step loss read-out waits for the device's backward (after the update is queued, or before
    it for an optimizer that cannot skip on the device), so wall time measures the device's work (a
    step's update kernels are counted in the next step). The
    first step (compilation, allocator warm-up) is excluded from the run's average ``tokens_per_s``.

    Attributes:
        train_tokens: tokens trained on, all ranks, all steps.
        tokens_per_s: average over the steps after the first (over all steps if there is one).
    """

    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []  # (tokens, seconds) of each optimizer step
        self._last_step = 0
        self._t0 = 0.0

    @property
    def train_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.steps)

    @property
    def tokens_per_s(self) -> float:
        steady = self.steps[1:] or self.steps
        return sum(t for t, _ in steady) / max(sum(s for _, s in steady), 1e-9)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps)}  # a resumed run keeps counting the run's tokens

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = [tuple(step) for step in state_dict.get("steps", [])]

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: PackedBatch, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # still accumulating micro-batches of this step
        self._last_step = trainer.global_step
        now = time.perf_counter()
        self.steps.append((batch.step_tokens, now - self._t0))
        self._t0 = now
        pl_module.log("train/tokens_per_s", host_scalar(batch.step_tokens / max(self.steps[-1][1], 1e-9)), prog_bar=True)
