from types import SimpleNamespace
from unittest.mock import patch

import pytest
from lightning.pytorch.callbacks import RichProgressBar

from lightning_ft.callbacks.progress import ProgressBar


def test_step_bounded_runs_show_the_epoch_alone_and_bounded_ones_lightnings_description():
    bar = ProgressBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)
    assert bar._get_train_description(3).strip() == "Epoch 3"
    bar._trainer = SimpleNamespace(max_epochs=5)
    assert bar._get_train_description(3).strip() == "Epoch 3/4"


class _RecordingBar(ProgressBar):
    """Records the training bar's (count, total) when training starts (None: no bar yet) and after every micro-batch."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.first_frame = None

    def _state(self):
        task = self.progress.tasks[self.train_progress_bar_id]
        return int(task.completed), task.total

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self.first_frame = None if self.train_progress_bar_id is None else self._state()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.seen.append(self._state())


def _resume(tmp_path, stopped_at: int, max_steps: int, accumulate: int = 1, every_n_train_steps: int | None = None) -> _RecordingBar:
    """Train Lightning's BoringModel (20 micro-batches an epoch) for ``stopped_at`` optimizer steps, then resume it
    from its last checkpoint up to ``max_steps`` with a `_RecordingBar`, which is returned."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
    from torch.utils.data import DataLoader

    class Model(BoringModel):
        def train_dataloader(self):
            return DataLoader(RandomDataset(32, 40), batch_size=2)

    def trainer(steps, *callbacks):
        return L.Trainer(
            max_epochs=-1, max_steps=steps, accumulate_grad_batches=accumulate, limit_val_batches=0, logger=False,
            enable_model_summary=False,
            callbacks=[ModelCheckpoint(tmp_path, save_last=True, every_n_train_steps=every_n_train_steps), *callbacks],
        )

    trainer(stopped_at).fit(Model())
    bar = _RecordingBar()
    trainer(max_steps, bar).fit(Model(), ckpt_path=tmp_path / "last.ckpt")
    return bar


@pytest.mark.parametrize(
    ("accumulate", "stopped_at", "max_steps", "expected"),
    [
        (1, 11, 20, [(n, 20) for n in range(12, 21)]),  # resumed after step 11 of a 20-batch epoch (Lightning's total: 12/8 .. 20/8)
        (2, 5, 10, [(n, 20) for n in range(11, 21)]),  # the same with 2 micro-batches per step (Lightning's: 11/5 .. 20/5)
        (2, 5, 8, [(n, 16) for n in range(11, 17)]),  # max_steps ends the resumed epoch early: 16 of its 20 micro-batches
        # and the next epoch, which max_steps ends after 10 micro-batches (Lightning's: 11/10 .. 20/10, then 1/5 .. 10/5)
        (2, 5, 15, [(n, 20) for n in range(11, 21)] + [(n, 10) for n in range(1, 11)]),
    ],
)
def test_the_bar_counts_and_totals_micro_batches_of_the_epoch_after_a_resume(tmp_path, accumulate, stopped_at, max_steps, expected):
    """A run stopped after ``stopped_at`` optimizer steps, resumed from its last checkpoint."""
    bar = _resume(tmp_path, stopped_at, max_steps, accumulate)
    assert bar.seen == expected
    # from its first frame, before the first batch runs, the bar shows the restored count (Lightning's: none, then 0/N)
    assert bar.first_frame == (expected[0][0] - 1, expected[0][1])


def test_an_extended_finished_run_counts_its_new_epoch_from_one(tmp_path):
    """A run that reached max_steps=3 mid-epoch (checkpoints every 50 steps: last.ckpt is written at its end),
    extended to 6: Lightning starts the next epoch, whose batch_idx goes on from 3; the bar counts 1..3 of 3
    (Lightning's own count: 4/3 .. 6/3)."""
    bar = _resume(tmp_path, 3, 6, every_n_train_steps=50)
    assert bar.seen == [(1, 3), (2, 3), (3, 3)]


def test_a_resume_after_the_epochs_last_batch_starts_the_next_epoch_at_zero(tmp_path):
    """Stopped after step 20, the last batch of a 20-batch epoch (checkpoint at every step), resumed to 22."""
    bar = _resume(tmp_path, 20, 22, every_n_train_steps=1)
    assert bar.first_frame == (0, 2) and bar.seen == [(1, 2), (2, 2)]
    assert bar.progress.tasks[bar.train_progress_bar_id].description.strip() == "Epoch 1"


def test_the_bar_shows_three_metrics_rounded():
    bar = ProgressBar()
    logged = {"train/loss": 2.40123, "train/aux_loss": 1.0, "val/loss": 2.5119, "val/perplexity": 12.3, "train/tokens_per_s": 35120.7, "v_num": 3}
    with patch.object(RichProgressBar, "get_metrics", return_value=logged):
        assert bar.get_metrics(None, None) == {"loss": "2.401", "val": "2.512", "tok/s": "35,121"}
    with patch.object(RichProgressBar, "get_metrics", return_value={"train/loss": 7.0, "v_num": 0}):  # before validation
        assert bar.get_metrics(None, None) == {"loss": "7.000"}
