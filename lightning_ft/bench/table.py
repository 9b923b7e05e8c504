"""The results tables: CSV files of measured rows, only ever appended to.

- `STEP` (``benchmarks/results.csv``): one row per measured (system, shape, sequence length) of a
  ``python -m lightning_ft bench`` run, which appends them (`append_rows`).
- `MICRO` (``benchmarks/micro.csv``): one row per (op, mode, shape, provider) of the micro-benchmarks
  ``benchmarks/kernels_bench.py``, ``moe_bench.py`` and ``attention_bench.py`` (``--record PATH``;
  `micro_rows` turns a script's JSON result into rows).
- `DRILL` (``benchmarks/drills.csv``): one row per run of the fault drill ``benchmarks/fault_drill.py``
  (``--record PATH``): runs killed with SIGKILL and resumed, against a run never killed.
- `FIDELITY` (``benchmarks/fidelity.csv``): one row per run of ``benchmarks/fidelity.py`` (``--record PATH``): the
  loss curves and final validation loss of a candidate setting (fp8, the 4-bit base...) against a reference run.

``python -m lightning_ft bench report`` regenerates ``benchmarks/RESULTS.md`` and its plots from them
(`lightning_ft.bench.report`). The schemas live here and nowhere else: each `Schema` has its columns
(name, type, meaning) and a version that goes up whenever they change; a file whose header differs
is refused by `read_rows` and `append_rows` with the missing and unknown column names, but for a file of an
older version whose columns are the first of the current ones (columns are only ever added at the end):
`read_rows` reads its rows with the new columns empty and `append_rows` first rewrites it under the current
header.
"""

from __future__ import annotations

import csv
import math
import os
import platform
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

from lightning_ft.bench.flops import num_experts

SCHEMA_VERSION = 2

#: (column, type, meaning); floats are written with the digits in `_DIGITS`, an unknown value as an empty cell
COLUMNS: tuple[tuple[str, type, str], ...] = (
    ("table", str, "the RESULTS.md table the row belongs to (a preset's name); empty: kept as history only"),
    ("run", str, "the run's id (its UTC start time); rows of one run share it, ratios are taken within a run"),
    ("date", str, "the run's UTC start, YYYY-MM-DD HH:MM"),
    ("commit", str, "git commit of the code measured (`-dirty`: with uncommitted changes; `?`: a row recorded without its "
                    "commit, named by the last commit before the run's date, the tree possibly changed since; "
                    "unknown outside git)"),
    ("gpu", str, "the device's name (the CPU's on a CPU run)"),
    ("system", str, "hf_peft | liger | unsloth | lightning_ft"),
    ("model", str, "the shape's name (the model config option, e.g. qwen3_moe_30b_a3b)"),
    ("layers", int, "decoder layers built"),
    ("seq_len", int, "tokens in the step (one sequence, batch 1)"),
    ("status", str, "ok, OOM, or why the row did not run"),
    ("ms_per_step", float, "median step time of the timed steps (ms)"),
    ("ms_min", float, "fastest timed step (ms)"),
    ("ms_max", float, "slowest timed step (ms)"),
    ("ms_first_step", float, "the first step (compilation, autotuning; not in the median) (ms)"),
    ("tokens_per_s", float, "seq_len / median step time"),
    ("tflops_per_s", float, "counted FLOPs / median step time (lightning_ft/bench/flops.py) (TFLOP/s)"),
    ("mfu", float, "tflops_per_s / the bf16 matmul peak measured at the start of the run (fraction)"),
    ("peak_mem_gib", float, "peak allocated device memory of the row (GiB)"),
    ("peak_reserved_gib", float, "peak memory the CUDA allocator held (allocated + cached) (GiB)"),
    ("loss_last", float, "loss of the last step"),
    ("warmup_steps", int, "steps before the timed ones"),
    ("timed_steps", int, "steps timed"),
    ("settings", str, "what the system measured ran with: dtype, checkpointing, LoRA, and for lightning_ft kernels, MoE and model options"),
    ("command", str, "the bench command line of the run (output folders left out)"),
    ("peak_bf16_tflops", float, "the bf16 matmul peak measured at the start of the run (TFLOP/s)"),
    ("torch", str, "version"),
    ("triton", str, "version"),
    ("transformers", str, "version"),
    ("peft", str, "version"),
    ("lightning", str, "version"),
    ("liger_kernel", str, "version of the peer liger-kernel, if installed"),
    ("unsloth", str, "version of the peer unsloth, if installed"),
    ("unsloth_zoo", str, "version of unsloth-zoo, if installed"),
    ("memory_matched", str, "lightning_ft rows of a memory-matched run (bench memory_matched=SYSTEM): the peer whose measured "
                            "peak, in the same run and length, was the memory budget"),
    ("memory_budget_gib", float, "the strategy.memory_budget_gib the row ran with: the matched peer's peak allocated memory (GiB)"),
)
COLUMN_NAMES = tuple(name for name, _, _ in COLUMNS)
#: the columns every appended row must have
REQUIRED = ("run", "date", "commit", "gpu", "system", "model", "layers", "seq_len", "status")

MICRO_COLUMNS: tuple[tuple[str, type, str], ...] = (
    ("table", str, "the script: kernels | moe | attention"),
    ("run", str, "the run's id (its start time); ratios are taken within a run"),
    ("date", str, "the run's start, YYYY-MM-DD HH:MM"),
    ("commit", str, "git commit of the code measured (as in the step table)"),
    ("gpu", str, "the device's name"),
    ("op", str, "what is timed: a fused op (rms_norm, rope, swiglu, linear_ce), moe_block, routing, attention_cache, attention_padding"),
    ("mode", str, "fwd | fwd+bwd (+ cuda_graphs when the script replays them)"),
    ("shape", str, "the op's input shape and dtype, or the model, tokens and documents"),
    ("provider", str, "the implementation: ours | reference | liger; an experts backend; an attention backend:variant"),
    ("ms", float, "median time of the timed calls (ms)"),
    ("gbps", float, "bytes moved / ms, for memory-bound ops (GB/s)"),
    ("tflops", float, "counted FLOPs / ms, for matmul-bound ops (TFLOP/s)"),
    ("tokens_per_s", float, "real (unpadded) tokens / second"),
    ("peak_mib", float, "peak allocated device memory of the call (MiB)"),
    ("command", str, "the script's command line (output paths left out)"),
    ("torch", str, "version"),
    ("triton", str, "version"),
    ("transformers", str, "version"),
    ("peft", str, "version"),
    ("lightning", str, "version"),
    ("liger_kernel", str, "version of liger-kernel, if installed"),
)


DRILL_COLUMNS: tuple[tuple[str, type, str], ...] = (
    ("table", str, "fault_drill"),
    ("run", str, "the drill's id (its UTC start time)"),
    ("date", str, "the drill's UTC start, YYYY-MM-DD HH:MM"),
    ("commit", str, "git commit of the code drilled (as in the step table)"),
    ("machine", str, "the CPU's name and the cores the drill could use"),
    ("steps", int, "trainer.max_steps of the drilled run (a checkpoint after every step)"),
    ("seed", int, "the seed that picked the kill points"),
    ("kills", int, "runs killed with SIGKILL (each then resumed)"),
    ("kills_step", int, "kills at a random time inside an optimizer step"),
    ("kills_checkpoint", int, "kills while a checkpoint's temporary file was being written"),
    ("kills_export", int, "kills while the adapter was being exported"),
    ("partial_writes_left", int, "kills that left an unfinished temporary file (*.tmp): landed mid-write"),
    ("restarted", int, "kills before the first checkpoint: run again from the start, not resumed"),
    ("resumed", int, "resumed (or restarted) runs that completed"),
    ("equal_losses", int, "runs whose per-step losses are bitwise those of the run never killed"),
    ("equal_adapter", int, "runs whose adapter weights are bitwise those of the run never killed"),
    ("unreadable", int, "checkpoints or adapter files that did not load, after a kill or after its resume"),
    ("max_loss_diff", float, "largest per-step loss difference from the run never killed"),
    ("max_adapter_diff", float, "largest adapter weight difference from the run never killed"),
    ("wall_s", float, "the drill's wall time (s)"),
    ("command", str, "the drill's command line (output paths left out)"),
    ("torch", str, "version"),
    ("transformers", str, "version"),
    ("peft", str, "version"),
    ("lightning", str, "version"),
)


FIDELITY_COLUMNS: tuple[tuple[str, type, str], ...] = (
    ("table", str, "fidelity"),
    ("run", str, "the check's id (its UTC start time)"),
    ("date", str, "the check's UTC start, YYYY-MM-DD HH:MM"),
    ("commit", str, "git commit of the code checked (as in the step table)"),
    ("machine", str, "the GPU's name (else the CPU's and its cores) the runs trained on"),
    ("name", str, "what is checked: fp8 | qlora | ..."),
    ("reference", str, "the reference run's overrides"),
    ("candidate", str, "the candidate run's overrides"),
    ("steps", int, "optimizer steps of each run"),
    ("window", int, "steps in the trailing mean that smooths each loss curve"),
    ("every", int, "the curves are compared at every this many steps"),
    ("max_curve_rel_diff", float, "largest |candidate - reference| / reference of the smoothed training loss"),
    ("at_step", int, "the step (1-based) of that largest difference"),
    ("curve_tol", float, "the bound on max_curve_rel_diff"),
    ("val_loss_reference", float, "the reference run's final validation loss"),
    ("val_loss_candidate", float, "the candidate run's final validation loss"),
    ("val_rel_diff", float, "|candidate - reference| / reference of the final validation loss"),
    ("val_tol", float, "the bound on val_rel_diff"),
    ("passed", int, "1: both differences within their bounds, else 0"),
    ("tokens_per_s_reference", float, "the reference run's training tokens/s (summary.json)"),
    ("tokens_per_s_candidate", float, "the candidate run's training tokens/s (summary.json)"),
    ("wall_s", float, "the check's wall time (s)"),
    ("command", str, "the check's command line (output paths left out)"),
    ("torch", str, "version"),
    ("transformers", str, "version"),
    ("peft", str, "version"),
    ("lightning", str, "version"),
)

@dataclass(frozen=True)
class Schema:
    """A table's columns (name, type, meaning), the columns an appended row must fill, and its version."""

    name: str
    version: int
    columns: tuple[tuple[str, type, str], ...]
    required: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.columns)

    @property
    def types(self) -> dict[str, type]:
        return {name: kind for name, kind, _ in self.columns}


STEP = Schema("step", SCHEMA_VERSION, COLUMNS, REQUIRED)
MICRO = Schema("micro", 1, MICRO_COLUMNS, ("table", "run", "date", "commit", "gpu", "op", "mode", "shape", "provider"))
DRILL = Schema("drill", 1, DRILL_COLUMNS, ("table", "run", "date", "commit", "machine", "kills", "resumed"))
FIDELITY = Schema("fidelity", 1, FIDELITY_COLUMNS, ("table", "run", "date", "commit", "machine", "name", "steps", "passed"))
#: the distributions whose versions are recorded, and their columns
VERSIONED = {"torch": "torch", "triton": "triton", "transformers": "transformers", "peft": "peft", "lightning": "lightning",
             "liger-kernel": "liger_kernel", "unsloth": "unsloth", "unsloth-zoo": "unsloth_zoo"}
#: decimals written per float column (rounded so that the file reads and diffs well); 3 for the others
_DIGITS = {"mfu": 4, "loss_last": 4, "tokens_per_s": 1, "tflops_per_s": 2, "peak_bf16_tflops": 1, "gbps": 1, "tflops": 2,
           "peak_mib": 1, "ms": 4}
#: float columns written with 3 significant digits (differences that may be tiny, zero or inf)
_SIGNIFICANT = ("max_loss_diff", "max_adapter_diff", "max_curve_rel_diff", "val_rel_diff")


class TableError(ValueError):
    """A table file or a row that does not match `COLUMNS`."""


def _schema_text(schema: Schema) -> str:
    return f"the {schema.name} table's schema (version {schema.version})"


def _older(header: list[str], schema: Schema) -> bool:
    """Whether ``header`` is an older version's: the schema's first columns (columns are added at the end)."""
    return 0 < len(header) < len(schema.names) and tuple(header) == schema.names[: len(header)]


def _check_header(header: list[str], path: Path, schema: Schema) -> None:
    if tuple(header) == schema.names or _older(header, schema):
        return
    missing = [c for c in schema.names if c not in header]
    unknown = [c for c in header if c not in schema.names]
    what = "; ".join(part for part in (f"missing columns {missing}" if missing else "",
                                       f"unknown columns {unknown}" if unknown else "") if part) or "the columns in another order"
    raise TableError(f"{path}: the header does not match {_schema_text(schema)}: {what}; "
                     f"the columns are defined in lightning_ft/bench/table.py")


def _cell(name: str, value: Any, schema: Schema) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    kind = schema.types[name]
    if kind is float:
        return f"{float(value):.3g}" if name in _SIGNIFICANT else f"{float(value):.{_DIGITS.get(name, 3)}f}"
    if kind is int:
        return str(int(value))
    return " ".join(str(value).split())  # one line per row


def _parse(name: str, text: str, schema: Schema) -> Any:
    if text == "":
        return None
    kind = schema.types[name]
    return kind(float(text)) if kind is int else kind(text)


def read_rows(path: str | Path, schema: Schema = STEP) -> list[dict[str, Any]]:
    """The table's rows in file order, values typed per the schema's columns (None for an empty cell).

    Raises:
        FileNotFoundError: no file at ``path``.
        TableError: the header differs from the schema's columns (the message names the missing and unknown columns).
    """
    path = Path(path)
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return []
        _check_header(header, path, schema)
        pad = [""] * (len(schema.names) - len(header))  # an older version's file: its rows lack the new columns
        return [{name: _parse(name, cell, schema) for name, cell in zip(schema.names, line + pad)} for line in reader if line]


def append_rows(path: str | Path, rows: Iterable[dict[str, Any]], schema: Schema = STEP) -> int:
    """Append ``rows`` to the table at ``path`` (created with its header if absent); returns how many.

    Each row is a dict keyed by column names; a column left out is written empty.

    Raises:
        TableError: a row with a key that is not a column or without one of the schema's required columns, or an
            existing file whose header differs from the schema's; nothing is written then. The message names the
            columns and the file.
    """
    path = Path(path)
    rows = list(rows)
    types = schema.types
    for i, row in enumerate(rows):
        unknown = [k for k in row if k not in types]
        missing = [k for k in schema.required if row.get(k) in (None, "")]
        if unknown or missing:
            what = "; ".join(p for p in (f"unknown columns {unknown}" if unknown else "",
                                         f"missing columns {missing}" if missing else "") if p)
            raise TableError(f"{path}: row {i} does not match {_schema_text(schema)}: {what}; "
                             f"the columns are defined in lightning_ft/bench/table.py")
    exists = path.exists() and path.stat().st_size > 0
    if exists:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        _check_header(header, path, schema)
        if _older(header, schema):  # rewritten under the current header, the new columns empty
            from lightning_ft.atomic import atomic_file

            with path.open(newline="") as f:
                lines = [line for line in csv.reader(f) if line][1:]
            pad = [""] * (len(schema.names) - len(header))  # every cell kept as written
            with atomic_file(path) as f:
                f.write(_csv_text([schema.names, *(line + pad for line in lines)]).encode())
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        if not exists:
            writer.writerow(schema.names)
        writer.writerows([_cell(name, row.get(name), schema) for name in schema.names] for row in rows)
    return len(rows)


def _csv_text(lines: Iterable[Iterable[str]]) -> str:
    import io

    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(lines)
    return out.getvalue()


def machine() -> str:
    """The CPU's model name and the cores this process may use (``/proc/cpuinfo``; else the platform's name)."""
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def git_commit(cwd: str | Path | None = None) -> str:
    """``git rev-parse --short HEAD`` of the checkout holding ``cwd`` (default: this package), with ``-dirty`` when
    tracked files have uncommitted changes; ``unknown`` outside a git checkout or without git."""
    cwd = Path(cwd) if cwd else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=30)
        if commit.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def repository_table() -> Path | None:
    """The repository's ``benchmarks/results.csv`` when this package runs from a git checkout of the repository
    (a source tree with ``benchmarks/`` beside the package and a commit), else None (an installed package)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks").is_dir() or git_commit(root) == "unknown":
        return None
    return root / "benchmarks" / "results.csv"


def versions() -> dict[str, str | None]:
    """The installed versions of `VERSIONED`, by column (None where not installed)."""
    out = {}
    for dist, column in VERSIONED.items():
        try:
            out[column] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[column] = None
    return out


def settings_text(config: dict[str, Any], system: str, graphed: bool | None = None) -> str:
    """What ``system`` ran with, in one compact line from a bench config (``results.json``'s ``config``), e.g.
    ``bf16 ckpt lora=r16a32:q,k,v,o+experts kernels=rms_norm,rope,swiglu,lora,flce moe=auto graphs=keep:attn,proj``.

    Every system: dtype, gradient checkpointing, the 4-bit base (``nf4``), LoRA rank/alpha/targets. ``lightning_ft`` also: the kernels on, the
    MoE backend (MoE shapes), attention, CUDA graphs (when on) and what they keep, activation offload, fp8 (``fp8+head``:
    the lm_head too). A key the config lacks is left out. ``graphed``: whether the row's layers replayed CUDA graphs (its ``cuda_graphs_*`` columns), which
    ``strategy.cuda_graphs=auto`` decides per run; None: unknown, taken as on."""
    parts = [{"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(config.get("dtype"), str(config.get("dtype")))]
    if config.get("gradient_checkpointing"):
        parts.append("ckpt")
    lora = config.get("lora") or {}
    if ((config.get("model") or {}).get("quantization") or "none") != "none":
        parts.append(config["model"]["quantization"])
    if lora.get("enabled", True):
        targets = lora.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else [t.removesuffix("_proj") for t in targets]
        if lora.get("target_parameters"):
            targets.append("experts")
        parts.append(f"lora=r{lora.get('rank')}a{lora.get('alpha')}:{','.join(targets)}")
    else:
        parts.append("full")
    if system != "lightning_ft":
        return " ".join(parts)
    kernels = config.get("kernels") or {}
    short = {"fused_linear_cross_entropy": "flce"}
    parts.append("kernels=" + (",".join(short.get(k, k) for k, on in kernels.items() if on) or "none"))
    model_cfg = (config.get("model") or {}).get("config") or {}
    moe = config.get("moe") or {}
    if num_experts(model_cfg) and moe:
        parts.append(f"moe={moe.get('backend')}" + ("" if moe.get("lora_slots", True) else ",no_slots"))
    model = config.get("model") or {}
    if model.get("attention") not in (None, "auto"):
        parts.append(f"attn={model['attention']}")
    from lightning_ft.config import MOVED_KEYS

    # the strategy's options; a config recorded before they moved there has them under model
    strategy = config.get("strategy") or {
        new.split(".")[1]: model[old.split(".")[1]] for old, new in MOVED_KEYS.items() if old.split(".")[1] in model
    }
    if strategy.get("cuda_graphs") is True or (strategy.get("cuda_graphs") == "auto" and graphed is not False):  # off: nothing said
        graphs = "graphs"
        if "keep_attention" not in strategy:  # a recorded config without the keep options: nothing kept
            parts.append(graphs)
        else:
            keep = [name for key, name in (("keep_attention", "attn"), ("keep_projections", "proj")) if strategy.get(key)]
            limit = strategy.get("keep_max_gib")
            parts.append(f"{graphs}=keep:{','.join(keep) or 'none'}" + (f"<={limit}GiB" if limit else ""))
    if strategy.get("activation_offload"):
        parts.append("offload")
    if strategy.get("fp8"):
        parts.append("fp8+head" if strategy.get("fp8_lm_head") else "fp8")
    return " ".join(parts)


#: command-line items left out of the recorded command: where the output went, not what was measured
_OUTPUT_KEYS = ("hydra.run.dir=", "out_dir=", "results_table=", "timeout_s=")
#: the same for the micro-benchmark scripts: flags followed by a path
_OUTPUT_FLAGS = ("--out", "--record", "--data", "--work")


def command_text(command: str) -> str:
    """The command line without the items that only say where output goes (`_OUTPUT_KEYS`, `_OUTPUT_FLAGS` and their
    values) or where input comes from."""
    items, out = command.split(), []
    skip = False
    for item in items:
        if skip:
            skip = False
        elif item in _OUTPUT_FLAGS:
            skip = True
        elif not item.lstrip("+").startswith(_OUTPUT_KEYS) and not item.startswith(tuple(f"{f}=" for f in _OUTPUT_FLAGS)):
            out.append(item)
    return " ".join(out)


def table_rows(env: dict[str, Any], config: dict[str, Any], rows: list[dict[str, Any]], table: str, commit: str,
               run: str | None = None) -> list[dict[str, Any]]:
    """The table's rows for a run's ``results.json`` parts: its ``environment``, ``config`` and result ``rows``."""
    versions_by_dist = env.get("versions") or {}
    common = {
        "table": table,
        "run": run or env["date"].removesuffix(" UTC").replace(" ", "T") + "Z",
        "date": env["date"].removesuffix(" UTC")[:16],
        "commit": commit,
        "gpu": env.get("device"),
        "command": command_text(env.get("command", "")),
        "peak_bf16_tflops": env.get("peak_bf16_tflops"),
        "warmup_steps": config.get("warmup_steps"),
        "timed_steps": config.get("timed_steps"),
        **{column: versions_by_dist.get(dist) for dist, column in VERSIONED.items()},
    }
    return [{**common, **{k: row.get(k) for k in COLUMN_NAMES if k in row},
             "settings": settings_text(config, row["system"], graphed=_graphed(row))} for row in rows]


def _graphed(row: dict[str, Any]) -> bool:
    """Whether a result row's layers replayed CUDA graphs: the bench worker adds the ``cuda_graphs_*`` statistics
    (`lightning_ft.strategies.cuda_graphs.cuda_graph_stats`) only then."""
    return any(key.startswith("cuda_graphs_") and value is not None for key, value in row.items())


#: each micro-benchmark script's command line, where its JSON does not record one
MICRO_COMMANDS = {"kernels": "python benchmarks/kernels_bench.py", "moe": "python benchmarks/moe_bench.py",
                  "attention": "python benchmarks/attention_bench.py",
                  "attention_kernels": "python benchmarks/attention_kernels_bench.py"}


def micro_rows(bench: str, result: dict[str, Any], commit: str) -> list[dict[str, Any]]:
    """The `MICRO` rows of a micro-benchmark script's JSON ``result`` (``bench``: kernels | moe | attention | attention_kernels); none for
    a ``--smoke`` run (tiny shapes on the CPU check the script, they measure nothing)."""
    if result.get("smoke"):
        return []
    versions_by_name = {k.replace("-", "_"): v for k, v in (result.get("versions") or {}).items()}
    command = command_text(result.get("command") or MICRO_COMMANDS[bench])
    common = {"table": bench, "run": result["date"].replace(" ", "T")[:19], "date": result["date"][:16], "commit": commit,
              "gpu": result.get("device"), "command": command,
              **{c: versions_by_name.get(c) for c in ("torch", "triton", "transformers", "peft", "lightning", "liger_kernel")}}
    rows = []
    if bench == "kernels":
        for r in result["rows"]:
            rows.append({**common, "op": r["op"], "mode": r["mode"], "shape": r["shape"], "provider": r["impl"], "ms": r["ms"],
                         "gbps": r.get("gbps"), "tflops": r.get("tflops"), "peak_mib": r.get("peak_mib")})
    elif bench == "moe":
        sh = result.get("shape") or {}
        dims = (f"H={sh.get('hidden_size')} I={sh.get('moe_intermediate_size')} E={sh.get('num_experts')} "
                f"k={sh.get('num_experts_per_tok')} r={sh.get('lora_rank')} {result.get('dtype', '')}").strip()
        for r in result["rows"]:
            op = "routing" if r["impl"].startswith("routing") else "moe_block"
            for mode, key in (("fwd", "fwd_ms"), ("fwd+bwd", "fwd_bwd_ms")):
                if r.get(key) is not None:
                    rows.append({**common, "op": op, "mode": mode, "shape": f"T={r['tokens']} {dims}", "provider": r["impl"],
                                 "ms": r[key], "peak_mib": r.get("peak_mib") if mode == "fwd+bwd" else None})
    elif bench == "attention":
        mode = "fwd+bwd" + (" cuda_graphs" if "--cuda-graphs" in (result.get("command") or "") else "")
        documents = "sampled" if "sampled" in (result.get("documents") or "sampled") else "gsm8k"
        for r in result["rows"]:
            if r.get("skipped") or r.get("ms") is None:
                continue
            rows.append({**common, "op": f"attention_{r['section']}", "mode": mode,
                         "shape": f"{r['model']} T={r['tokens']} docs={r['docs']} ({documents})", "provider": f"{r['backend']}:{r['variant']}",
                         "ms": r["ms"], "tokens_per_s": r.get("tokens_per_s"),
                         "peak_mib": r["peak_gib"] * 1024 if r.get("peak_gib") is not None else None})
    elif bench == "attention_kernels":
        Hq, Hkv, D = result["heads"]
        for r in result["rows"]:
            if r.get("ms") is not None:
                rows.append({**common, "op": "attention", "mode": "fwd+bwd",
                             "shape": f"{r['layout']} T={r['tokens']} docs={r['docs']} {Hq}q/{Hkv}kv heads of {D}",
                             "provider": r["provider"], "ms": r["ms"], "tflops": r["tflops"]})
    else:
        raise ValueError(f"unknown micro-benchmark {bench!r}: one of {sorted(MICRO_COMMANDS)}")
    return rows
