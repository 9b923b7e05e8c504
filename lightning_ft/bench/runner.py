"""Run a benchmark config: every (sequence length, system) pair in a fresh subprocess, alternating
systems within each length, then write ``results.json``, ``results.md`` and ``results.png`` (and each
worker's whole output to ``worker_SYSTEM_SEQLEN.log``: the memory plan's table, warnings), and
append each row to the results table (``results_table``; `lightning_ft.bench.table`).

The systems run one after another on the same device (never at the same time); each gets its
own process so that allocator state, compiled kernels and monkey-patches (Liger patches
transformers classes) never leak from one to the next.

Memory-matched runs (``memory_matched=SYSTEM``): at each length the named peer runs first and
``lightning_ft`` then runs with ``strategy.memory_budget_gib`` set to the peer's measured peak
(allocated) of that length, so the two compare at equal memory; the ``lightning_ft`` row records the
peer (``memory_matched``) and the budget (``memory_budget_gib``). Where the peer measured no peak (it
failed, or on the CPU), the ``lightning_ft`` row is not run and says why.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from lightning_ft.atomic import write_json_atomic
from lightning_ft.bench import table as results_table
from lightning_ft.bench.report import finish_plot
from lightning_ft.bench.systems import SYSTEMS
from lightning_ft.bench.worker import ROW_PREFIX
from lightning_ft.callbacks.summary import allocator_settings
from lightning_ft.config import command_schema, key_hint
from lightning_ft.errors import BenchFailed

log = logging.getLogger(__name__)

_COLUMNS = [("system", "system"), ("layers", "layers"), ("seq_len", "seq"), ("status", "status"),
            ("ms_per_step", "ms/step"), ("tokens_per_s", "tokens/s"), ("x_vs_hf_peft", "× hf_peft"),
            ("mfu", "MFU"), ("peak_mem_gib", "peak GiB"), ("mem_vs_hf_peft", "mem × hf_peft"), ("loss_last", "loss")]
_PROFILE_COLUMNS = [("device_busy_ms_per_step", "device busy ms"), ("kernels_per_step", "kernels/step"),
                    ("memory_budget_gib", "budget GiB"), ("predicted_peak_gib", "predicted peak GiB"),
                    # activation offloading's copies (`ActivationOffload.stats`): achieved GB/s, the compute stream's stall
                    ("cuda_graphs_copy_d2h_gbps", "offload d2h GB/s"), ("cuda_graphs_copy_h2d_gbps", "offload h2d GB/s"),
                    ("cuda_graphs_compute_wait_ms_per_forward", "offload wait ms/step")]


def environment() -> dict[str, Any]:
    """Versions and device of this run (for the results header)."""
    import torch

    versions = {}
    for name in ("torch", "triton", "transformers", "peft", "lightning", "liger-kernel", "unsloth", "unsloth-zoo"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "versions": versions,
        # the CUDA allocator's settings every row starts with (the CLI's default, or the user's)
        "allocator": allocator_settings(),
        "command": " ".join(["python", "-m", "lightning_ft", "bench", *sys.argv[1:]]),
    }


def run_bench(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run every (seq_len, system) of ``cfg`` and write the result files to ``cfg.out_dir`` (null: Hydra's run folder).

    Raises:
        ValueError: an unknown system name, a key that is not in the config (`command_schema`) or a value of the
            wrong type, counts that measure nothing (`_check_counts`), a CUDA device on a machine without one.
        BenchFailed: no row ran (each crashed, timed out or failed to start; an OOM row counts as run), after the
            result files are written.
    """
    from lightning_ft.bench.flops import measured_peak_flops

    import torch

    matched = cfg.get("memory_matched")
    if matched is not None and (matched not in SYSTEMS or matched == "lightning_ft" or "lightning_ft" not in cfg.systems):
        raise ValueError(
            f"memory_matched={matched}: expected a peer ({', '.join(s for s in SYSTEMS if s != 'lightning_ft')}) whose "
            "measured peak becomes lightning_ft's strategy.memory_budget_gib, with lightning_ft in systems"
        )
    unknown = [s for s in cfg.systems if s not in SYSTEMS]
    if unknown:
        close = sorted({c for s in unknown for c in difflib.get_close_matches(str(s), list(SYSTEMS), n=1)})
        suggestion = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"systems: unknown {unknown}; {suggestion}known: {list(SYSTEMS)}")
    schema = OmegaConf.structured(command_schema("bench"))
    try:  # the keys as `fit` reads the shared groups: a typo (`+warmup_step=`) or a bad value would be ignored or measure something else
        OmegaConf.merge(schema, cfg)
    except (ConfigKeyError, ValidationError) as err:
        raise ValueError(key_hint(err.full_key, schema) or f"{err.full_key}: {err.msg.splitlines()[0]}") from None
    _check_counts(cfg)
    if str(cfg.device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device={cfg.device}, but this machine has no CUDA GPU: run the CPU preset (+bench=tiny_cpu: a tiny model; "
            "the GPU presets' real shapes do not fit a CPU run)"
        )
    from hydra.core.hydra_config import HydraConfig

    if cfg.name is None:  # null defaults, so that --help shows no unresolved ${hydra:...}
        cfg.name = HydraConfig.get().runtime.choices.model
    if cfg.out_dir is None:
        cfg.out_dir = HydraConfig.get().runtime.output_dir
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_config = OmegaConf.to_container(cfg.model.config, resolve=True)
    if cfg.num_layers:
        model_config["num_hidden_layers"] = cfg.num_layers
    table_path, table_name = _table_target(cfg)
    peak = measured_peak_flops(cfg.device)
    env = {**environment(), "peak_bf16_tflops": peak / 1e12 if peak else None}
    log.info("bench: %s on %s, peak %s", cfg.name, env["device"], _peak_text(env["peak_bf16_tflops"], cfg.device))
    config = OmegaConf.to_container(cfg, resolve=True)
    commit = results_table.git_commit() if table_path else None
    rows = []
    systems = list(cfg.systems) if matched is None else [matched, *(s for s in cfg.systems if s != matched)]  # the peer first
    for seq_len in cfg.seq_lens:
        peer: dict[str, Any] | None = None
        for system in systems:
            spec = {
                "system": system,
                "model": cfg.name,
                "seq_len": seq_len,
                "model_config": model_config,
                "model_options": {k: cfg.model[k] for k in ("attention", "quantization") if k in cfg.model},
                "strategy": OmegaConf.to_container(cfg.strategy, resolve=True),
                "lora": OmegaConf.to_container(cfg.lora, resolve=True),
                "kernels": OmegaConf.to_container(cfg.kernels, resolve=True),
                "moe": OmegaConf.to_container(cfg.moe, resolve=True),
                "dtype": cfg.dtype,
                "device": cfg.device,
                "gradient_checkpointing": cfg.gradient_checkpointing,
                "warmup_steps": cfg.warmup_steps,
                "timed_steps": cfg.timed_steps,
                "peak_flops": peak,
                "profile": str(out_dir / f"profile_{system}_{seq_len}.txt") if cfg.profile else None,
            }
            output = out_dir / f"worker_{system}_{seq_len}.log"  # its whole output: the plan table, warnings, a traceback
            if matched is not None and system == "lightning_ft":
                row = _memory_matched(spec, peer, matched, cfg.timeout_s, output)
            else:
                row = _run_worker(spec, cfg.timeout_s, output)
            if system == matched:
                peer = row
            log.info("bench row: %s", row_text(row))
            rows.append(row)
            _write(out_dir, env, _with_ratios(rows), cfg)
            if table_path:
                results_table.append_rows(table_path, results_table.table_rows(env, config, [row], table_name, commit))
    log.info("bench: results in %s (results.md, results.json, results.png)", out_dir)
    if table_path:
        where = f"table {table_name!r}" if table_name else "history only: set table=NAME to give them a RESULTS.md table"
        report = "" if table_path == results_table.repository_table() else f" --table {table_path}"
        log.info("bench: %d rows appended to %s (%s); `python -m lightning_ft bench report%s` regenerates RESULTS.md",
                 len(rows), table_path, where, report)
    if rows and not any(r.get("status") in ("ok", "OOM") for r in rows):
        statuses = "; ".join(sorted({f"{r['system']}: {r['status']}" for r in rows}))[:600]
        raise BenchFailed(f"bench: no row ran ({statuses}); each row's output is in {out_dir}/worker_<system>_<seq_len>.log")
    return _with_ratios(rows)


def _check_counts(cfg: DictConfig) -> None:
    """Refuse, before any worker starts, the counts a run cannot measure with: ``seq_lens`` a non-empty list of
    positive integers, ``timed_steps`` ≥ 1, ``warmup_steps`` ≥ 0, ``num_layers`` null or ≥ 1 (a ValueError naming
    the key)."""
    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    seq_lens = cfg.get("seq_lens")
    if not isinstance(seq_lens, (list, ListConfig)) or not seq_lens or not all(count(n) and n > 0 for n in seq_lens):
        raise ValueError(f"seq_lens={seq_lens}: expected a list of token counts, such as seq_lens=[2048,8192]")
    for key, least in (("timed_steps", 1), ("warmup_steps", 0)):
        if not count(value := cfg.get(key)) or value < least:
            raise ValueError(f"{key}={value}: expected an integer of at least {least}")
    if (layers := cfg.get("num_layers")) is not None and (not count(layers) or layers < 1):
        raise ValueError(f"num_layers={layers}: expected an integer of at least 1 (null: the model's own depth)")


#: overrides that leave a preset's measurement as it is (which lengths and systems, how many steps, where output goes)
_SAME_MEASUREMENT = {"seq_lens", "systems", "warmup_steps", "timed_steps", "timeout_s", "out_dir", "name", "results_table",
                     "table", "memory_matched"}  # memory_matched: its rows say so (`lightning_ft.bench.table`'s column)


def _table_target(cfg: DictConfig) -> tuple[Path | None, str]:
    """Where the rows go: (the results table's path or None, the RESULTS.md table they belong to).

    ``results_table``: ``auto`` is the repository's ``benchmarks/results.csv`` for a run on CUDA from a git checkout
    (`lightning_ft.bench.table.repository_table`), else nothing; ``null`` or ``false``: nothing; else a path.
    ``table``: null is the preset's name (``+bench=NAME``) when the other overrides leave the preset's measurement as
    it is (`_SAME_MEASUREMENT`), else empty (the rows are history, in no RESULTS.md table).
    """
    target = cfg.get("results_table", "auto")
    if target in (None, False, "", "none", "false"):
        path = None
    elif target == "auto":
        path = results_table.repository_table() if str(cfg.device).startswith("cuda") else None
    else:
        path = Path(str(target))
    name = cfg.get("table")
    if name is None:
        name = ""
        try:
            from hydra.core.hydra_config import HydraConfig

            hydra_cfg = HydraConfig.get()
        except ValueError:  # composed outside a Hydra run (tests)
            hydra_cfg = None
        if hydra_cfg is not None:
            overrides = [o.lstrip("+~") for o in hydra_cfg.overrides.task]
            preset = next((o.split("=", 1)[1] for o in overrides if o.startswith("bench=")), None)
            if preset and all(o.split("=", 1)[0] in _SAME_MEASUREMENT | {"bench"} or o.startswith("hydra.") for o in overrides):
                name = preset
    return path, str(name)


def _memory_matched(spec: dict[str, Any], peer: dict[str, Any], matched: str, timeout_s: int, log: Path) -> dict[str, Any]:
    """``lightning_ft``'s row with ``strategy.memory_budget_gib`` = the ``peer`` row's peak (allocated, GiB); not run
    (a row saying why) where the peer measured none."""
    budget = peer.get("peak_mem_gib") if peer.get("status") == "ok" else None
    record = {"memory_matched": matched, "memory_budget_gib": budget}
    if budget is None:
        why = peer.get("status") if peer.get("status") != "ok" else "no peak memory: not on CUDA"
        return {**_row_base(spec), "status": f"not run: memory_matched={matched} measured no peak ({why})", **record}
    spec = {**spec, "strategy": {**spec["strategy"], "memory_budget_gib": budget}}
    return {**_run_worker(spec, timeout_s, log), **record}


def _row_base(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: spec[k] for k in ("system", "model", "seq_len")} | {"layers": spec["model_config"]["num_hidden_layers"]}


def _run_worker(spec: dict[str, Any], timeout_s: int, log: Path) -> dict[str, Any]:
    """One row from a worker subprocess; its stdout and stderr go to ``log`` (also on a timeout)."""
    cmd = [sys.executable, "-m", "lightning_ft.bench.worker", json.dumps(spec)]
    base = _row_base(spec)
    try:
        with open(log, "w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout_s,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {**base, "status": f"timeout after {timeout_s} s"}
    output = log.read_text()
    for line in reversed(output.splitlines()):
        if line.startswith(ROW_PREFIX):
            return json.loads(line[len(ROW_PREFIX) :])
    tail = output.strip().splitlines()[-3:]
    return {**base, "status": f"crashed (exit {proc.returncode}): {' | '.join(tail)}"[:300]}


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add tokens/s and peak-memory ratios against the ``hf_peft`` row of the same length."""
    base = {r["seq_len"]: r for r in rows if r["system"] == "hf_peft" and r.get("status") == "ok"}
    out = []
    for r in rows:
        b = base.get(r["seq_len"])
        ok = r.get("status") == "ok" and b is not None
        out.append({
            **r,
            "x_vs_hf_peft": r["tokens_per_s"] / b["tokens_per_s"] if ok else None,
            "mem_vs_hf_peft": r["peak_mem_gib"] / b["peak_mem_gib"] if ok and r.get("peak_mem_gib") and b.get("peak_mem_gib") else None,
        })
    return out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (numbers rounded for reading)."""

    def fmt(key: str, value: Any) -> str:
        if value is None:
            return "–"
        if isinstance(value, float):
            return f"{100 * value:.1f}%" if key == "mfu" else f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    columns = _COLUMNS + [c for c in _PROFILE_COLUMNS if any(c[0] in r for r in rows)]
    lines = ["| " + " | ".join(title for _, title in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(k, r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def row_text(row: dict[str, Any]) -> str:
    """A result row as the log prints it, e.g. ``lightning_ft seq 8192: 172.4 ms/step, 47,519 tokens/s, MFU 51.3%,
    peak 19.21 GiB allocated / 21.47 GiB reserved, loss 12.2077``: n/a where a value is unknown (MFU and memory
    on the CPU), the status instead of numbers for a row that did not run (OOM, an error, a timeout)."""

    def fmt(key: str, spec: str) -> str:
        return "n/a" if row.get(key) is None else format(row[key], spec)

    head = f"{row['system']} seq {row['seq_len']}"
    if row.get("status") != "ok":
        return f"{head}: {row.get('status')}"
    memory = (("peak_mem_gib", "allocated"), ("peak_reserved_gib", "reserved"))
    peak = " / ".join(f"{row[key]:.2f} GiB {what}" for key, what in memory if row.get(key) is not None) or "n/a"
    return (f"{head}: {fmt('ms_per_step', '.1f')} ms/step, {fmt('tokens_per_s', ',.0f')} tokens/s, MFU {fmt('mfu', '.1%')}, "
            f"peak {peak}, loss {fmt('loss_last', '.4f')}")


def _peak_text(tflops: float | None, device: str) -> str:
    """The measured bf16 matmul peak as the log and results.md print it (`measured_peak_flops` measures
    it on CUDA only: ``n/a (CPU)`` on the CPU)."""
    return f"{tflops:.0f} TFLOP/s" if tflops else f"n/a ({device.upper()})"


def _write(out_dir: Path, env: dict[str, Any], rows: list[dict[str, Any]], cfg: DictConfig) -> None:
    write_json_atomic(out_dir / "results.json", {"environment": env, "config": OmegaConf.to_container(cfg, resolve=True), "rows": rows})
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    peak = _peak_text(env["peak_bf16_tflops"], cfg.device)
    header = f"## {cfg.name}: {env['date']}, {env['device']}\n\n{versions}; measured bf16 peak {peak}. `{env['command']}`\n\n"
    (out_dir / "results.md").write_text(header + markdown_table(rows) + "\n")
    _plot(rows, out_dir / "results.png", cfg.name)


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120)
    for system in dict.fromkeys(r["system"] for r in rows):
        ok = [r for r in rows if r["system"] == system and r.get("status") == "ok"]
        if not ok:
            continue
        seqs = [r["seq_len"] for r in ok]
        axes[0].plot(seqs, [r["tokens_per_s"] for r in ok], marker="o", label=system)
        if all(r.get("peak_mem_gib") is not None for r in ok):
            axes[1].plot(seqs, [r["peak_mem_gib"] for r in ok], marker="o", label=system)
    finish_plot(fig, axes, ("tokens/s", "peak memory (GiB)"), title)
    fig.savefig(path)
    plt.close(fig)
