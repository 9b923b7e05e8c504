"""``python -m lightning_ft bench report``: regenerate ``benchmarks/RESULTS.md`` and its plots from the results tables.

It leads with speed at equal memory, where memory-matched rows exist (bench ``memory_matched=SYSTEM``):
each such ``lightning_ft`` row beside the peer whose measured peak was its memory budget, same run and
length (`equal_memory_section`). For each table (the ``table`` column, one per bench preset) the report
shows the latest row of each (system, variant, layers, seq_len, memory_matched): date order, and file order among rows of the same date. Each row's ratios
(× ``hf_peft``, × ``unsloth``, memory) are against the peer's row of the same run and length; a
peer that did not run in that run gives no ratio. The table's text is the leading comment of its
preset (``configs/bench/<table>.yaml``); the plot (tokens/s and peak memory against the length)
goes to ``<plots>/<table>.png``. The micro-benchmarks' table (``micro.csv``) follows, one section per
script with the latest row of each (op, mode, shape, provider), then the fidelity checks (``fidelity.csv``) and the
fault drills (``drills.csv``), every row. The same table files give the same RESULTS.md and PNGs.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path
from typing import Any

from lightning_ft.bench.table import COLUMNS, DRILL, FIDELITY, MICRO, MICRO_COMMANDS, read_rows

#: the order of the sections (tables not listed follow, by name)
TABLE_ORDER = ("qwen3_moe", "qwen3_moe_long", "unsloth_qwen3_moe", "llama8b", "unsloth_llama8b")
SYSTEM_ORDER = ("hf_peft", "liger", "unsloth", "lightning_ft")
#: the peers a row's speed and memory are compared with, where they ran
PEERS = ("hf_peft", "unsloth")
#: the micro-benchmark sections, their titles and the provider each row's time is compared with (same run, op, mode, shape)
MICRO_SECTIONS = {"kernels": ("Fused kernels", "reference"), "moe": ("One MoE block", "hf_peft"),
                  "attention": ("Packed attention", None),
                  "attention_kernels": ("Attention kernels per row layout (Llama-3.1-8B heads, fwd+bwd)", "cudnn_alone")}
INTRO = """\
Training-step benchmarks of `lightning_ft` against stock transformers + PEFT (`hf_peft`, the
baseline of every ratio) and the peers Liger Kernel (`liger`) and Unsloth (`unsloth`): one sequence
of random tokens, batch 1, random weights of the named shape, LoRA, the median of the timed steps.
MFU counts the step's matmul and attention FLOPs (`lightning_ft/bench/flops.py`) against the bf16
matmul rate measured at the start of the run. Peak memory is the device's peak allocated memory of
the row (reserved: what the CUDA allocator held). Ratios are taken within one run on one machine:
against the peer's row of the same run and length. Each row names its run's date and commit; a
commit ending in `?` is the last commit before the run's date, for a row recorded without its
commit (its tree may have held uncommitted changes).

This file is generated: `python -m lightning_ft bench report` rebuilds it and the plots from
[results.csv](results.csv), to which every GPU bench run appends its rows (see [README.md](README.md))."""


#: settings tokens that name the frozen base's format: 4-bit NF4, MXFP4 experts, e4m3 (``fp8+head``: the lm_head too)
BASE_FORMATS = ("nf4", "mxfp4", "fp8", "fp8+head")


def variant(row: dict[str, Any]) -> str:
    """The row's settings that pick another path of one system, whose rows are kept apart: the base's format
    (`BASE_FORMATS`) and ``moe=...`` (e.g. ``"moe=triton fp8"``), "" for none."""
    return " ".join(t for t in (row.get("settings") or "").split() if t in BASE_FORMATS or t.startswith("moe="))


def latest_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The latest row of each (system, `variant`, layers, seq_len, memory_matched) of ``rows`` (one table's), by date and
    then file order; sorted by length, then `SYSTEM_ORDER` (a memory-matched row after the system's own), then variant."""
    latest: dict[tuple, dict[str, Any]] = {}
    for index, row in sorted(enumerate(rows), key=lambda item: (item[1]["date"], item[0])):
        latest[(row["system"], variant(row), row["layers"], row["seq_len"], row.get("memory_matched"))] = row
    rank = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    return sorted(latest.values(), key=lambda r: (r["layers"], r["seq_len"], rank.get(r["system"], len(rank)), r["system"],
                                                  r.get("memory_matched") or "", variant(r)))


def _variants_shown(shown: list[dict[str, Any]]) -> set[str]:
    """The systems of ``shown`` with rows of more than one `variant` (their cells name it)."""
    seen: dict[str, set[str]] = {}
    for r in shown:
        seen.setdefault(r["system"], set()).add(variant(r))
    return {system for system, variants in seen.items() if len(variants) > 1}


def _system_cell(row: dict[str, Any], named: set[str] = frozenset()) -> str:
    matched = row.get("memory_matched")
    kind = f" {variant(row)}" if row["system"] in named and variant(row) else ""
    return f"`{row['system']}`{kind}" + (f" at `{matched}`'s memory" if matched else "")


def equal_memory_section(rows: list[dict[str, Any]]) -> list[str]:
    """Speed at equal memory: the latest memory-matched ``lightning_ft`` row of each (table, model, layers, length,
    peer, `variant`) beside the peer's row of its run (whose peak was its budget); [] where there are none. The
    *path* column names the variant (``bf16`` for none), so an fp8 row never reads as the bf16 one."""
    latest: dict[tuple, dict[str, Any]] = {}
    for index, row in sorted(enumerate(rows), key=lambda item: (item[1]["date"], item[0])):
        if row.get("memory_matched") and row["table"]:
            latest[(row["table"], row["model"], row["layers"], row["seq_len"], row["memory_matched"], variant(row))] = row
    if not latest:
        return []
    head = ["table", "model (layers)", "tokens", "peer", "peer tokens/s", "peer peak GiB", "path", "lightning_ft tokens/s", "× peer",
            "lightning_ft peak GiB", "within budget", "run (commit)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if h in ("table", "model (layers)", "peer", "path", "run (commit)") else "---:"
                                                        for h in head) + "|"]
    for r in latest.values():
        peer = _peer(rows, r, r["memory_matched"])
        ok = r["status"] == "ok"
        within = "–" if not ok or r["peak_mem_gib"] is None or r["memory_budget_gib"] is None else (
            "yes" if r["peak_mem_gib"] <= r["memory_budget_gib"] else f"no (+{r['peak_mem_gib'] - r['memory_budget_gib']:.2f})")
        cells = [r["table"], f"{r['model']} ({r['layers']})", str(r["seq_len"]), f"`{r['memory_matched']}`",
                 _num(peer and peer["tokens_per_s"], ",.0f"), _num(peer and peer["peak_mem_gib"], ".2f"),
                 _weights_path(r),
                 _num(r["tokens_per_s"], ",.0f") if ok else r["status"], _ratio(r["tokens_per_s"] if ok else None, peer and peer["tokens_per_s"]),
                 _num(r["peak_mem_gib"] if ok else None, ".2f"), within, f"{r['date'][:10]} ({r['commit']})"]
        lines.append("| " + " | ".join(cells) + " |")
    return ["## Speed at equal memory", "",
            "`lightning_ft` with `strategy.memory_budget_gib` set to the peer's measured peak (allocated) of the same run "
            "and length (`python -m lightning_ft bench +bench=PRESET memory_matched=PEER`): tokens/s at equal memory. *Path*: "
            "the frozen base's format (`bf16`; `nf4`; `fp8`: e4m3, `fp8+head`: the LM head too) and the MoE backend where one was set. "
            "*Within budget*: whether its own measured peak kept to that budget (by how many GiB it went over).", "", *lines, ""]


def _weights_path(row: dict[str, Any]) -> str:
    """The frozen base's format and the row's `variant`: ``nf4``, ``fp8+head``, ``bf16 moe=auto`` (the compute dtype,
    the settings' first word, where the base keeps it)..."""
    settings, tokens = (row.get("settings") or "bf16").split(), variant(row).split()
    return " ".join(tokens if any(t in BASE_FORMATS for t in tokens) else [settings[0], *tokens])


def _peer(rows: list[dict[str, Any]], row: dict[str, Any], system: str) -> dict[str, Any] | None:
    for other in rows:
        if (other["run"], other["system"], other["layers"], other["seq_len"]) == (row["run"], system, row["layers"], row["seq_len"]) \
                and other["status"] == "ok":
            return other
    return None


def _ratio(value: float | None, base: float | None, invert: bool = False) -> str:
    if not value or not base:
        return "–"
    return f"{(base / value if invert else value / base):.2f}×"


def _num(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown_table(shown: list[dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    """The markdown table of the ``shown`` rows, ratios against their peers' rows of the same run among ``rows``."""
    peers = [p for p in PEERS if any(r["system"] == p for r in shown)]
    head = ["tokens", "layers", "system", "ms/step (min–max)", "tokens/s", *[f"× {p}" for p in peers], "MFU",
            "peak GiB allocated / reserved", *[f"memory × {p}" for p in peers], "loss", "run (commit)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if h in ("system", "run (commit)") else "---:" for h in head) + "|"]
    other_run, named = False, _variants_shown(shown)
    for r in shown:
        ok = r["status"] == "ok"
        if ok:
            spread = f" ({r['ms_min']:.1f}–{r['ms_max']:.1f})" if r["ms_min"] is not None and r["ms_max"] is not None else ""
            ms = f"{r['ms_per_step']:.1f}{spread}"
            memory = " / ".join(_num(r[k], ".2f") for k in ("peak_mem_gib", "peak_reserved_gib")) if r["peak_mem_gib"] is not None else "–"
        else:
            ms, memory = r["status"], "–"
        speed, mem = [], []
        for p in peers:
            base = _peer(rows, r, p) if ok else None
            mark = "†" if base is not None and not any(base is s for s in shown) else ""  # the peer's shown row is another run's
            speed.append(_ratio(r["tokens_per_s"], base and base["tokens_per_s"]) + mark)
            mem.append(_ratio(r["peak_mem_gib"], base and base["peak_mem_gib"]) + mark)
            other_run = other_run or bool(mark)
        cells = [str(r["seq_len"]), str(r["layers"]), _system_cell(r, named), ms, _num(r["tokens_per_s"] if ok else None, ",.0f"),
                 *speed, _num(r["mfu"] if ok and r["mfu"] is not None else None, ".1%"), memory, *mem,
                 _num(r["loss_last"] if ok else None, ".4f"), f"{r['date'][:10]} ({r['commit']})"]
        lines.append("| " + " | ".join(cells) + " |")
    if other_run:
        lines += ["", "† against the peer's row of this row's own run; the peer's row shown is from a later run."]
    return "\n".join(lines)


def plot(shown: list[dict[str, Any]], path: Path, title: str) -> None:
    """tokens/s and peak allocated memory against the sequence length, one line per system (the rows that ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    named = _variants_shown(shown)
    for system, matched, kind in dict.fromkeys((r["system"], r.get("memory_matched"), variant(r)) for r in shown):
        ok = sorted((r for r in shown if (r["system"], r.get("memory_matched"), variant(r)) == (system, matched, kind)
                     and r["status"] == "ok"), key=lambda r: r["seq_len"])
        if not ok:
            continue
        seqs = [r["seq_len"] for r in ok]
        label = system + (f" {kind}" if kind and system in named else "") + (f" at {matched}'s memory" if matched else "")
        style = {"marker": "o", "label": label, "linestyle": "--" if matched else "-",
                 "color": f"C{SYSTEM_ORDER.index(system) if system in SYSTEM_ORDER else len(SYSTEM_ORDER)}"}
        axes[0].plot(seqs, [r["tokens_per_s"] for r in ok], **style)
        with_mem = [r for r in ok if r["peak_mem_gib"] is not None]
        if with_mem:
            axes[1].plot([r["seq_len"] for r in with_mem], [r["peak_mem_gib"] for r in with_mem], **style)
    lengths = sorted({r["seq_len"] for r in shown})
    finish_plot(fig, axes, ("tokens/s", "peak allocated memory (GiB)"), title, lengths)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})  # no version stamp: the same rows give the same bytes
    plt.close(fig)


def finish_plot(fig: Any, axes: Any, ylabels: tuple[str, ...], title: str, lengths: list[int] | None = None) -> None:
    """Style a figure of per-sequence-length panels: a log2 x axis of sequence lengths (with ``lengths``:
    ticks at exactly those, labelled 1K, 2K, ...), one y label per axis, a grid, a legend where an
    axis has labelled lines, then ``title`` and a tight layout."""
    for ax, ylabel in zip(axes, ylabels):
        ax.set_xscale("log", base=2)
        if lengths is not None:
            ax.set_xticks(lengths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
            ax.minorticks_off()
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()


def preset_text(table: str) -> str | None:
    """The leading comment of ``configs/bench/<table>.yaml`` as one paragraph (None for a table without a preset)."""
    from lightning_ft.config import config_dir

    path = Path(config_dir()) / "bench" / f"{table}.yaml"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    end = next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    comment = [line.lstrip("#").strip() for line in lines[:end] if not line.startswith("# @package")]
    return " ".join(line for line in comment if line)


def _versions(rows: list[dict[str, Any]]) -> list[str]:
    names = [name for name, _, meaning in COLUMNS if meaning.startswith("version")]
    found = []
    for r in rows:
        text = f"{r['gpu']}: " + ", ".join(f"{name.replace('_', '-')} {r[name]}" for name in names if r[name])
        if text not in found:
            found.append(text)
    return found


def micro_sections(rows: list[dict[str, Any]]) -> list[str]:
    """The micro-benchmarks' sections: per script the latest row of each (op, mode, shape, provider), in first-seen
    order, with the time against the reference provider's row of the same run."""
    parts = []
    for bench, (title, reference) in MICRO_SECTIONS.items():
        mine = [r for r in rows if r["table"] == bench]
        if not mine:
            continue
        latest: dict[tuple, dict[str, Any]] = {}
        first_seen: dict[tuple, int] = {}
        for index, row in sorted(enumerate(mine), key=lambda item: (item[1]["date"], item[0])):
            key = (row["op"], row["mode"], row["shape"], row["provider"])
            latest[key] = row
            first_seen.setdefault(key[:3], index)
        shown = sorted(latest.values(), key=lambda r: (first_seen[(r["op"], r["mode"], r["shape"])], r["provider"]))
        optional = [(k, h, spec) for k, h, spec in (("gbps", "GB/s", ",.0f"), ("tflops", "TFLOP/s", ".1f"),
                                                     ("tokens_per_s", "tokens/s", ",.0f"), ("peak_mib", "peak MiB", ",.0f"))
                    if any(r[k] is not None for r in shown)]
        head = ["op", "mode", "shape", "provider", "ms", *([f"× {reference}"] if reference else []), *[h for _, h, _ in optional],
                "run (commit)"]
        lines = ["| " + " | ".join(head) + " |",
                 "|" + "|".join("---:" if h == "ms" or "×" in h or h in [o[1] for o in optional] else "---" for h in head) + "|"]
        for r in shown:
            cells = [r["op"], r["mode"], r["shape"], f"`{r['provider']}`", f"{r['ms']:.3f}"]
            if reference:
                base = next((o for o in mine if (o["run"], o["op"], o["mode"], o["shape"], o["provider"])
                             == (r["run"], r["op"], r["mode"], r["shape"], reference)), None)
                cells.append(_ratio(base["ms"], r["ms"]) if base else "–")
            cells += [_num(r[k], spec) for k, _, spec in optional]
            cells.append(f"{r['date'][:10]} ({r['commit']})")
            lines.append("| " + " | ".join(cells) + " |")
        commands = list(dict.fromkeys((r["command"], r["date"][:10], r["commit"]) for r in shown))
        ratio = f" × {reference}: the {reference} row's time over this row's, same run." if reference else ""
        parts += [f"## {bench}", "", f"{title}.{ratio}", "",
                  f"Reproduce: `{MICRO_COMMANDS[bench]} --out {bench}.json --record benchmarks/micro.csv`", "", *lines, "",
                  "Measured with:", "", *[f"- `{c}` ({d}, {commit})" for c, d, commit in commands], ""]
    return parts


DRILL_TEXT = """\
The main job (the built-in CPU default, bounded by `trainer.max_steps`, a checkpoint after every step,
LoRA dropout on) killed with SIGKILL at random points, in turn inside an optimizer step, while a
checkpoint file was being written and while the adapter was being exported, then resumed with
`ckpt_path=last` (run again when it was killed before its first checkpoint). Each resumed run is
compared with one never killed: its per-step losses and adapter weights bitwise, and every checkpoint
and adapter file it leaves loaded, after the kill and after the resume. *Mid-write* counts the kills
that left an unfinished temporary file behind (a write the kill landed in). See
`benchmarks/fault_drill.py`."""


def drill_section(rows: list[dict[str, Any]]) -> list[str]:
    """The fault drills' section: every row of the drills table (``drills.csv``), in date order."""
    head = ["kills (step / checkpoint / export)", "mid-write", "resumed", "losses equal", "adapter equal", "unreadable files",
            "max diff (loss, weight)", "steps", "wall s", "machine", "run (commit)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if h in ("machine", "run (commit)") else "---:" for h in head) + "|"]
    for r in sorted(rows, key=lambda r: r["date"]):
        n = r["kills"]
        cells = [f"{n} ({r['kills_step']} / {r['kills_checkpoint']} / {r['kills_export']})", _num(r["partial_writes_left"], "d"),
                 f"{r['resumed']}/{n}", f"{r['equal_losses']}/{n}", f"{r['equal_adapter']}/{n}", _num(r["unreadable"], "d"),
                 f"{_num(r['max_loss_diff'], '.3g')}, {_num(r['max_adapter_diff'], '.3g')}", _num(r["steps"], "d"),
                 _num(r["wall_s"], ".0f"), r["machine"], f"{r['date'][:10]} ({r['commit']})"]
        lines.append("| " + " | ".join(cells) + " |")
    commands = list(dict.fromkeys((r["command"], r["date"][:10], r["commit"]) for r in rows))
    return ["# Fault drills", "", DRILL_TEXT, "",
            "Reproduce: `python benchmarks/fault_drill.py --kills 20 --seed 0 --record benchmarks/drills.csv`", "", *lines, "",
            "Measured with:", "", *[f"- `{c}` ({d}, {commit})" for c, d, commit in commands], ""]


FIDELITY_TEXT = """\
A setting that changes the arithmetic against a reference run from the same initial weights, seed and
data: the largest relative difference of the two training-loss curves (each a trailing mean over
*window* steps, compared every *every* steps) and of the final validation loss, against their bounds.
On a CPU the fused kernels run their torch references (Triton's kernels need a GPU there), so a CPU row checks
the math and its wiring, not the Triton kernels. See `benchmarks/fidelity.py`."""


def _share(value: float | None) -> str:
    """A relative difference: a percentage, or in scientific notation below 0.01% (where a percentage shows 0.00%)."""
    return "–" if value is None else f"{value:.2%}" if value >= 1e-4 else f"{value:.1e}"


def fidelity_section(rows: list[dict[str, Any]]) -> list[str]:
    """The fidelity checks' section: every row of the fidelity table (``fidelity.csv``), in date order."""
    head = ["check", "reference → candidate", "steps", "loss curves (at step; bound)", "final val loss (ref → cand)",
            "val diff (bound)", "passed", "tokens/s (ref → cand)", "machine", "run (commit)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 2 or i > 7 else "---:" for i in range(len(head))) + "|"]
    for r in sorted(rows, key=lambda r: r["date"]):
        cells = [r["name"], f"`{r['reference']}` → `{r['candidate']}`", _num(r["steps"], "d"),
                 f"{_share(r['max_curve_rel_diff'])} ({_num(r['at_step'], 'd')}; {_num(r['curve_tol'], '.0%')})",
                 f"{_num(r['val_loss_reference'], '.4f')} → {_num(r['val_loss_candidate'], '.4f')}",
                 f"{_share(r['val_rel_diff'])} ({_num(r['val_tol'], '.0%')})", "yes" if r["passed"] else "**no**",
                 f"{_num(r['tokens_per_s_reference'], ',.0f')} → {_num(r['tokens_per_s_candidate'], ',.0f')}",
                 r["machine"], f"{r['date'][:10]} ({r['commit']})"]
        lines.append("| " + " | ".join(cells) + " |")
    commands = list(dict.fromkeys((r["command"], r["date"][:10], r["commit"]) for r in rows))
    return ["# Fidelity", "", FIDELITY_TEXT, "", *lines, "", "Measured with:", "",
            *[f"- `{c}` ({d}, {commit})" for c, d, commit in commands], ""]


def render(rows: list[dict[str, Any]], plots_dir: Path, out: Path, micro: list[dict[str, Any]] | None = None,
           drills: list[dict[str, Any]] | None = None, fidelity: list[dict[str, Any]] | None = None) -> str:
    """RESULTS.md's text for the table's ``rows`` (then the ``micro``, ``fidelity`` and ``drills`` tables' rows); writes
    one plot per table into ``plots_dir``."""
    by_table: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["table"]:
            by_table[r["table"]].append(r)
    order = [t for t in TABLE_ORDER if t in by_table] + sorted(t for t in by_table if t not in TABLE_ORDER)
    shown = {t: latest_rows(by_table[t]) for t in order}
    every = [r for t in order for r in shown[t]]
    parts = ["# Results", "", INTRO, ""]
    if every:
        parts += ["Machines and versions of the rows below:", ""] + [f"- {v}" for v in _versions(every)] + [""]
    history = len(rows) - len(every)
    parts += [f"[results.csv](results.csv) holds {len(rows)} rows of {len({r['run'] for r in rows})} runs; "
              f"{history} older or unassigned rows are not shown here.", ""]
    micro = micro or []
    links = order + [b for b in MICRO_SECTIONS if any(r["table"] == b for r in micro)] + (["fidelity"] if fidelity else []) \
        + (["fault-drills"] if drills else [])
    parts += ["Tables: " + ", ".join(f"[{t}](#{t})" for t in links), ""] if links else []
    parts += equal_memory_section(rows)
    for table in order:
        table_rows = shown[table]
        models = ", ".join(dict.fromkeys(f"{r['model']} ({r['layers']} layers)" for r in table_rows))
        text = preset_text(table)
        parts += [f"## {table}", "", f"{models}. {text or ''}".rstrip(), ""]
        if text is not None:
            parts += [f"Reproduce: `python -m lightning_ft bench +bench={table}`", ""]
        parts += [markdown_table(table_rows, by_table[table]), ""]
        settings = {}
        for r in table_rows:
            settings.setdefault(r["system"], [])
            if r["settings"] and r["settings"] not in settings[r["system"]]:
                settings[r["system"]].append(r["settings"])
        parts += ["Settings: " + "; ".join(f"`{s}` {' | '.join(f'`{v}`' for v in values)}" for s, values in settings.items() if values), ""]
        commands = list(dict.fromkeys((r["command"], r["date"][:10], r["commit"]) for r in table_rows if r["command"]))
        if commands:
            parts += ["Measured with:", ""] + [f"- `{c}` ({d}, {commit})" for c, d, commit in commands] + [""]
        png = plots_dir / f"{table}.png"
        if any(r["status"] == "ok" for r in table_rows):  # nothing to draw where no row ran (OOM, errors)
            plot(table_rows, png, f"{table}: {models}")
            rel = Path(_relpath(png, out.parent))
            parts += [f"![{table}]({rel.as_posix()})", ""]
        else:
            png.unlink(missing_ok=True)
    if micro:
        parts += ["# Micro-benchmarks", "", "Single ops and blocks, timed alone on the GPU, from [micro.csv](micro.csv).", ""]
        parts += micro_sections(micro)
    if fidelity:
        parts += fidelity_section(fidelity)
    if drills:
        parts += drill_section(drills)
    return "\n".join(parts).rstrip() + "\n"


def _relpath(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path.resolve(), start.resolve())


def parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="python -m lightning_ft bench report",
        description="Regenerate RESULTS.md and its plots from the bench results table (benchmarks/results.csv): one "
                    "section per table (bench preset) with the latest row of each (system, layers, seq_len), the ratios "
                    "against the peers of the same run, the settings, the commands that measured them and a plot; "
                    "then the micro-benchmarks (benchmarks/micro.csv) by script, the fidelity checks (benchmarks/fidelity.csv) "
                    "and the fault drills (benchmarks/drills.csv).",
    )


def _side_table(p: argparse.ArgumentParser, given: str | None, beside: Path, schema: Any, what: str) -> list[dict[str, Any]]:
    """The rows of a table given by its option (an error if missing) or found ``beside`` the results table (none if missing)."""
    from lightning_ft.bench.table import TableError

    path = Path(given) if given else beside
    if not path.exists():
        if given:
            p.error(f"no {what} table at {path}")
        return []
    try:
        return read_rows(path, schema)
    except TableError as err:
        p.error(str(err))


def main(argv: list[str]) -> int:
    """``bench report`` with its arguments; returns the exit status (errors print one line)."""
    p = parser()
    p.add_argument("--table", default="benchmarks/results.csv", help="the results table (default: %(default)s)")
    p.add_argument("--out", default=None, help="the markdown file written (default: RESULTS.md beside --table)")
    p.add_argument("--plots", default=None, help="folder of the PNG plots (default: plots/ beside --out)")
    p.add_argument("--micro", default=None,
                   help="the micro-benchmarks' table (default: micro.csv beside --table, when it exists)")
    p.add_argument("--drills", default=None, help="the fault drills' table (default: drills.csv beside --table, when it exists)")
    p.add_argument("--fidelity", default=None, help="the fidelity checks' table (default: fidelity.csv beside --table, when it exists)")
    args = p.parse_args(argv)
    table = Path(args.table)
    out = Path(args.out) if args.out else table.parent / "RESULTS.md"
    if not table.exists():
        default = args.table == p.get_default("table")
        p.error(f"no results table at {table}" + (": run `python -m lightning_ft bench +bench=PRESET` on a GPU from a git "
                                                   "checkout (it appends there), or pass --table" if default else ""))
    from lightning_ft.bench.table import TableError

    try:
        rows = read_rows(table)
    except TableError as err:
        p.error(str(err))
    micro = _side_table(p, args.micro, table.parent / "micro.csv", MICRO, "micro-benchmark")
    drills = _side_table(p, args.drills, table.parent / "drills.csv", DRILL, "fault drill")
    fidelity = _side_table(p, args.fidelity, table.parent / "fidelity.csv", FIDELITY, "fidelity check")
    plots = Path(args.plots) if args.plots else out.parent / "plots"
    text = render(rows, plots, out, micro, drills, fidelity)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out} and {len({r['table'] for r in rows if r['table'] and r['status'] == 'ok'})} plots in {plots}")
    return 0
