"""Killed and resumed runs end as a run never killed; a full disk stops a run and loses nothing already written."""

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_helpers import FAST, run_cli, summary

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fault_drill_kills_mid_step_mid_checkpoint_and_mid_export_and_every_resume_equals_the_run_never_killed(tmp_path):
    """benchmarks/fault_drill.py as documented, one kill per phase (the full drill: 20 kills, RESULTS.md)."""
    out = tmp_path / "drill.json"
    proc = subprocess.run([sys.executable, "benchmarks/fault_drill.py", "--kills", "3", "--steps", "8", "--seed", "3",
                           "--work", str(tmp_path / "runs"), "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [result[f"kills_{p}"] for p in ("step", "checkpoint", "export")] == [1, 1, 1]
    assert (result["resumed"], result["equal_losses"], result["equal_adapter"], result["unreadable"]) == (3, 3, 3, 0), result
    for record in result["records"]:
        assert not record["partial_after_resume"], record  # what a kill left mid-write is gone after the resume


def _file_size_limit(limit: int):
    def apply() -> None:  # in the child: a write past `limit` bytes fails with EFBIG (Python ignores SIGXFSZ)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_full_disk_stops_the_run_naming_the_file_and_the_last_checkpoint_and_adapter_stay_readable(tmp_path):
    """A resume whose next checkpoint (~0.7 MB) finds no room (a 300 kB file-size limit): the run stops with one
    message naming the file and the command that resumes; the step-2 checkpoint and the adapter are intact."""
    from safetensors.torch import load_file

    common = (*FAST, "callbacks.checkpoint.every_n_train_steps=1")
    run_cli(tmp_path, *common, "trainer.max_steps=2")
    before = {p: p.read_bytes() for p in [*tmp_path.glob("checkpoints/*.ckpt"), *tmp_path.glob("adapter/*")]}
    proc = run_cli(tmp_path, *common, "trainer.max_steps=4", "ckpt_path=last", ok=False, preexec_fn=_file_size_limit(300_000))
    ckpt = tmp_path / "checkpoints"
    assert (f"error: training stopped at step 3 by a write that found no room ({ckpt / 'step000003.ckpt'}: File too large); "
            f"resume from {ckpt / 'last.ckpt'} (step 2: steps after it run again) with: ") in proc.stderr, proc.stderr[-3000:]
    assert "free disk space first (what was written before is intact)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert {p: p.read_bytes() for p in before} == before and not list(tmp_path.rglob("*.tmp"))
    assert torch.load(ckpt / "last.ckpt", weights_only=True)["global_step"] == 2
    assert load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert summary(tmp_path)["status"] == "stopped"
    run_cli(tmp_path, *common, "trainer.max_steps=4", "ckpt_path=last")  # room again: the printed resume works
    assert summary(tmp_path)["status"] == "completed" and summary(tmp_path)["steps"] == 4

    # the first checkpoint of a run finds no room: nothing to resume, said so (no checkpoint named that is not there)
    fresh = tmp_path / "fresh"
    proc = run_cli(fresh, *common, "trainer.max_steps=2", ok=False, preexec_fn=_file_size_limit(300_000))
    assert ("error: training stopped at step 1 by a write that found no room "
            f"({fresh / 'checkpoints' / 'step000001.ckpt'}: File too large); no checkpoint was written yet") in proc.stderr
    assert f"so there is nothing to resume: delete {fresh} and run again" in proc.stderr, proc.stderr[-3000:]
    assert summary(fresh)["checkpoint_path"] is None and summary(fresh)["status"] == "stopped"
