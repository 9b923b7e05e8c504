"""A resumed run's ``logs/metrics.csv`` holds the whole run: the interrupted run's rows, then this run's."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

log = logging.getLogger(__name__)


class ResumedMetrics(L.Callback):
    """Puts the interrupted run's metric rows back into the resumed run's ``metrics.csv``.

    Lightning's CSVLogger starts a new file on every run (`lightning_ft.run_dir.keep_previous_metrics` moves
    the old one aside first, to ``metrics.<n>.csv``). Once the checkpoint is restored (``on_train_start``; or
    ``on_fit_end`` for a resume that trains nothing: a run stopped while exporting), the rows of the earlier
    file logged before the checkpoint's step (logger ``step`` < ``trainer.global_step``: the steps the resumed
    run does not train again) are logged again through each CSVLogger's ``log_metrics`` and written (``save``);
    the earlier file is then removed. Its later rows (steps trained again after the checkpoint) are dropped: the
    resumed run logs them anew, so each step appears once. Without a CSVLogger (``logger=tensorboard``) the
    earlier file stays as ``metrics.<n>.csv``, and a later resume with one puts it back.

    Args:
        earlier: the earlier ``metrics.<n>.csv`` (Lightning's CSV layout: a ``step`` column, empty cells
            for metrics a row does not hold).
    """

    def __init__(self, earlier: Path) -> None:
        self.earlier = Path(earlier)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore(trainer)

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore(trainer)  # a resume that trained nothing (on_train_start never ran); else a no-op

    def _restore(self, trainer: L.Trainer) -> None:
        loggers = [logger for logger in trainer.loggers if isinstance(logger, CSVLogger)]
        if not trainer.is_global_zero or not loggers or not self.earlier.is_file():
            return
        with self.earlier.open(newline="") as file:
            rows = [row for row in csv.DictReader(file) if _number(row.get("step")) is not None]
        kept = [row for row in rows if _number(row["step"]) < trainer.global_step]
        for logger in loggers:
            for row in kept:  # a row cut short by a kill has empty cells; one with extra cells has them under None
                metrics = {key: value for key, text in row.items()
                           if key not in (None, "step") and (value := _number(text)) is not None}
                logger.log_metrics(metrics, step=_number(row["step"]))
            logger.save()
        self.earlier.unlink()
        log.info("resume: %d metric rows of the steps before %d from %s are in %s", len(kept), trainer.global_step,
                 self.earlier.name, ", ".join(str(Path(logger.log_dir) / "metrics.csv") for logger in loggers))


def _number(text: Any) -> int | float | None:
    """A CSV cell as Lightning wrote it (an int, a float), None for an empty, missing or malformed cell."""
    if not text or not isinstance(text, str):
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None
