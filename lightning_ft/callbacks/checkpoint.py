"""Step checkpoints: Lightning's `ModelCheckpoint`, plus one more when SIGTERM stops the run."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override


class StepCheckpoint(ModelCheckpoint):
    """Lightning's `ModelCheckpoint` that also writes a step checkpoint and ``last.ckpt`` when SIGTERM
    stops training, so a preempted job resumes from the step it reached rather than from the last
    periodic save (``every_n_train_steps``; before the first one there would be nothing to resume).

    Lightning 2.6 raises `SIGTERMException` only between batches (the training loop's
    ``on_advance_end``, after every callback's ``on_train_batch_end``; on every DDP/FSDP2 rank at the
    same batch), so the weights, optimizer and loop state are those of a finished batch. The
    checkpoint is written only when that batch finished an optimizer step: with
    ``accumulate_grad_batches`` > 1 the other batches leave half-accumulated gradients, which a
    checkpoint does not hold. Lightning's own ``save_on_exception`` is not used: it saves on any
    exception, e.g. Ctrl-C in the middle of a backward pass or of an optimizer step, where the state
    is half-updated; after Ctrl-C the last periodic checkpoint stays the one to resume from.
    Writes are atomic like every checkpoint here (`AtomicCheckpointIO`).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._step_at_batch_start: int | None = None  # None: no training batch has started in this process

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # SIGTERMException comes after the batch's end: global_step moved on iff that batch finished a step
        finished_a_step = self._step_at_batch_start is not None and trainer.global_step != self._step_at_batch_start
        if not (isinstance(exception, SIGTERMException) and finished_a_step):
            return
        # Lightning's path for the save (a step checkpoint, then last.ckpt; skipped when this step is saved)
        self.save_on_exception = True
        try:
            super().on_exception(trainer, pl_module, exception)
        finally:
            self.save_on_exception = False
