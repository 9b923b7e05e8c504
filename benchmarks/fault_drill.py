"""Fault drill: kill the main job with SIGKILL at random points, resume it, and compare with a run never killed.

The job is the built-in CPU default (tiny Qwen3-MoE, generated arithmetic), bounded by
``trainer.max_steps``, with a checkpoint after every optimizer step (a step checkpoint and
``last.ckpt``, each written to ``<name>.tmp`` and renamed) and LoRA dropout, so that the RNG state
matters. Each kill lands in one of three phases, taken in turn:

- ``step``: a random time inside a random optimizer step (after step k's checkpoint appeared, a
  uniform delay up to one step's time; k = 0: before the first checkpoint);
- ``checkpoint``: while a checkpoint file is being written: the drill polls the run's
  ``checkpoints/`` for the ``.tmp`` of a random step's step checkpoint or ``last.ckpt`` and kills
  on sight (the kill counts as confirmed mid-write when that ``.tmp`` is still there afterwards);
- ``export``: while the adapter is being exported at the end (``adapter.tmp/`` or ``adapter/``
  appeared, ``summary.json`` not yet written), after a random delay of up to 20 ms.

A kill that misses (the run ends first) is retried at another random point. After each kill the
drill reads every checkpoint (``torch.load``) and the adapter (its config and safetensors), then
resumes as a user would: ``ckpt_path=last`` when a whole checkpoint exists (``last.ckpt``, or the
newest step checkpoint where the kill left ``last.ckpt`` unfinished), else the same command again
(nothing was saved yet). The resumed run must complete with per-step losses and adapter weights
bitwise equal to the uninterrupted run's, and leave every checkpoint and the adapter readable.

Usage:
    python benchmarks/fault_drill.py --kills 20 --seed 0 --out drill.json --record benchmarks/drills.csv

``--record`` appends one row to the drills table (`lightning_ft.bench.table.DRILL`), from which
``python -m lightning_ft bench report`` writes the fault-drill section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("step", "checkpoint", "export")
#: the drilled run: the built-in default, small and bounded by steps, a checkpoint every step, dropout on
COMMON = ("callbacks.progress_bar=null", "data.num_examples=60", "data.max_tokens=128", "lora.dropout=0.1",
          "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=1")
POLL_S = 0.0005


def _command(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lightning_ft", "fit", f"hydra.run.dir={run_dir}", *COMMON, "trainer.max_epochs=-1", f"trainer.max_steps={steps}", *extra]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _start(run_dir: Path, steps: int, *extra: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.log", "ab")
    return subprocess.Popen(_command(run_dir, steps, *extra), cwd=run_dir, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _run(run_dir: Path, steps: int, *extra: str, timeout: float = 600) -> int:
    proc = _start(run_dir, steps, *extra)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9


def _wait_for(proc: subprocess.Popen, found) -> bool:
    """Poll until ``found()`` is true (True) or the process ends first (False)."""
    while proc.poll() is None:
        if found():
            return True
        time.sleep(POLL_S)
    return False


def _kill_once(run_dir: Path, steps: int, phase: str, rng: random.Random, step_s: float) -> dict[str, Any] | None:
    """One run killed in ``phase`` at a random point; None if it ended before the kill."""
    ckpts = run_dir / "checkpoints"
    proc = _start(run_dir, steps)
    point: dict[str, Any] = {"phase": phase}
    if phase == "step":
        k = rng.randrange(0, steps)
        marker = ckpts / f"step{k:06d}.ckpt" if k else run_dir / "config.json"  # config.json: training started
        delay = rng.uniform(0, step_s)
        point.update(after_step=k, delay_s=round(delay, 4))
        landed = _wait_for(proc, marker.exists)
        time.sleep(delay)
    elif phase == "checkpoint":
        k = rng.randrange(1, steps + 1)
        name = rng.choice((f"step{k:06d}.ckpt", "last.ckpt"))
        point.update(step=k, file=name)
        partial = ckpts / f"{name}.tmp"
        # last.ckpt is rewritten every step: wait until step k's own checkpoint is being written or done
        started = ckpts / f"step{k:06d}.ckpt"
        landed = _wait_for(proc, lambda: partial.exists() and (name != "last.ckpt" or started.exists()
                                                               or (ckpts / f"step{k:06d}.ckpt.tmp").exists()))
    else:
        delay = rng.uniform(0, 0.02)
        point.update(delay_s=round(delay, 4))
        landed = _wait_for(proc, lambda: (run_dir / "adapter.tmp").exists() or (run_dir / "adapter").exists())
        time.sleep(delay)
    if proc.poll() is not None or not landed:
        proc.wait()
        return None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    summary = _summary(run_dir)
    if phase == "export" and summary is not None and summary.get("status") == "completed":
        return None  # the export and the summary were done before the kill landed
    point["partial_left"] = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.tmp"))
    return point


def _summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def unreadable(run_dir: Path) -> list[str]:
    """The checkpoints (``checkpoints/*.ckpt``) and adapter files in ``run_dir`` that do not load."""
    from safetensors.torch import load_file

    bad = []
    for ckpt in sorted((run_dir / "checkpoints").glob("*.ckpt")):
        try:
            torch.load(ckpt, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure to load is what is counted
            bad.append(f"{ckpt.relative_to(run_dir)}: {type(err).__name__}")
    adapter = run_dir / "adapter"
    if adapter.exists():
        for name, load in (("adapter_config.json", lambda p: json.loads(p.read_text())), ("adapter_model.safetensors", load_file)):
            try:
                load(adapter / name)
            except Exception as err:  # noqa: BLE001
                bad.append(f"adapter/{name}: {type(err).__name__}")
    return bad


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def _max_diff(a: list[float | None], b: list[float | None]) -> float:
    if len(a) != len(b) or any((x is None) != (y is None) for x, y in zip(a, b)):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b) if x is not None), default=0.0)


def drill(kills: int, seed: int, steps: int, work: Path, phases: tuple[str, ...] = PHASES) -> dict[str, Any]:
    """Run the drill in ``work``: an uninterrupted run, then ``kills`` killed-and-resumed runs (phases in turn).

    Returns the figures (``kills``, per phase, ``resumed``, ``equal_losses``, ``equal_adapter``, ``unreadable``...)
    and one record per kill."""
    rng = random.Random(seed)
    start = time.perf_counter()
    reference = work / "reference"
    if _run(reference, steps) != 0:
        raise RuntimeError(f"the uninterrupted run failed: see {work / 'reference.log'}")
    ref_losses = _summary(reference)["step_losses"]
    ref_adapter = _adapter(reference)
    stamps = sorted(p.stat().st_mtime for p in (reference / "checkpoints").glob("step*.ckpt"))
    step_s = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1) if len(stamps) > 1 else 0.05
    records = []
    for i in range(kills):
        phase = phases[i % len(phases)]
        run_dir = work / f"kill{i:02d}"
        point, attempts = None, 0
        while point is None and attempts < 5:
            attempts += 1
            shutil.rmtree(run_dir, ignore_errors=True)
            point = _kill_once(run_dir, steps, phase, rng, step_s)
        if point is None:
            raise RuntimeError(f"kill {i} ({phase}) never landed in {attempts} attempts")
        point.update(kill=i, attempts=attempts, unreadable_after_kill=unreadable(run_dir))
        restart = not any((run_dir / "checkpoints").glob("*.ckpt"))  # no whole checkpoint: nothing to resume from
        point["resume"] = "again (no checkpoint yet)" if restart else "ckpt_path=last"
        code = _run(run_dir, steps, *(() if restart else ("ckpt_path=last",)))
        summary = _summary(run_dir) or {}
        point["resumed"] = code == 0 and summary.get("status") == "completed" and summary.get("steps") == steps
        point["loss_diff"] = _max_diff(summary.get("step_losses") or [], ref_losses)
        try:
            got = _adapter(run_dir)
            point["adapter_diff"] = max((float((got[k] - v).abs().max()) for k, v in ref_adapter.items()), default=0.0) \
                if got.keys() == ref_adapter.keys() else float("inf")
        except Exception:  # noqa: BLE001 - no adapter: not equal
            point["adapter_diff"] = float("inf")
        point["unreadable_after_resume"] = unreadable(run_dir)
        point["partial_after_resume"] = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.tmp"))
        records.append(point)
        print(json.dumps(point), flush=True)
    by_phase = {p: sum(r["phase"] == p for r in records) for p in PHASES}
    return {
        "kills": len(records),
        **{f"kills_{p}": n for p, n in by_phase.items()},
        "partial_writes_left": sum(bool(r["partial_left"]) for r in records),
        "restarted": sum(r["resume"] != "ckpt_path=last" for r in records),
        "resumed": sum(r["resumed"] for r in records),
        "equal_losses": sum(r["loss_diff"] == 0 for r in records),
        "equal_adapter": sum(r["adapter_diff"] == 0 for r in records),
        "unreadable": sum(len(r["unreadable_after_kill"]) + len(r["unreadable_after_resume"]) for r in records),
        "max_loss_diff": max(r["loss_diff"] for r in records),
        "max_adapter_diff": max(r["adapter_diff"] for r in records),
        "wall_s": round(time.perf_counter() - start, 1),
        "records": records,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="picks the kill points")
    parser.add_argument("--steps", type=int, default=20, help="trainer.max_steps of the drilled run")
    parser.add_argument("--phases", default=",".join(PHASES), help="the phases taken in turn (default: %(default)s)")
    parser.add_argument("--work", default=None, help="folder of the runs (default: a temporary one, deleted after)")
    parser.add_argument("--out", default=None, help="write the figures and every kill's record as JSON here")
    parser.add_argument("--record", default=None, help="append the figures as a row to this CSV (benchmarks/drills.csv)")
    args = parser.parse_args()
    phases = tuple(args.phases.split(","))
    if unknown := [p for p in phases if p not in PHASES]:
        parser.error(f"--phases: unknown {unknown}; expected some of {', '.join(PHASES)}")
    date = datetime.now(timezone.utc)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="fault_drill_"))
    try:
        result = drill(args.kills, args.seed, args.steps, work, phases)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    from lightning_ft.bench.table import DRILL, append_rows, command_text, git_commit, machine, versions

    command = command_text(" ".join(["python", "benchmarks/fault_drill.py", *sys.argv[1:]]))
    result.update(date=date.strftime("%Y-%m-%d %H:%M"), commit=git_commit(ROOT), machine=machine(), command=command)
    figures = {k: v for k, v in result.items() if k != "records"}
    print(json.dumps(figures, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.record:
        row = {"table": "fault_drill", "run": date.strftime("%Y-%m-%dT%H:%MZ"), "steps": args.steps, "seed": args.seed,
               **{k: v for k, v in figures.items() if k in DRILL.names},
               **{k: v for k, v in versions().items() if k in DRILL.names}}
        append_rows(args.record, [row], DRILL)
    failed = result["resumed"] < result["kills"] or result["equal_losses"] < result["kills"] \
        or result["equal_adapter"] < result["kills"] or result["unreadable"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
