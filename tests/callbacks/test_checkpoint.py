"""StepCheckpoint: a run resumed in a copy of its folder carries on there as in its own folder."""

import shutil

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from lightning_ft.callbacks.checkpoint import StepCheckpoint


class _Model(BoringModel):
    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 40), batch_size=2)


def _fit(run_dir, steps, ckpt_path=None):
    checkpoint = StepCheckpoint(  # as configs/callbacks/default.yaml, every step
        dirpath=run_dir / "checkpoints", filename="step{step:06d}", auto_insert_metric_name=False,
        every_n_train_steps=1, save_last=True, save_top_k=2, monitor="step", mode="max",
    )
    trainer = L.Trainer(max_epochs=-1, max_steps=steps, limit_val_batches=0, logger=False, enable_model_summary=False,
                        enable_progress_bar=False, callbacks=[checkpoint])
    trainer.fit(_Model(), ckpt_path=ckpt_path)


def _files(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_a_copied_run_folder_resumes_in_place_and_a_new_folder_leaves_the_old_one_alone(tmp_path):
    """The copy's last.ckpt is replaced and its step checkpoints rotate (Lightning wrote last-v1.ckpt
    beside it and kept every copied step checkpoint); the original folder is untouched. A run resumed
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
