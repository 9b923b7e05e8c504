"""The terminal progress bar: Lightning's `RichProgressBar`, without "Epoch 0/-2" on step-bounded runs."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class ProgressBar(RichProgressBar):
    """Lightning's `RichProgressBar`; the training bar reads "Epoch 3" when ``trainer.max_epochs`` is -1.

    Our runs are bounded by ``trainer.max_steps`` with ``max_epochs=-1``, for which Lightning prints
    "Epoch 3/-2" (``max_epochs - 1``).
    """

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        # padded like Lightning's, so the bar does not shift when validation starts
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
