"""StepCheckpoint: a run resumed in a copy of its folder carries on there as in its own folder; the
checkpoint SIGTERM saves rotates out like the periodic ones."""

import shutil

import lightning as L
import pytest
from cli_helpers import SignalAtStep
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from lightning_ft.callbacks.checkpoint import StepCheckpoint


class _Model(BoringModel):
    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 40), batch_size=2)


def _fit(run_dir, steps, ckpt_path=None, every=1, callbacks=()):
    checkpoint = StepCheckpoint(  # as configs/callbacks/default.yaml, every ``every`` steps
        dirpath=run_dir / "checkpoints", filename="step{step:06d}", auto_insert_metric_name=False,
        every_n_train_steps=every, save_last=True, save_top_k=2, monitor="step", mode="max",
    )
    trainer = L.Trainer(max_epochs=-1, max_steps=steps, limit_val_batches=0, logger=False, enable_model_summary=False,
                        enable_progress_bar=False, callbacks=[checkpoint, *callbacks])
    trainer.fit(_Model(), ckpt_path=ckpt_path)


def _files(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_a_copied_run_folder_resumes_in_place_and_a_new_folder_leaves_the_old_one_alone(tmp_path):
    """The copy's last.ckpt is replaced and its step checkpoints rotate (Lightning alone would write
    last-v1.ckpt beside it and keep every copied step checkpoint); the original folder is untouched. A run resumed
    in a new folder from another run's step checkpoint keeps Lightning's behaviour there."""
    _fit(tmp_path / "a", 4)
    original = _files(tmp_path / "a")
    assert original == ["last.ckpt", "step000003.ckpt", "step000004.ckpt"]
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    _fit(tmp_path / "b", 6, ckpt_path=tmp_path / "b" / "checkpoints" / "last.ckpt")
    assert _files(tmp_path / "b") == ["last.ckpt", "step000005.ckpt", "step000006.ckpt"]
    assert _files(tmp_path / "a") == original
    _fit(tmp_path / "c", 6, ckpt_path=tmp_path / "a" / "checkpoints" / "step000003.ckpt")
    assert _files(tmp_path / "c") == ["last.ckpt", "step000005.ckpt", "step000006.ckpt"]
    assert _files(tmp_path / "a") == original


def test_a_partial_copy_replaces_its_last_checkpoint(tmp_path):
    """A copy of last.ckpt alone (the step checkpoints left behind) resumes in place: its last.ckpt is
    replaced, not kept beside a new last-v1.ckpt, and its step checkpoints rotate from there."""
    _fit(tmp_path / "a", 4)
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "a" / "checkpoints" / "last.ckpt", tmp_path / "b" / "checkpoints")
    _fit(tmp_path / "b", 7, ckpt_path=tmp_path / "b" / "checkpoints" / "last.ckpt")
    assert _files(tmp_path / "b") == ["last.ckpt", "step000006.ckpt", "step000007.ckpt"]


def test_another_runs_checkpoint_never_rotates_this_folders_files_out(tmp_path):
    """Resumed from run a's checkpoint in folder b, where a run with the same file names ran: b's
    checkpoints are b's own, not a's copies, and stay (taken for a's, they would be rotated out)."""
    _fit(tmp_path / "a", 4)
    _fit(tmp_path / "b", 4)
    own = {name: (tmp_path / "b" / "checkpoints" / name).read_bytes() for name in ("step000003.ckpt", "step000004.ckpt")}
    _fit(tmp_path / "b", 6, ckpt_path=tmp_path / "a" / "checkpoints" / "step000004.ckpt")
    assert {name: (tmp_path / "b" / "checkpoints" / name).read_bytes() for name in own} == own


def test_the_checkpoint_sigterm_saves_rotates_out_like_the_periodic_ones(tmp_path):
    """SIGTERM after step 8 saves step000008 among the kept step checkpoints (save_top_k=2); the
    resumed run's periodic saves rotate it out. Lightning's own save on exception would write it
    outside them, to stay in the folder for good."""
    with pytest.raises(SIGTERMException):
        _fit(tmp_path, 20, every=5, callbacks=[SignalAtStep(7)])
    assert _files(tmp_path) == ["last.ckpt", "step000005.ckpt", "step000008.ckpt"]
    _fit(tmp_path, 15, every=5, ckpt_path=tmp_path / "checkpoints" / "last.ckpt")
    assert _files(tmp_path) == ["last.ckpt", "step000010.ckpt", "step000015.ckpt"]
