"""The terminal progress bar: Lightning's `RichProgressBar`, without "Epoch 0/-2" on step-bounded runs
and with a total that matches its count after a mid-epoch resume."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ProgressBar(RichProgressBar):
    """Lightning's `RichProgressBar`; the training bar reads "Epoch 3" when ``trainer.max_epochs`` is -1,
    and its total is the micro-batch of the epoch at which the epoch ends (`total_train_batches`).

    For a run bounded by ``trainer.max_steps`` with ``max_epochs=-1`` Lightning prints "Epoch 3/-2"
    (``max_epochs - 1``).
    """

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        # padded like Lightning's, so the bar does not shift when validation starts
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"

    #: micro-batches of the current epoch run when Lightning reads `total_train_batches`
    _epoch_position = 0
    #: on_train_epoch_start ran and the epoch's first batch has not ended yet
    _fresh_epoch = False
    #: Lightning's batch_idx at the first batch of an epoch that started afresh (see `on_train_batch_end`)
    _epoch_offset = 0

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_position = 0  # the loop's own batch counter holds the previous epoch's until the first batch
        self._fresh_epoch = True
        super().on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # after a mid-epoch resume on_train_epoch_start is skipped and the bar is made here, at the first batch's end.
        # An epoch that started afresh counts from its first batch: resumed from a checkpoint written when a run
        # reached max_steps mid-epoch, Lightning starts the next epoch (at its first step of data) but its
        # batch_idx goes on from the restored count (a run extended from 3 steps to 6 would read "Epoch 1 6/3")
        if self._fresh_epoch:
            self._fresh_epoch, self._epoch_offset = False, batch_idx
        batch_idx -= self._epoch_offset
        self._epoch_position = batch_idx + 1
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @property
    @override
    def total_train_batches(self) -> Union[int, float]:
        """The micro-batch of this epoch after which training stops: the epoch's length, or earlier where
        ``trainer.max_steps`` ends the run.

        The bar's count is the micro-batch within the epoch (``batch_idx + 1``), also after a mid-epoch
        resume. Lightning 2.6's total (`ProgressBar.total_train_batches`, read by its Rich and TQDM bars
        alike) is instead ``min(num_training_batches, max_steps - global_step)``: the remaining
        *optimizer steps*, so a run resumed after step 11 of a 20-batch epoch with ``max_steps=20``
        would count 12..20 out of 8, and with ``accumulate_grad_batches=k`` the remaining steps are
        compared with micro-batches (k times too few). Here both are micro-batches of the epoch.
        """
        trainer = self.trainer
        epoch_length = trainer.num_training_batches
        if trainer.max_steps is None or trainer.max_steps < 0:
            return epoch_length
        accumulate = trainer.accumulate_grad_batches
        # the micro-batches of a step still accumulating are not in global_step yet: count from that step's start
        stepped = self._epoch_position - self._epoch_position % accumulate
        return min(epoch_length, stepped + (trainer.max_steps - trainer.global_step) * accumulate)
