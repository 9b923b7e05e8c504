"""The terminal progress bar: Lightning's `RichProgressBar`, without "Epoch 0/-2" on step-bounded runs,
with a total that matches its count after a mid-epoch resume and compact metrics that fit 80 columns."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import BatchesProcessedColumn, CustomBarColumn, CustomTimeColumn
from rich.progress import TextColumn
from rich.table import Column
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl


#: the metrics the bar shows: (logged key, name on the bar, format); every logged metric is in logs/metrics.csv
SHOWN_METRICS = (("train/loss", "loss", ".3f"), ("val/loss", "val", ".3f"), ("train/tokens_per_s", "tok/s", ",.0f"))


class ProgressBar(RichProgressBar):
    """Lightning's `RichProgressBar`; the training bar reads "Epoch 3" when ``trainer.max_epochs`` is -1,
    its total is the micro-batch of the epoch at which the epoch ends (`total_train_batches`), and a
    resumed run's bar shows the restored count from its first frame.

    For a run bounded by ``trainer.max_steps`` with ``max_epochs=-1`` Lightning prints "Epoch 3/-2"
    (``max_epochs - 1``). The bar fits an 80-column terminal: it shows `SHOWN_METRICS` rounded
    (``loss: 2.401 val: 2.512 tok/s: 2,147``; Lightning's shows every ``prog_bar`` metric to 3
    decimals and wraps) and, instead of micro-batches per second, the bar's width adapts.
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
    def configure_columns(self, trainer: pl.Trainer) -> list:
        # Lightning's columns without the speed in micro-batches/s (tok/s is among the metrics); only the bar wraps
        # (gives up width) where the line is too long for the terminal
        columns = [
            TextColumn("[progress.description]{task.description}", table_column=Column(no_wrap=True)),
            CustomBarColumn(
                bar_width=None,
                complete_style=self.theme.progress_bar,
                finished_style=self.theme.progress_bar_finished,
                pulse_style=self.theme.progress_bar_pulse,
            ),
            BatchesProcessedColumn(style=self.theme.batch_progress),
            CustomTimeColumn(style=self.theme.time),
        ]
        for column in columns[2:]:  # Lightning's columns take no table_column argument
            column._table_column = Column(no_wrap=True)
        return columns

    @override
    def _init_progress(self, trainer: pl.Trainer) -> None:
        super()._init_progress(trainer)
        if self._metric_component is not None:  # made by Lightning, after configure_columns
            self._metric_component._table_column = Column(no_wrap=True)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The `SHOWN_METRICS` that have been logged, formatted (strings: the bar prints them as they are)."""
        metrics = super().get_metrics(trainer, pl_module)
        return {name: format(metrics[key], fmt) for key, name, fmt in SHOWN_METRICS if key in metrics}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        fit_loop = trainer.fit_loop
        # a resume from a checkpoint of a step (not of an epoch's start): Lightning's fit loop calls no
        # on_train_epoch_start (its `on_advance_start`) and its bar is made at the end of the first batch, from 0.
        # Make it now at the restored count (0 where the restored batch ended the epoch: the next starts the next one)
        if self.is_disabled or self.progress is None or not (fit_loop.restarted_mid_epoch or fit_loop.restarted_on_epoch_end):
            return
        batches = fit_loop.epoch_loop.batch_progress
        self._epoch_position = 0 if batches.is_last_batch else batches.current.ready
        description = self._get_train_description(trainer.current_epoch)
        self.train_progress_bar_id = self.progress.add_task(
            f"[{self.theme.description}]{description}" if self.theme.description else description,
            total=self.total_train_batches,
            completed=self._epoch_position,
        )
        self.refresh()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_position = 0  # the loop's own batch counter holds the previous epoch's until the first batch
        self._fresh_epoch = True
        super().on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
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
