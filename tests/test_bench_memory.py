"""The bench harness's memory-matched mode (``memory_matched=SYSTEM``), its columns in the results table, and the
report's leading section of speed at equal memory. The systems are stand-ins (`runner._run_worker` replaced)."""

import csv
import json

import pytest
from test_bench import _compose_bench, _table_row

from lightning_ft.bench import runner
from lightning_ft.bench.table import COLUMN_NAMES, append_rows, read_rows


def _fake_workers(monkeypatch, peaks):
    """Each system's row from ``peaks`` (system → peak GiB, or a status for a row that did not run); the specs run, in order."""
    specs = []

    def run(spec, timeout_s, log):
        specs.append(spec)
        peak = peaks[spec["system"]]
        base = runner._row_base(spec)
        if isinstance(peak, str):
            return {**base, "status": peak}
        return {**base, "status": "ok", "ms_per_step": 100.0, "tokens_per_s": spec["seq_len"] / 0.1, "mfu": 0.5,
                "peak_mem_gib": peak, "peak_reserved_gib": peak + 1, "loss_last": 5.0}

    monkeypatch.setattr(runner, "_run_worker", run)
    return specs


def test_the_peer_runs_first_and_its_peak_is_lightning_fts_budget(tmp_path, monkeypatch):
    specs = _fake_workers(monkeypatch, {"unsloth": 7.5, "hf_peft": 12.0, "lightning_ft": 7.25})
    table = tmp_path / "results.csv"
    cfg = _compose_bench("+bench=tiny_cpu", "systems=[hf_peft,lightning_ft]", "memory_matched=unsloth", "seq_lens=[64,128]",
                         "name=tiny", f"out_dir={tmp_path}", f"results_table={table}", "table=tiny_cpu")
    rows = runner.run_bench(cfg)
    assert [(s["system"], s["seq_len"]) for s in specs] == [(s, n) for n in (64, 128) for s in ("unsloth", "hf_peft", "lightning_ft")]
    ours = [s for s in specs if s["system"] == "lightning_ft"]
    assert all(s["strategy"]["memory_budget_gib"] == 7.5 for s in ours)
    assert all(s["strategy"]["memory_budget_gib"] == "auto" for s in specs if s["system"] != "lightning_ft")  # only ours gets it
    assert [(r["system"], r.get("memory_matched"), r.get("memory_budget_gib")) for r in rows[:3]] == [
        ("unsloth", None, None), ("hf_peft", None, None), ("lightning_ft", "unsloth", 7.5)]
    recorded = read_rows(table)
    assert [(r["system"], r["memory_matched"], r["memory_budget_gib"]) for r in recorded][:3] == [
        ("unsloth", None, None), ("hf_peft", None, None), ("lightning_ft", "unsloth", 7.5)]
    assert "| budget GiB |" in (tmp_path / "results.md").read_text()


def test_a_peer_without_a_peak_leaves_lightning_ft_not_run_saying_why(tmp_path, monkeypatch):
    specs = _fake_workers(monkeypatch, {"unsloth": "OOM", "lightning_ft": 1.0})
    cfg = _compose_bench("+bench=tiny_cpu", "systems=[lightning_ft]", "memory_matched=unsloth", "seq_lens=[64]", "name=tiny",
                         f"out_dir={tmp_path}")
    peer, ours = runner.run_bench(cfg)
    assert [s["system"] for s in specs] == ["unsloth"]  # lightning_ft's worker never started
    assert peer["status"] == "OOM" and ours["status"] == "not run: memory_matched=unsloth measured no peak (OOM)"
    assert (ours["memory_matched"], ours["memory_budget_gib"]) == ("unsloth", None)


@pytest.mark.parametrize("overrides", [["memory_matched=lightning_ft"], ["memory_matched=unsloth", "systems=[hf_peft]"],
                                       ["memory_matched=unslot"]])
def test_memory_matched_needs_a_peer_and_lightning_ft(tmp_path, overrides):
    cfg = _compose_bench("+bench=tiny_cpu", *overrides, f"out_dir={tmp_path}")
    with pytest.raises(ValueError, match=r"^memory_matched=.*: expected a peer \(hf_peft, liger, unsloth\) .* with lightning_ft in systems"):
        runner.run_bench(cfg)


def test_a_table_of_the_older_schema_reads_and_is_upgraded_when_appended_to(tmp_path):
    path = tmp_path / "results.csv"
    old = COLUMN_NAMES[: COLUMN_NAMES.index("memory_matched")]
    with path.open("w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([old, [str(_table_row()[c]) if _table_row().get(c) is not None else "" for c in old]])
    (row,) = read_rows(path)
    assert row["system"] == "lightning_ft" and row["memory_matched"] is None and row["memory_budget_gib"] is None
    append_rows(path, [_table_row(memory_matched="unsloth", memory_budget_gib=7.5)])
    assert path.read_text().splitlines()[0] == ",".join(COLUMN_NAMES)
    first, second = read_rows(path)
    assert first == row and (second["memory_matched"], second["memory_budget_gib"]) == ("unsloth", 7.5)


def test_the_report_leads_with_speed_at_equal_memory(tmp_path):
    from lightning_ft.bench.report import main

    table = tmp_path / "results.csv"
    append_rows(table, [
        _table_row(system="unsloth", tokens_per_s=6000.0, peak_mem_gib=7.5, peak_reserved_gib=8.0),
        _table_row(tokens_per_s=9000.0, peak_mem_gib=7.4, memory_matched="unsloth", memory_budget_gib=7.5),
        _table_row(tokens_per_s=10000.0, peak_mem_gib=12.3),  # the same run's default lightning_ft row
        _table_row(tokens_per_s=11000.0, peak_mem_gib=7.3, memory_matched="unsloth", memory_budget_gib=7.5,
                   settings="bf16 ckpt fp8+head"),  # another path at the same budget: a row of its own
    ])
    out = tmp_path / "RESULTS.md"
    assert main(["--table", str(table), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.index("## Speed at equal memory") < text.index("## qwen3_moe")
    assert ("| qwen3_moe | qwen3_moe_30b_a3b (48) | 8192 | `unsloth` | 6,000 | 7.50 | bf16 | 9,000 | 1.50× | 7.40 | yes | 2026-12-03 (3af38d2) |"
            in text)
    assert "| `unsloth` | 6,000 | 7.50 | fp8+head | 11,000 | 1.83× | 7.30 | yes |" in text
    # the per-table section shows both lightning_ft rows, the matched one named so
    assert "| `lightning_ft` at `unsloth`'s memory |" in text and "| 8192 | 48 | `lightning_ft` | " in text
    assert json.dumps(text)  # one readable file
