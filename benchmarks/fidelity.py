"""Fidelity check: train a candidate setting and a reference from the same initial weights, compare the losses.

A setting that changes the arithmetic (fp8 base weights, a 4-bit base, another kernel) must train as the
reference does. This runs ``python -m lightning_ft fit`` twice with the same seed and data, the common
overrides plus each side's own, and compares:

- the training loss curves (``summary.json``'s per-step losses), each smoothed by a trailing mean over
  ``--window`` steps, at every ``--every``-th step from the first full window: the largest relative difference
  ``|candidate - reference| / reference`` must be at most ``--curve-tol``;
- the final validation loss (``summary.json``'s ``val_loss``: give the runs ``data.val_path`` or
  ``data.val_fraction``): relative difference at most ``--val-tol``.

The same seed gives both runs the same initial weights (a random init is drawn before any conversion, and
a checkpoint is the same file), the same adapter initialisation and the same batches. fp8 trains over its base
weights rounded to e4m3: ``--e4m3-base`` loads that rounded base in both runs (`save_e4m3_base`), so that the
reference starts from the weights the fp8 run holds. Usage (fp8 against bf16 and the fused 4-bit base against
PEFT + bitsandbytes, 300 steps of GSM8K each):

    python benchmarks/fidelity.py --name fp8 --reference strategy.fp8=false --candidate strategy.fp8=true \\
        --e4m3-base --record benchmarks/fidelity.csv -- +experiment=qwen3_0_6b data=jsonl \\
        data.path=../shared/data/gsm8k_train.jsonl data.val_path=../shared/data/gsm8k_test.jsonl trainer.max_steps=300
    python benchmarks/fidelity.py --name qlora --reference kernels=none --candidate kernels=all \\
        --record benchmarks/fidelity.csv -- +experiment=qwen3_14b_qlora data.path=... data.val_path=... trainer.max_steps=300

Each side's overrides are one argument, split as the shell splits words: quote an override with spaces inside
it, e.g. ``--candidate "'lora.target_modules=[q_proj, v_proj]' kernels=all"``. ``--record`` appends one row to the
fidelity table (`lightning_ft.bench.table.FIDELITY`), from which ``python -m lightning_ft bench report``
writes the fidelity section of RESULTS.md. Before anything trains, each side's config as Hydra composes it
(``fit ... --cfg job``) is checked: both need validation data and the same ``trainer.max_steps``, at least one
``--window`` (exit status 2 otherwise, as for bad arguments). Exit status 1 when a bound is exceeded or a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def smoothed(losses: list[float | None], window: int) -> list[float | None]:
    """The trailing mean of each full ``window`` of ``losses`` (entry i: steps i-window+1 .. i); None before the first
    full window and for a window holding a skipped step (None)."""
    out: list[float | None] = []
    for i in range(len(losses)):
        part = losses[max(0, i - window + 1): i + 1]
        out.append(sum(part) / window if i + 1 >= window and None not in part else None)
    return out


def curve_difference(reference: list[float | None], candidate: list[float | None], window: int, every: int) -> tuple[float, int]:
    """(largest relative difference of the smoothed curves, its 1-based step), compared at each ``every``-th step.

    Raises:
        ValueError: curves of different lengths, or no step where both smoothed curves have a value.
    """
    if len(reference) != len(candidate):
        raise ValueError(f"the runs trained {len(reference)} and {len(candidate)} steps: expected the same number")
    ref, cand = smoothed(reference, window), smoothed(candidate, window)
    points = [(abs(c - r) / abs(r), i + 1) for i, (r, c) in enumerate(zip(ref, cand))
              if (i + 1) % every == 0 and r is not None and c is not None]
    if not points:
        raise ValueError(f"no step to compare: {len(reference)} steps, --window {window}, --every {every}")
    return max(points)


def _env() -> dict[str, str]:
    """The runs' environment: this checkout first on the import path, unbuffered output."""
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def _fit(run_dir: Path, overrides: list[str], log: Path, timeout: float) -> dict[str, Any]:
    """One ``fit`` run into ``run_dir`` (its output in ``log``); its ``summary.json``.

    Raises:
        RuntimeError: the run failed or wrote no summary (naming the log).
    """
    command = [sys.executable, "-m", "lightning_ft", "fit", f"hydra.run.dir={run_dir}", *overrides]
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=_env(), timeout=timeout).returncode
    summary = run_dir / "summary.json"
    if code != 0 or not summary.exists():
        raise RuntimeError(f"fit {shlex.join(overrides)} ended with status {code}: see {log}")
    return json.loads(summary.read_text())


def planned_config(overrides: list[str]) -> dict[str, Any]:
    """The config ``fit`` would run with these overrides, as Hydra composes it (``fit ... --cfg job``: nothing runs).

    Raises:
        ValueError: Hydra could not compose it (its message).
    """
    import yaml

    command = [sys.executable, "-m", "lightning_ft", "fit", *overrides, "--cfg", "job"]
    proc = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=300)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        error = next((line for line in lines if line.startswith("error: ")), lines[-1] if lines else "no config")
        raise ValueError(f"fit {shlex.join(overrides)}: {error.removeprefix('error: ')}")
    return yaml.safe_load(proc.stdout)


def save_e4m3_base(config: dict[str, Any], out: Path) -> list[str]:
    """Save ``config``'s base model to ``out`` with the weight of each layer LoRA wraps rounded to its e4m3 value, as
    ``strategy.fp8`` stores it (per-output-channel scales, `lightning_ft.kernels.fp8.quantize_weight`, dequantised to
    ``model.dtype``); return the overrides that load it.

    ``strategy.fp8`` trains over the rounded weights, so a bf16 reference on the unrounded ones starts from another
    model. On a pretrained checkpoint the two are nearly the same function; on a random init they are two
    different random networks, whose losses differ by more than fp8's arithmetic does. Loading this checkpoint in
    both runs (``--e4m3-base``) starts them from the very same weights (converting a rounded weight gives the same
    e4m3 values back), so the comparison measures the fp8 arithmetic alone. A random init is drawn with the
    config's ``seed`` on the GPU where there is one, as ``fit`` draws it.

    Returns:
        ``model.name_or_path=<out>`` and ``model.init=pretrained``.
    """
    import torch

    from lightning_ft.data.tokenization import load_tokenizer
    from lightning_ft.kernels.fp8 import quantize_weight
    from lightning_ft.model.build import load_causal_lm
    from lightning_ft.model.lora import add_lora

    if not (config.get("lora") or {}).get("enabled", True):
        raise ValueError("--e4m3-base rounds the weights LoRA wraps (those strategy.fp8 converts), and the common config "
                         "has lora.enabled=false: give the runs LoRA")
    cfg = config["model"]
    tokenizer = load_tokenizer(cfg.get("tokenizer") or cfg["name_or_path"])
    torch.manual_seed(config.get("seed") or 0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = load_causal_lm(cfg.get("name_or_path"), init=cfg.get("init", "pretrained"), config=cfg.get("config"),
                               dtype=cfg.get("dtype", "float32"), vocab_size=len(tokenizer),
                               trust_remote_code=cfg.get("trust_remote_code", False))
    model = add_lora(model, config["lora"])
    rounded = 0
    with torch.no_grad():
        for module in model.modules():
            base = getattr(module, "base_layer", None)
            if type(base) is torch.nn.Linear:
                values, scales = quantize_weight(base.weight)
                base.weight.copy_((values.float() * scales[:, None]).to(base.weight.dtype))
                rounded += 1
    if not rounded:
        raise ValueError("--e4m3-base: the config's LoRA wraps no nn.Linear, so strategy.fp8 would convert nothing")
    model.unload().save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"fidelity: {rounded} LoRA base weights rounded to e4m3, saved to {out}", flush=True)
    return [f"model.name_or_path={out}", "model.init=pretrained"]


def preflight(configs: dict[str, dict[str, Any]], window: int, every: int = 1) -> None:
    """Refuse, before anything trains, a pair of runs that could not be compared: a side without validation data,
    different ``trainer.max_steps``, or no step to compare at (fewer than one smoothing window, or none of them a
    multiple of ``every`` from the first full window on).

    Raises:
        ValueError: naming the side and the setting to change.
    """
    for side, cfg in configs.items():
        data = cfg.get("data") or {}
        if not (data.get("val_path") or (data.get("val_fraction") or 0) > 0):
            raise ValueError(f"the {side} run has no validation data, so no final validation loss: give both runs "
                             "data.val_path or data.val_fraction")
    steps = {side: (cfg.get("trainer") or {}).get("max_steps") for side, cfg in configs.items()}
    if len(set(steps.values())) > 1:
        raise ValueError("the runs would train different numbers of steps (" + ", ".join(
            f"{side} trainer.max_steps={n}" for side, n in steps.items()) + "): give both the same")
    n = next(iter(steps.values()))
    if isinstance(n, int) and 0 < n < window:
        raise ValueError(f"trainer.max_steps={n} is less than one smoothing window (--window {window}): no step to compare")
    first = -(-window // every) * every  # the first compared step: a multiple of --every with a full window
    if isinstance(n, int) and 0 < n < first:
        raise ValueError(f"trainer.max_steps={n}: the first step compared would be {first} (the first multiple of --every "
                         f"{every} from --window {window} on): lower --every or train more steps")


def check(common: list[str], reference: list[str], candidate: list[str], work: Path, window: int, every: int,
          curve_tol: float, val_tol: float, timeout: float) -> dict[str, Any]:
    """Both runs and their comparison: the figures of a `lightning_ft.bench.table.FIDELITY` row."""
    start = time.perf_counter()
    runs = {}
    # the candidate first: the setting under test is the likelier to be refused (e.g. fp8 off Hopper), before a whole
    # reference run is spent
    for side, overrides in (("candidate", candidate), ("reference", reference)):
        print(f"fidelity: {side}: fit {shlex.join(common + overrides)}", flush=True)
        runs[side] = _fit(work / side, [*common, *overrides], work / f"{side}.log", timeout)
    ref, cand = runs["reference"], runs["candidate"]
    curve, at_step = curve_difference(ref["step_losses"], cand["step_losses"], window, every)
    val_ref, val_cand = ref.get("val_loss"), cand.get("val_loss")
    val_diff = abs(val_cand - val_ref) / abs(val_ref) if val_ref is not None and val_cand is not None else None
    return {
        "steps": len(ref["step_losses"]), "window": window, "every": every,
        "max_curve_rel_diff": curve, "at_step": at_step, "curve_tol": curve_tol,
        "val_loss_reference": val_ref, "val_loss_candidate": val_cand, "val_rel_diff": val_diff, "val_tol": val_tol,
        "passed": int(curve <= curve_tol and val_diff is not None and val_diff <= val_tol),
        "tokens_per_s_reference": ref.get("tokens_per_s"), "tokens_per_s_candidate": cand.get("tokens_per_s"),
        "device": cand.get("device"), "wall_s": round(time.perf_counter() - start, 1),
    }


def _machine(device: str | None) -> str:
    """The GPU's name where the runs trained on one (summary.json's ``device``), else the CPU's."""
    from lightning_ft.bench.table import machine

    if device and device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    return machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="what is checked (the row's name): fp8, qlora, ...")
    parser.add_argument("--reference", required=True, help="the reference run's overrides, split as the shell splits words")
    parser.add_argument("--candidate", required=True, help="the candidate run's overrides, split as the shell splits words")
    parser.add_argument("--window", type=int, default=20, help="steps in the trailing mean (default: %(default)s)")
    parser.add_argument("--every", type=int, default=10, help="compare at every this many steps (default: %(default)s)")
    parser.add_argument("--curve-tol", type=float, default=0.02, help="bound on the smoothed curves (default: %(default)s)")
    parser.add_argument("--val-tol", type=float, default=0.01, help="bound on the final validation loss (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=7200, help="seconds per run (default: %(default)s)")
    parser.add_argument("--work", default=None, help="folder of the two runs (default: a temporary one, deleted after)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--e4m3-base", action="store_true",
                        help="load, in both runs, the base with its LoRA-wrapped weights rounded to e4m3 (save_e4m3_base; for fp8)")
    parser.add_argument("--record", default=None, help="append the figures as a row to this CSV (benchmarks/fidelity.csv)")
    parser.add_argument("common", nargs="*", help="overrides both runs take (after --)")
    args = parser.parse_args()
    for flag in ("window", "every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}: expected a positive number of steps, got {getattr(args, flag)}")
    sides = {}
    for side in ("reference", "candidate"):
        try:
            sides[side] = shlex.split(getattr(args, side))
        except ValueError as err:
            parser.error(f"--{side}: {err}: {getattr(args, side)!r}")
    from lightning_ft.bench.table import FIDELITY, TableError, append_rows, command_text, git_commit, read_rows, versions

    if args.record and Path(args.record).exists():
        try:  # a file with other columns is refused before the runs, not after them
            read_rows(args.record, FIDELITY)
        except TableError as err:
            sys.exit(f"fidelity: --record {err}")
    try:
        preflight({side: planned_config([*args.common, *overrides]) for side, overrides in sides.items()}, args.window,
                  args.every)
    except (ValueError, subprocess.TimeoutExpired) as err:
        parser.error(str(err))
    date = datetime.now(timezone.utc)
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="fidelity_"))
    work.mkdir(parents=True, exist_ok=True)
    common = args.common
    try:
        if args.e4m3_base:
            common = [*common, *save_e4m3_base(planned_config(common), work / "e4m3_base")]
        result = check(common, sides["reference"], sides["candidate"], work, args.window,
                       args.every, args.curve_tol, args.val_tol, args.timeout)
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as err:
        # a temporary folder is kept then: the message names the failed run's log in it
        sys.exit(f"fidelity: {err}" + ("" if args.work else f" (the runs are kept in {work})"))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)

    command = command_text(shlex.join(["python", "benchmarks/fidelity.py", *sys.argv[1:]]))
    result.update(date=date.strftime("%Y-%m-%d %H:%M"), commit=git_commit(ROOT), machine=_machine(result.pop("device")), command=command,
                  name=args.name, reference=args.reference, candidate=args.candidate)
    print(json.dumps(result, indent=2))
    if result["val_rel_diff"] is None:
        print("fidelity: no final validation loss: give both runs data.val_path or data.val_fraction", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.record:
        row = {"table": "fidelity", "run": date.strftime("%Y-%m-%dT%H:%MZ"),
               **{k: v for k, v in result.items() if k in FIDELITY.names},
               **{k: v for k, v in versions().items() if k in FIDELITY.names}}
        append_rows(args.record, [row], FIDELITY)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
