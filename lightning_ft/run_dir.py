"""The run folder and resuming into it: one run per folder (a lock, and no new run over a trained one),
resume checks (the same config, a last checkpoint to resume from, a limit not reached already),
the interrupted run's metrics kept, and the command that resumes a stopped run.

Lightning owns the checkpoints and their restore (`lightning.pytorch.Trainer.fit` with ``ckpt_path``);
this module refuses, before anything is written, the resumes Lightning would run wrongly or silently
start over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shlex
import shutil
import traceback
import zipfile
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from lightning_ft.atomic import PARTIAL_SUFFIX
from lightning_ft.callbacks.summary import CONFIG_FILE, RunSummary
from lightning_ft.config import MOVED_KEYS

log = logging.getLogger(__name__)

#: keys a resumed run may change (none of them changes the math of a step, but trainer.max_steps
#: and trainer.max_epochs stretch the learning-rate schedule to the new length: warned); everything
#: else must match the interrupted run's config
_RESUMABLE_CHANGES = (
    "ckpt_path", "run_dir", "trainer.max_steps", "trainer.max_epochs", "trainer.devices", "trainer.strategy",
    "trainer.accelerator", "trainer.num_nodes", "trainer.enable_progress_bar", "trainer.log_every_n_steps", "callbacks",
    "logger", "eval", "strategy", "moe.lora_slots", "moe.chunk_tokens", *MOVED_KEYS,  # MOVED_KEYS: where a config written before the move has them
)


#: (the run folder, the topmost folder Hydra creates for it) of this process's run, noted by `NewRunDir`
_created: tuple[Path, Path] | None = None
#: what a run writes into its folder before its checks pass: the lock, Hydra's record (and Hydra's log of the job)
_SETUP_ENTRIES = (".lock", ".hydra")


class NewRunDir(Callback):
    """A Hydra callback (``hydra.callbacks`` in ``configs/fit.yaml``): before Hydra creates the run folder
    (``hydra.run.dir``; single runs only, not sweeps), note which folders it will create, for
    `remove_unused_run_dir`. A folder that exists already (a resume, a user's folder) is never noted."""

    @override
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _created
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()  # resolved as Hydra's run_job does
        new = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
        _created = (run_dir, new[-1]) if new else None


def remove_unused_run_dir() -> Path | None:
    """Remove the run folder of a run that stopped before writing anything, where Hydra created it for this
    run (`NewRunDir`), with the parents created with it that are left empty (``outputs/<date>/``).

    "Nothing written": the folder holds only what a run writes before its checks pass (`_SETUP_ENTRIES` and
    Hydra's log of the job, whose handler is closed). A folder with anything else (``summary.json``,
    ``logs/``, checkpoints) is kept, as is every folder that existed before the run; only the job's first
    process removes. Returns the folder removed, or None.
    """
    global _created
    if _created is None or not first_process():
        return None
    run_dir, top = _created
    if not run_dir.is_dir():
        return None
    root = logging.getLogger()
    logs = [h for h in root.handlers if isinstance(h, logging.FileHandler) and Path(h.baseFilename).parent == run_dir]
    log_names = {Path(h.baseFilename).name for h in logs}
    if any(p.name not in _SETUP_ENTRIES and p.name not in log_names for p in run_dir.iterdir()):
        return None
    for handler in logs:
        root.removeHandler(handler)
        handler.close()
    _created = None
    try:  # another process of a job step (srun) may be removing it too
        shutil.rmtree(run_dir)
        for parent in run_dir.parents:
            if not parent.is_relative_to(top) or any(parent.iterdir()):
                break
            parent.rmdir()
    except OSError:
        pass
    return run_dir


def check_resume_dir(run_dir: Path) -> None:
    """For ``ckpt_path=last``: refuse a run folder that Hydra created for this very run (`NewRunDir`): a
    mistyped ``hydra.run.dir`` or none at all (a new ``outputs/<date>/<time>/``) holds no run to resume.

    Raises:
        ValueError: naming the folder and how to point at the interrupted run's.
    """
    if _created is not None and _created[0] == run_dir.absolute():
        raise ValueError(
            f"ckpt_path=last: {run_dir} did not exist before this command, so it holds no run to resume; set "
            "hydra.run.dir=<the interrupted run's folder> (the `interrupted:` line printed the command), or "
            "ckpt_path=<a .ckpt file> to start a new run from that checkpoint"
        )


def first_process() -> bool:
    """Whether this is the job's first process (not a DDP rank Lightning started, on any node)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``run_dir`` for the whole run (the first process of the job only:
    the other DDP ranks Lightning starts share the folder on purpose).

    Raises:
        ValueError: another run holds the folder (two runs would interleave checkpoints and logs).
    """
    if not first_process():
        yield
        return
    with open(run_dir / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{run_dir}: another run is using this folder; wait for it or choose another hydra.run.dir") from None
        yield


def run_in_progress(run_dir: Path) -> bool:
    """Whether a run holds ``run_dir``'s lock (`run_dir_lock`) now: it is still training (or loading)."""
    try:
        with open(run_dir / ".lock") as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock file (a run that never started here), or one that cannot be read
        return False
    return False


def check_new_run_dir(run_dir: Path, resumed_from: str | None = None) -> None:
    """Refuse to start a new run where one ran already: it would replace that run's summary,
    config, adapter and metrics and mix its checkpoints with the new ones (the first process
    only: the other DDP ranks join this run's folder on purpose).

    A ``summary.json`` of a run that stopped before its first optimizer step (a data or setup
    error; nothing to resume) does not count: the new run replaces it. A run resumed from a
    checkpoint outside ``run_dir`` (``resumed_from``, another run's) is a new run in this folder:
    checked the same way (its step checkpoints would rotate this folder's out).

    Unfinished checkpoint writes (``*.tmp``: a run killed before its first checkpoint was whole)
    do not count either.

    Raises:
        ValueError: ``run_dir`` holds ``summary.json`` of a run that trained, or checkpoints under ``checkpoints/``.
    """
    if not first_process():
        return
    found = [p.name for p in (run_dir / "summary.json",) if p.exists() and not _never_trained(p)]
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(not p.name.endswith(PARTIAL_SUFFIX) for p in checkpoints.iterdir()):
        found.append("checkpoints/")
    if found and resumed_from:
        raise ValueError(
            f"ckpt_path={resumed_from}: {run_dir} holds another run ({', '.join(found)}); resume from that checkpoint "
            "in an empty folder (hydra.run.dir=...), or resume this folder's own run with ckpt_path=last"
        )
    if found and "checkpoints/" not in found:  # stopped before its first checkpoint: nothing to resume
        raise ValueError(
            f"{run_dir} holds a run that stopped before its first checkpoint ({', '.join(found)}): there is nothing to "
            "resume; delete the folder to start it over, or start the new run in another folder (hydra.run.dir=...)"
        )
    if found:
        raise ValueError(
            f"{run_dir} holds a run already ({', '.join(found)}): resume it with ckpt_path=last, or start the new run "
            "in another folder (hydra.run.dir=...); delete the folder to start it over"
        )


def _never_trained(summary_path: Path) -> bool:
    """Whether ``summary.json`` records a run that stopped before its first optimizer step (False if unreadable)."""
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("status") != "completed" and summary.get("steps") == 0


def stopped_message(trainer: L.Trainer, summary: RunSummary, run_dir: Path, by: str) -> str:
    """What stopped training, at which step, and the command that resumes it (from which step the last checkpoint is).

    On a process other than the job's first (global rank 0, which writes the summary and the checkpoints and prints
    the resume command), only the stop: this process does not know the checkpoint."""
    if trainer.global_rank != 0:
        return f"training stopped at step {trainer.global_step} by {by} (process of rank {trainer.global_rank})"
    last = summary.summary.get("checkpoint_path")
    if not last:
        return (
            f"training stopped at step {trainer.global_step} by {by}; no checkpoint was written yet "
            "(Ctrl-C saves none; they are written every callbacks.checkpoint.every_n_train_steps steps, and on SIGTERM), "
            f"so there is nothing to resume: delete {run_dir} and run again"
        )
    saved = checkpoint_step(last)  # not the callback's own count: a resumed process starts it at 0
    at = f" (step {saved}: steps after it run again)" if saved is not None and saved < trainer.global_step else ""
    return f"training stopped at step {trainer.global_step} by {by}; resume from {last}{at} with: {resume_command(run_dir)}"


def checkpoint_step(path: str | Path) -> int | None:
    """The ``global_step`` of the Lightning checkpoint at ``path``; None for a file that does not read as one."""
    try:  # mmap: the weights and optimizer state are not read
        step = torch.load(path, map_location="cpu", mmap=True, weights_only=True).get("global_step")
    except Exception:  # noqa: BLE001 - a missing or unreadable file: no step to name
        return None
    return step if isinstance(step, int) else None


#: config keys that may name a local file or folder: a relative one is made absolute (`absolute_local_path`)
LOCAL_PATH_KEYS = ("data.path", "data.val_path", "model.name_or_path", "model.tokenizer")


def absolute_local_path(value: Any) -> Any:
    """``value`` made absolute where it is a relative path to an existing file or folder (anything else as it is: a
    hub or `datasets` name, ``builtin`` and ``builtin:...``), so that a run's config.json and its resume command mean
    the same files from any working directory."""
    if not isinstance(value, str) or not value or value == "builtin" or value.startswith("builtin:"):
        return value
    path = Path(value).expanduser()
    return str(path.resolve()) if not path.is_absolute() and path.exists() else value


def absolute_local_paths(cfg: DictConfig) -> None:
    """Make ``cfg``'s `LOCAL_PATH_KEYS` absolute in place (`absolute_local_path`)."""
    for key in LOCAL_PATH_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if (absolute := absolute_local_path(value)) != value:
            OmegaConf.update(cfg, key, absolute)


def resume_command(run_dir: Path) -> str:
    """The command line that resumes the run in ``run_dir``: this run's own overrides as typed (Hydra's task
    overrides; an earlier ``ckpt_path`` left out; a relative local path of `LOCAL_PATH_KEYS` made absolute, so the
    command runs from any folder), then ``ckpt_path=last`` and the run folder."""
    try:
        typed = list(HydraConfig.get().overrides.task)
    except ValueError:  # fit() called outside a Hydra app: no overrides to repeat
        typed = []
    kept = []
    for override in typed:
        key, _, value = override.partition("=")
        if key.lstrip("+~") == "ckpt_path":
            continue
        kept.append(f"{key}={absolute_local_path(value)}" if key.lstrip("+~") in LOCAL_PATH_KEYS else override)
    return shlex.join(["python", "-m", "lightning_ft", "fit", *kept, "ckpt_path=last", f"hydra.run.dir={run_dir}"])


def keep_previous_metrics(run_dir: Path, resuming: bool = True) -> Path | None:
    """Before a run's logger starts, move ``logs/metrics.csv`` aside (``metrics.<n>.csv``): Lightning's CSVLogger
    deletes it when the logger starts (on a resume before the checkpoint is restored: a resume that
    fails there has it moved already) and would drop the interrupted run's rows, or an earlier run's in a
    folder a new run reuses (one that stopped before its first step, or a folder of other files).
    Only the job's first process does it (the other ranks, on any node, never write logs).

    Args:
        run_dir: the run folder.
        resuming: a resume of this folder's run (the earlier rows go back into the new file); False: a new run
            here, or one resumed from another run's checkpoint (the file is moved to ``metrics.earlier.<n>.csv``
            and stays there: never taken for an interrupted attempt's rows).

    Returns:
        Resuming: the file holding the earlier rows for `lightning_ft.callbacks.resumed_metrics.ResumedMetrics` to
        put back into the new ``metrics.csv``: the one moved now, or (no ``metrics.csv`` here: a resume
        stopped before its logger wrote) the newest ``metrics.<n>.csv`` left by that attempt. A new run: the file
        moved now. None elsewhere.
    """
    metrics = run_dir / "logs" / "metrics.csv"
    if not first_process():
        return None
    stem = "metrics" if resuming else "metrics.earlier"
    n = 1
    while (kept := metrics.with_name(f"{stem}.{n}.csv")).exists():
        n += 1
    if not metrics.exists():
        return metrics.with_name(f"{stem}.{n - 1}.csv") if n > 1 and resuming else None
    metrics.rename(kept)
    return kept


def check_resumed_config(config: dict[str, Any], ckpt_path: str, run_dir: Path) -> None:
    """Refuse, before anything is written, to resume with a config other than the interrupted run's.

    The interrupted run's config is ``config.json`` in its run folder (``run_dir`` for
    ``ckpt_path=last``; two folders above the checkpoint file otherwise).
    """
    saved_file = (run_dir if ckpt_path == "last" else Path(ckpt_path).resolve().parent.parent) / CONFIG_FILE
    if not saved_file.exists():
        return
    saved = json.loads(saved_file.read_text())
    for key in LOCAL_PATH_KEYS:  # a config.json written before its paths were made absolute, resumed from the same folder
        section, name = key.split(".")
        if isinstance(saved.get(section), dict) and name in saved[section]:
            saved[section][name] = absolute_local_path(saved[section][name])
    changes = _diff(saved, json.loads(json.dumps(config, default=str)))
    differences = [
        f"{key}: {old!r} in the interrupted run, {new!r} now" for key, old, new in changes if not key.startswith(_RESUMABLE_CHANGES)
    ]
    if differences:
        raise ValueError(
            f"ckpt_path={ckpt_path}: this config differs from the interrupted run's ({saved_file}): "
            + "; ".join(differences[:8]) + (f" and {len(differences) - 8} more" if len(differences) > 8 else "")
            + ". Repeat the run's own overrides (trainer.max_steps, trainer.max_epochs, trainer.log_every_n_steps, the "
            "devices, callbacks, logger, eval, strategy.*, moe.lora_slots and moe.chunk_tokens may change)"
        )
    stretched = [f"{key}: {old} → {new}" for key, old, new in changes if key in ("trainer.max_steps", "trainer.max_epochs")]
    if stretched and config.get("scheduler") and first_process():
        # the schedule is built from the run's length (lightning_ft.module.training_steps), i.e. the new length
        log.warning(
            "resume with %s: the learning-rate schedule is rebuilt for the new length, so the rate from the resumed "
            "step on differs from the interrupted run's", ", ".join(stretched),
        )


def _diff(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += _diff(old.get(key), new.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if old == new else [(prefix, old, new)]


def checkpoint_file(ckpt_path: str, callbacks: list[Any]) -> Path | None:
    """The file ``ckpt_path`` resumes from: for ``last`` the newest ``last*.ckpt`` of the run's checkpoint folders, as
    Lightning picks it (None: there is none), else the path itself."""
    if ckpt_path != "last":
        return Path(ckpt_path)
    candidates = [p for d in checkpoint_dirs(callbacks) for p in d.glob("last*.ckpt")]
    return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None


def restore_failure(err: BaseException, path: Path | str | None) -> ValueError | None:
    """A one-line error for ``err`` when Lightning raised it while restoring the checkpoint ``path`` (its traceback
    passes through Lightning's checkpoint connector: a checkpoint of another kind, e.g. weights only, or of another
    model shape), naming the file and the folder's other checkpoints; None for any other error."""
    codes = [frame.f_code for frame, _ in traceback.walk_tb(err.__traceback__)]
    restoring = any(code.co_filename.endswith("checkpoint_connector.py")
                    and (code.co_name.startswith(("restore", "_restore")) or code.co_name == "resume_start")
                    for code in codes)  # not its saves (dump_checkpoint), which live in the same file
    if path is None or not restoring:
        return None
    path = Path(path)
    reason = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    reason = reason.splitlines()[0] if reason else type(err).__name__
    return ValueError(f"{path}: Lightning could not restore this checkpoint ({type(err).__name__}: {reason})"
                      f"{_other_checkpoints_hint(path)}")


def _other_checkpoints_hint(path: Path) -> str:
    """``; the folder's other checkpoints: ...`` naming the ``.ckpt`` files beside ``path``, "" where there are none."""
    others = sorted(p.name for p in path.parent.glob("*.ckpt") if p.name != path.name)
    return f"; the folder's other checkpoints: {', '.join(others)} (pass one's path instead)" if others else ""


def check_checkpoint_readable(path: Path | str) -> None:
    """Raise ValueError naming ``path`` when it does not read as a checkpoint: torch writes each one as a zip archive
    whose directory sits at its end, so a file cut short or overwritten has none. Only the directory is read (not
    the weights); the error names the folder's other checkpoints to resume or export from instead."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (zipfile.BadZipFile, OSError) as error:
        raise ValueError(f"{path}: not a readable checkpoint ({error}: cut short or overwritten?)"
                         f"{_other_checkpoints_hint(path)}") from None


def finished_at(ckpt_path: str, callbacks: list[Any], trainer_kwargs: dict[str, Any]) -> tuple[Path, dict[str, str], int] | None:
    """(checkpoint file, {limit: how it is reached}, its global step) when the checkpoint ``ckpt_path`` resumes from (for
    ``last``: the newest ``last*.ckpt``, as Lightning picks it) has reached ``trainer.max_steps`` or
    ``trainer.max_epochs`` already (Lightning stops at whichever comes first), where Lightning would
    train nothing; None otherwise, and for a file that does not read as a checkpoint (Lightning's own
    load then says why). The epochs are counted as Lightning counts them on a resume (`_epochs_done`)."""
    max_steps = trainer_kwargs.get("max_steps", -1)
    max_epochs = trainer_kwargs.get("max_epochs")
    if max_epochs is None:  # Lightning's default (its _parse_loop_limits): 1000 unless steps or time bound the run
        timed = trainer_kwargs.get("max_time") is not None or any(isinstance(c, Timer) for c in callbacks)
        max_epochs = 1000 if max_steps == -1 and not timed else -1
    steps_bound = isinstance(max_steps, int) and max_steps >= 1  # -1: no step limit
    if not steps_bound and max_epochs == -1:
        return None
    if (checkpoint := checkpoint_file(ckpt_path, callbacks)) is None:
        return None
    try:  # mmap: the weights and optimizer state are not read
        state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # noqa: BLE001 - not ours to report: Lightning's load of the same file raises its own error
        return None
    reached = {}
    step = state.get("global_step")
    if steps_bound and isinstance(step, int) and step >= max_steps:
        reached["trainer.max_steps"] = f"is at step {step} and trainer.max_steps={max_steps}"
    epochs = _epochs_done(state)
    if max_epochs != -1 and epochs is not None and epochs >= max_epochs:
        reached["trainer.max_epochs"] = f"has finished {epochs} epochs and trainer.max_epochs={max_epochs}"
    return (checkpoint, reached, step) if reached else None


def exported(run_dir: Path, step: int) -> bool:
    """Whether ``run_dir`` holds the export of a run that finished at optimizer step ``step``: ``adapter/`` and a
    ``summary.json`` saying ``completed`` after ``step`` steps (written last, `RunSummary`). False when the run was
    killed while exporting, or the summary is of an earlier, shorter run in the folder."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    return (run_dir / "adapter").is_dir() and isinstance(summary, dict) and summary.get("status") == "completed" \
        and summary.get("steps") == step


def _epochs_done(checkpoint: dict[str, Any]) -> int | None:
    """The epochs a Lightning checkpoint's run has finished, as Lightning counts them when it resumes from it
    (its ``FitLoop``: ``done`` compares ``epoch_progress.current.processed`` with ``max_epochs``); None
    without the fit loop's state.

    ``processed`` counts an epoch once its last batch has run, before ``on_train_epoch_end`` (where epoch
    checkpoints are saved) and so before the checkpoint's ``epoch`` key (``completed``) moves on. A
    checkpoint saved at the end of an epoch's last batch (a step checkpoint, ``on_train_batch_end``) has
    that epoch started and not yet processed: on a resume Lightning counts it processed (``FitLoop.reset``)
    and trains nothing more in it, so it is counted here too. Any other checkpoint inside an epoch (a
    batch before the last) resumes that epoch. An epoch that ``max_steps`` ended early is processed
    too (Lightning's count: a longer ``max_steps`` with the same ``max_epochs`` trains nothing more).
    """
    try:
        loop = checkpoint["loops"]["fit_loop"]
        epochs, batches = loop["epoch_progress"], loop["epoch_loop.batch_progress"]
        processed = epochs["current"]["processed"]
        in_epoch = epochs["total"]["ready"] == epochs["total"]["started"] == epochs["total"]["processed"] + 1
        last_batch_ran = batches["is_last_batch"] and batches["total"]["processed"] == batches["total"]["started"]
    except (KeyError, TypeError):
        return None
    return processed + 1 if in_epoch and last_batch_ran else processed


def checkpoint_dirs(callbacks: list[Any]) -> list[Path]:
    """The folders the run's `ModelCheckpoint` callbacks write to."""
    return [Path(c.dirpath) for c in callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]


def last_checkpoint(callbacks: list[Any]) -> str:
    """What ``ckpt_path=last`` resumes from: ``"last"`` (Lightning finds ``last.ckpt``) where a ``last*.ckpt`` exists,
    else the path of the newest whole step checkpoint (a run killed after writing a step checkpoint and before
    ``last.ckpt`` was whole has only that one), named in a warning.

    Raises:
        ValueError: no whole checkpoint in the run's checkpoint folders (Lightning would only warn and train from
            scratch).
    """
    dirs = checkpoint_dirs(callbacks)
    if any(any(d.glob("last*.ckpt")) for d in dirs):
        return "last"
    steps = [(step, path) for d in dirs for path in d.glob("*.ckpt") if (step := checkpoint_step(path)) is not None]
    if not steps:
        raise ValueError(
            f"ckpt_path=last: no checkpoint in {', '.join(map(str, dirs)) or 'the run (no ModelCheckpoint callback)'}: "
            "a run here wrote none before it stopped (they are written every callbacks.checkpoint.every_n_train_steps "
            "steps and on SIGTERM), so run it again without ckpt_path; to resume another run, set hydra.run.dir=<its "
            "folder> or pass its checkpoint's path"
        )
    step, path = max(steps)
    log.warning("ckpt_path=last: no whole last.ckpt (the run stopped while writing it); resuming from %s (step %d)", path, step)
    return str(path)
