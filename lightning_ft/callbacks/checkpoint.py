"""Step checkpoints: Lightning's `ModelCheckpoint`, plus one more when SIGTERM stops the run."""

from __future__ import annotations

import os
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

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's, also for a run resumed in a copy of its folder (``hydra.run.dir`` another path).

        Lightning reloads the paths it manages (``last.ckpt``, the kept step checkpoints) only when the
        checkpoint's ``dirpath`` is this one; otherwise the copy's ``last.ckpt`` stayed beside a new
        ``last-v1.ckpt`` and the copied step checkpoints were never rotated out. When every such path
        lies under the old dirpath and its file exists under this one (a whole copy), they are read as
        those files, so the resumed run carries on as it would have in its own folder; otherwise (a run
        resumed from a checkpoint in another run's folder) Lightning's behaviour is kept.
        """
        old = os.path.abspath(state_dict["dirpath"]) if state_dict.get("dirpath") else None
        if old and self.dirpath and old != os.path.abspath(self.dirpath):
            paths = [*state_dict.get("best_k_models", {}), state_dict.get("kth_best_model_path"),
                     state_dict.get("last_model_path"), state_dict.get("best_model_path")]
            paths = [p for p in paths if p]
            moved = {p: os.path.join(self.dirpath, os.path.relpath(os.path.abspath(p), old)) for p in paths}
            under_old = all(os.path.commonpath([old, os.path.abspath(p)]) == old for p in paths)
            if paths and under_old and all(os.path.exists(q) for q in moved.values()):
                state_dict = {
                    **state_dict,
                    "dirpath": self.dirpath,
                    "best_k_models": {moved[p]: v for p, v in state_dict.get("best_k_models", {}).items()},
                    **{key: moved.get(state_dict.get(key), state_dict.get(key))
                       for key in ("kth_best_model_path", "last_model_path", "best_model_path") if key in state_dict},
                }
        super().load_state_dict(state_dict)
