"""`SweepSummary`: the sweep's table after every job, and a line saying where it is."""

import logging
from pathlib import Path
from types import SimpleNamespace

from hydra.core.utils import JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from lightning_ft.callbacks.sweep_summary import SweepSummary


def _job(sweep, num, overrides):
    hydra_dir = sweep / str(num) / ".hydra"
    hydra_dir.mkdir(parents=True)
    OmegaConf.save({"hydra": {"job": {"num": num}, "overrides": {"task": overrides}}}, hydra_dir / "hydra.yaml")


def test_the_sweep_table_is_announced_at_the_end_and_after_every_job_from_a_failed_one_on(tmp_path, caplog):
    config = OmegaConf.create({"hydra": {"mode": RunMode.MULTIRUN, "sweep": {"dir": str(tmp_path)}}})
    callback, done = SweepSummary(), SimpleNamespace(status=JobStatus.COMPLETED)
    with caplog.at_level(logging.INFO, logger="lightning_ft.callbacks.sweep_summary"):
        _job(tmp_path, 0, ["lora.rank=4"])
        callback.on_job_end(config, done)
        callback.on_multirun_end(config)
        assert caplog.messages == [f"sweep summary of 1 job: {tmp_path / 'sweep_summary.md'}"]
        caplog.clear()
        _job(tmp_path, 1, ["lora.rank=8"])
        callback.on_job_end(config, done)
        assert caplog.messages == []  # written after each job, not announced
        assert len((tmp_path / "sweep_summary.md").read_text().splitlines()) == 4  # header, rule, two jobs
        callback.on_multirun_end(config)
        assert caplog.messages == [f"sweep summary of 2 jobs: {tmp_path / 'sweep_summary.md'}"]
        caplog.clear()
        _job(tmp_path, 2, ["lora.rank=16"])
        callback.on_job_end(config, SimpleNamespace(status=JobStatus.FAILED))  # the sweep may stop here
        assert caplog.messages == [f"sweep summary of 3 jobs: {tmp_path / 'sweep_summary.md'}"]
        caplog.clear()
        _job(tmp_path, 3, ["lora.rank=32"])  # a job of the same batch runs on: the sweeper raises the failure after it
        callback.on_job_end(config, done)
        assert caplog.messages == [f"sweep summary of 4 jobs: {tmp_path / 'sweep_summary.md'}"]


def test_a_job_refused_before_its_summary_shows_its_error(tmp_path, monkeypatch):
    """A failed job without a summary.json (refused before training: a bad override) has its error's first line as
    its status; a job without either keeps "no summary.json". The sweep folder is relative, as the default is, and
    Hydra gives the job's folder as an absolute path."""
    monkeypatch.chdir(tmp_path)
    callback = SweepSummary()
    for num in (0, 1):
        _job(Path("sweep"), num, [f"lora.rank={num}"])
    config = OmegaConf.create({"hydra": {"mode": RunMode.MULTIRUN, "sweep": {"dir": "sweep"},
                                         "runtime": {"output_dir": str(tmp_path / "sweep" / "0")}}})
    refused = ValueError("error: lora.rank=0: expected a positive integer\n(the rest of the message)")
    callback.on_job_end(config, SimpleNamespace(status=JobStatus.FAILED, _return_value=refused))
    table = (tmp_path / "sweep" / "sweep_summary.md").read_text()
    assert "| 0 | lora.rank=0 | failed: lora.rank=0: expected a positive integer |" in table
    assert "| 1 | lora.rank=1 | no summary.json |" in table


def test_a_job_that_failed_after_writing_its_summary_shows_its_error(tmp_path):
    """The job's summary.json status with its error's first line; a completed job shows its status alone."""
    import json

    callback = SweepSummary()
    for num, summary in enumerate([{"status": "failed", "error": "ValueError: data.path: no such file\n(more)"},
                                   {"status": "completed", "steps": 3}]):
        _job(tmp_path, num, [f"lora.rank={num + 4}"])
        (tmp_path / str(num) / "summary.json").write_text(json.dumps(summary))
    config = OmegaConf.create({"hydra": {"mode": RunMode.MULTIRUN, "sweep": {"dir": str(tmp_path)}}})
    callback.on_job_end(config, SimpleNamespace(status=JobStatus.COMPLETED))
    table = (tmp_path / "sweep_summary.md").read_text()
    assert "| 0 | lora.rank=4 | failed: ValueError: data.path: no such file |" in table
    assert "| 1 | lora.rank=5 | completed | 3 |" in table
