"""`SweepSummary`: a Hydra callback that tabulates a multirun (``python -m lightning_ft fit -m ...``).

At the end of a sweep it reads every job folder under ``hydra.sweep.dir`` (the job's
``.hydra/hydra.yaml`` for its number and overrides, its ``summary.json`` for the results) and writes
``sweep_summary.md`` and ``sweep_summary.csv`` there, one row per job. Reading the folders rather
than collecting results in memory makes it work with any launcher (jobs in other processes too). A
job refused before it wrote a ``summary.json`` (a bad override value) has the first line of its error
as its status where the job ran in this process (Hydra's basic launcher, the Optuna sweeper).
Registered in ``configs/fit.yaml`` under ``hydra.callbacks`` (Hydra's documented seam).
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path
from typing import Any

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

log = logging.getLogger(__name__)

COLUMNS = ("job", "overrides", "status", "steps", "final_loss", "val_loss", "val_exact_match", "run_dir")


def sweep_rows(sweep_dir: Path, errors: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per job folder under ``sweep_dir`` (folders with ``.hydra/hydra.yaml``), by job number.

    Args:
        errors: per job folder (``str`` of its absolute path), why the job failed: the status of a job without a
            summary.json.
    """
    errors = errors or {}
    rows = []
    for hydra_yaml in sweep_dir.glob("**/.hydra/hydra.yaml"):
        job_dir = hydra_yaml.parent.parent
        error = errors.get(str(job_dir.absolute()))
        job = OmegaConf.load(hydra_yaml).hydra
        summary_path = job_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        rows.append({
            "job": job.job.num,
            "overrides": " ".join(job.overrides.task),
            "status": _status(summary, error),
            "steps": summary.get("steps"),
            "final_loss": summary.get("final_loss"),
            "val_loss": summary.get("val_loss"),
            "val_exact_match": summary.get("val_exact_match"),
            "run_dir": str(job_dir),
        })
    return sorted(rows, key=lambda r: r["job"])


def _status(summary: dict[str, Any], error: str | None) -> str:
    """A job's status cell: its summary's status, with the first line of why where it did not complete (the message
    the job ended with, which the sweep caught, else the exception its summary records, unless that has no message:
    a SIGTERM's); ``failed: ...`` before the job wrote a summary."""
    status = summary.get("status")
    if status is None:
        return f"failed: {error}" if error is not None else "no summary.json"
    recorded = str(summary.get("error") or "")
    why = error or (recorded if recorded.partition(":")[2].strip() else None)
    return status if status == "completed" or not why else f"{status}: {str(why).splitlines()[0]}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a GitHub markdown table (floats with 4 decimals, None as an empty cell)."""
    def cell(value: Any) -> str:
        if value is None:
            return ""
        return f"{value:.4f}" if isinstance(value, float) else str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


class SweepSummary(Callback):
    """Writes ``sweep_summary.md`` and ``sweep_summary.csv`` into the sweep folder after every job of a
    multirun (so the table exists even when a later job fails and Hydra stops the sweep) and at its end.

    Logs where the table is at the end of the sweep, and after every job from the first that failed on (Hydra's
    sweepers raise that failure once the batch of jobs is done, and the end of the sweep never comes); the writes
    after the jobs before it log at DEBUG."""

    def __init__(self) -> None:
        self.errors: dict[str, str] = {}  # job folder -> the first line of its error
        self.failed = False  # a job of this sweep failed

    @override
    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            failed = getattr(job_return, "status", None) == JobStatus.FAILED
            self.failed |= failed
            job_dir = OmegaConf.select(config, "hydra.runtime.output_dir")
            if failed and job_dir is not None:  # Hydra keeps the exception (reading `return_value` would raise it)
                error = getattr(job_return, "_return_value", None)
                lines = str(error).strip().splitlines() if error is not None else []
                first = lines[0].removeprefix("error: ") if lines else type(error).__name__
                self.errors[str(Path(job_dir).absolute())] = first[:200]
            # once a job failed, the end of the sweep may never come (Hydra's sweepers raise the failure after the
            # batch of jobs): each later write says where the table is
            self._write(Path(config.hydra.sweep.dir), logging.INFO if self.failed else logging.DEBUG)

    @override
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._write(Path(config.hydra.sweep.dir), logging.INFO)

    def _write(self, sweep_dir: Path, level: int) -> None:
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return  # a rank Lightning started for a multi-device job runs the sweep in step; the first process writes
        rows = sweep_rows(sweep_dir, self.errors)
        (sweep_dir / "sweep_summary.md").write_text(markdown_table(rows))
        with (sweep_dir / "sweep_summary.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        log.log(level, "sweep summary of %d job%s: %s", len(rows), "" if len(rows) == 1 else "s", sweep_dir / "sweep_summary.md")
