"""Step checkpoints: Lightning's `ModelCheckpoint`, plus one more when SIGTERM stops the run."""

from __future__ import annotations

import os
import weakref
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override


class StepCheckpoint(ModelCheckpoint):
    """Lightning's `ModelCheckpoint` that also writes a step checkpoint and ``last.ckpt`` when SIGTERM
    stops training, so a preempted job resumes from the step it reached rather than from the last
    periodic save (``every_n_train_steps``; before the first one there would be nothing to resume),
    that writes ``last.ckpt`` of a run ended by ``trainer.max_steps`` at its last step, inside the
    epoch, so that the run extended with a larger ``trainer.max_steps`` trains the rows the longer run
    would have (Lightning writes it after closing the epoch, from where it resumes at the wrong row),
    and that saves the last step of a run whose data ran out (``trainer.max_epochs``) when no periodic save
    did (Lightning's ``last.ckpt`` would stay at the last periodic save).

    Lightning 2.6 raises `SIGTERMException` only between batches (the training loop's
    ``on_advance_end``, after every callback's ``on_train_batch_end``), and `SigtermAtStepEnd` makes that
    the end of an optimizer step, on every DDP/FSDP2 rank at the same batch, so the weights, optimizer and
    loop state are those of a finished step. The checkpoint is written only when that batch finished an
    optimizer step (without `SigtermAtStepEnd`, other batches leave half-accumulated gradients, which a
    checkpoint does not hold). Lightning's own ``save_on_exception`` is not used: it saves on any
    exception, e.g. Ctrl-C in the middle of a backward pass or of an optimizer step, where the state
    is half-updated; after Ctrl-C the last periodic checkpoint stays the one to resume from.
    Writes are atomic like every checkpoint here (`AtomicCheckpointIO`).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._step_at_batch_start: int | None = None  # None: no training batch has started in this process
        self._validated_at: int | None = None  # the step after which the last validation of this process ran
        self._trainer: weakref.ref[L.Trainer] | None = None

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # Note: last.ckpt of a run that trainer.max_steps ends is written here, inside the epoch, as a periodic save
        # writes it. Lightning writes it after closing the epoch (on_train_epoch_end / on_train_end), and a run
        # extended from there (a larger trainer.max_steps) skips the rest of that epoch or of the next one (its fit
        # loop counts the epoch done but keeps the epoch's batch count); from an in-epoch one it carries on exactly.
        if _reached_max_steps(trainer) and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not (_reached_max_steps(trainer) and self._last_global_step_saved == trainer.global_step):  # kept in-epoch
            super().on_train_epoch_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated_at = trainer.global_step
        if not (_reached_max_steps(trainer) and self._last_global_step_saved == trainer.global_step):  # kept in-epoch
            super().on_validation_end(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's writes last.ckpt here only if this process wrote none yet: a run whose last step is not a
        # periodic save (the data ran out, trainer.max_epochs) would leave last.ckpt at an earlier step, which
        # export and resume read. Here that step gets its step checkpoint and last.ckpt, written after the epoch
        # closed (as Lightning's epoch-end saves: a resume with a larger trainer.max_epochs starts the next epoch).
        # Only where the epoch's data ran out: a stop within an epoch (trainer.should_stop: a Timer, early stopping)
        # saved after the epoch closed would count that epoch done, and a resume would skip the rest of its rows.
        ran_out = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if self._step_at_batch_start is None or not ran_out or self._should_skip_saving_checkpoint(trainer):
            super().on_train_end(trainer, pl_module)
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # SIGTERMException comes after the batch's end: global_step moved on iff that batch finished a step
        finished_a_step = self._step_at_batch_start is not None and trainer.global_step != self._step_at_batch_start
        if not (isinstance(exception, SIGTERMException) and finished_a_step) or trainer.fast_dev_run:
            return
        if self._last_global_step_saved == trainer.global_step:  # the periodic save wrote this step already
            return
        # the periodic saves' path: the step checkpoint joins the kept ones (save_top_k rotates it out
        # later; Lightning's own save on exception writes it outside them, where it stays for good), then last.ckpt
        # The loggers' step (the epoch loop's count of batches that stepped) is saved as counted here, after the batch.
        # A run resumed from a batch that ended with a validation counts that batch once more (Lightning's restart
        # skips the validation, then its on_advance_end counts the batch): save one less there, or the resumed run's
        # metrics would be logged a step late. Without a validation it counts nothing again.
        shift = int(self._validated_at == trainer.global_step)
        loop = trainer.fit_loop.epoch_loop
        loop._batches_that_stepped -= shift
        try:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        finally:
            loop._batches_that_stepped += shift
        rank_zero_info(f"SIGTERM: saved the checkpoint of step {trainer.global_step} ({self._last_checkpoint_saved})")

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._trainer = weakref.ref(trainer)  # its ckpt_path, in load_state_dict

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning's, also for a run resumed in a copy of its folder (``hydra.run.dir`` another path).

        Lightning reloads the paths it manages (``last.ckpt``, the kept step checkpoints) only when the
        checkpoint's ``dirpath`` is this one; otherwise the copy's ``last.ckpt`` would stay beside a new
        ``last-v1.ckpt`` and the copied step checkpoints would never be rotated out. When the checkpoint
        resumed from is a file of this dirpath (the copy resumes from its own files), the paths under
        the old dirpath are read as the same files under this one, the step checkpoints the copy lacks
        left out, so the run carries on as it would have in its own folder. A checkpoint from elsewhere
        (another run's folder) keeps Lightning's behaviour: this folder's files are never taken for its.
        """
        trainer = self._trainer() if self._trainer is not None else None
        source = os.path.abspath(trainer.ckpt_path) if trainer is not None and trainer.ckpt_path else None
        here = os.path.abspath(self.dirpath) if self.dirpath else None
        old = os.path.abspath(state_dict["dirpath"]) if state_dict.get("dirpath") else None
        if old and here and source and old != here and os.path.commonpath([here, source]) == here:
            def moved(path: str) -> str:
                path = os.path.abspath(path)
                return os.path.join(here, os.path.relpath(path, old)) if os.path.commonpath([old, path]) == old else path

            kept = {q: v for p, v in state_dict.get("best_k_models", {}).items() if os.path.exists(q := moved(p))}
            kth = moved(state_dict["kth_best_model_path"]) if state_dict.get("kth_best_model_path") else ""
            if kth not in kept:  # its file is not in the copy: the next save fills the kept ones up again
                kth = ""
            state_dict = {
                **state_dict,
                "dirpath": self.dirpath,
                "best_k_models": kept,
                "kth_best_model_path": kth,
                **{key: moved(state_dict[key]) for key in ("last_model_path", "best_model_path") if state_dict.get(key)},
            }
        super().load_state_dict(state_dict)


def _reached_max_steps(trainer: L.Trainer) -> bool:
    return trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps


def training_ends_after_this_batch(trainer: L.Trainer) -> bool:
    """Whether the training batch that just ran is the run's last: ``trainer.max_steps`` reached, or the last batch of
    the last epoch (``trainer.max_epochs``). Read after the batch (``on_train_batch_end``, or a validation after it)."""
    if _reached_max_steps(trainer):
        return True
    last_epoch = trainer.max_epochs not in (None, -1) and trainer.current_epoch + 1 >= trainer.max_epochs
    return last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
