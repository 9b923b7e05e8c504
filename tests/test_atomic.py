"""Files and folders written whole or not at all, and a full disk named (lightning_ft/atomic.py).

A full disk is the kernel's own ENOSPC: the temporary file is made a link to /dev/full, where every
write fails with "No space left on device".
"""

import errno
import os
from pathlib import Path

import pytest
import torch

from lightning_ft.atomic import atomic_file, atomic_folder, out_of_space, recover_folder, write_text_atomic
from lightning_ft.strategies.checkpoint_io import AtomicCheckpointIO

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


@needs_dev_full
def test_a_full_disk_while_writing_a_checkpoint_names_it_and_keeps_the_previous_one(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)
    os.symlink("/dev/full", tmp_path / "last.ckpt.tmp")
    with pytest.raises(OSError, match="No space left on device") as raised:
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(1_000_000)}, path)  # torch.save wraps it in a RuntimeError
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert "the previous version is intact" in str(raised.value)
    assert io.load_checkpoint(path)["global_step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no temporary file (or link) left


@needs_dev_full
def test_a_full_disk_while_exporting_a_folder_leaves_the_previous_one(tmp_path):
    adapter = tmp_path / "adapter"
    with atomic_folder(adapter) as tmp:
        (tmp / "weights").write_text("old")
    with pytest.raises(OSError) as raised:
        with atomic_folder(adapter) as tmp:
            (tmp / "config.json").write_text("{}")
            os.symlink("/dev/full", tmp / "weights")
            (tmp / "weights").write_text("new, and no room for it")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(adapter)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    assert sorted(p.name for p in adapter.iterdir()) == ["weights"] and (adapter / "weights").read_text() == "old"


def test_a_folder_is_replaced_whole_and_a_crash_between_the_renames_is_undone(tmp_path):
    adapter = tmp_path / "adapter"
    with atomic_folder(adapter) as tmp:
        (tmp / "a").write_text("1")
    with atomic_folder(adapter) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"] and [p.name for p in adapter.iterdir()] == ["b"]
    # killed after the old folder was moved aside, before the new one was renamed in: the old one comes back
    os.replace(adapter, tmp_path / "adapter.old")
    (tmp_path / "adapter.tmp").mkdir()
    (tmp_path / "adapter.tmp" / "half").write_text("")
    recover_folder(adapter)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"] and [p.name for p in adapter.iterdir()] == ["b"]
    with pytest.raises(RuntimeError, match="interrupted"), atomic_folder(adapter) as tmp:
        (tmp / "c").write_text("3")
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"] and [p.name for p in adapter.iterdir()] == ["b"]


def test_other_errors_pass_unchanged_and_leave_no_temporary_file(tmp_path):
    path = tmp_path / "summary.json"
    write_text_atomic(path, "old")
    with pytest.raises(PermissionError, match="not this one"), atomic_file(path) as f:
        f.write(b"new")
        raise PermissionError("not this one")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_out_of_space_finds_the_os_error_behind_a_wrapper():
    try:
        try:
            raise OSError(errno.EFBIG, "File too large")  # RLIMIT_FSIZE
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos")  # torch.save's wrapper
    except RuntimeError as err:
        assert out_of_space(err).errno == errno.EFBIG
    assert out_of_space(OSError(errno.EACCES, "Permission denied")) is None and out_of_space(ValueError()) is None


def test_a_new_run_is_not_refused_for_what_a_run_killed_before_its_first_checkpoint_left(tmp_path):
    from lightning_ft.run_dir import check_new_run_dir, exported

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step000001.ckpt.tmp").write_bytes(b"half")
    check_new_run_dir(tmp_path)  # nothing to resume: not a run already
    (tmp_path / "checkpoints" / "step000001.ckpt").write_bytes(b"")
    with pytest.raises(ValueError, match="holds a run already"):
        check_new_run_dir(tmp_path)
    assert not exported(tmp_path, 1)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "summary.json").write_text('{"status": "completed", "steps": 1}')
    assert exported(tmp_path, 1) and not exported(tmp_path, 2)  # 2: a summary of an earlier, shorter run

    Path(tmp_path / "summary.json").write_text('{"status": "comp')  # cut short
    assert not exported(tmp_path, 1)


def test_a_run_stopped_before_its_first_checkpoint_is_not_offered_a_resume(tmp_path):
    from lightning_ft.run_dir import check_new_run_dir

    (tmp_path / "summary.json").write_text('{"status": "stopped", "steps": 7}')
    with pytest.raises(ValueError, match="stopped before its first checkpoint .*nothing to resume; delete the folder") as err:
        check_new_run_dir(tmp_path)
    assert "ckpt_path=last" not in str(err.value)


def test_a_folder_s_files_get_the_umask_s_permissions(tmp_path):
    """safetensors writes 0600; a served model must be readable by the server's user as the umask allows."""
    from lightning_ft.atomic import atomic_folder

    old = os.umask(0o022)
    try:
        with atomic_folder(tmp_path / "adapter") as tmp:
            (tmp / "weights.bin").write_bytes(b"w")
            (tmp / "weights.bin").chmod(0o600)
    finally:
        os.umask(old)
    assert (tmp_path / "adapter" / "weights.bin").stat().st_mode & 0o777 == 0o644


def test_ckpt_path_last_takes_the_newest_step_checkpoint_where_a_kill_left_last_ckpt_unfinished(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_ft.run_dir import last_checkpoint

    callbacks = [ModelCheckpoint(dirpath=tmp_path)]
    with pytest.raises(ValueError, match="ckpt_path=last: no checkpoint in .*: a run here wrote none before it stopped"):
        last_checkpoint(callbacks)
    for step in (1, 2):
        torch.save({"global_step": step}, tmp_path / f"step00000{step}.ckpt")
    (tmp_path / "last.ckpt.tmp").write_bytes(b"half")
    assert last_checkpoint(callbacks) == str(tmp_path / "step000002.ckpt")
    torch.save({"global_step": 2}, tmp_path / "last.ckpt")
    assert last_checkpoint(callbacks) == "last"  # Lightning resolves it
