"""benchmarks/fidelity.py: two runs from the same initial weights, their smoothed loss curves and final validation
losses compared against bounds, recorded as a row that ``bench report`` shows."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: both sides' overrides of the short failing runs: two steps, a validation split
SHORT = ("trainer.max_steps=2", "data.val_fraction=0.1")  # with --window 1 --every 1
#: the runs' environment: the kernels' torch references on the CPU, not Triton's interpreter (the conftest turns it on)
ENV = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _script():
    spec = importlib.util.spec_from_file_location("fidelity", REPO / "benchmarks" / "fidelity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_curves_are_smoothed_by_trailing_full_windows_and_compared_at_every_nth_step():
    fidelity = _script()
    assert fidelity.smoothed([4.0, 2.0, 3.0, None, 1.0, 5.0], 2) == [None, 3.0, 2.5, None, None, 3.0]
    reference = [4.0, 4.0, 2.0, 2.0, 1.0, 1.0]
    candidate = [4.0, 4.0, 2.0, 2.2, 1.0, 1.3]
    # means of 2: reference [-, 4, 3, 2, 1.5, 1], candidate [-, 4, 3, 2.1, 1.6, 1.15]; every 2nd step: 2, 4, 6
    diff, step = fidelity.curve_difference(reference, candidate, window=2, every=2)
    assert step == 6 and diff == pytest.approx(0.15)
    diff, step = fidelity.curve_difference(reference, candidate, window=2, every=1)
    assert step == 6 and diff == pytest.approx(0.15)
    with pytest.raises(ValueError, match="trained 6 and 5 steps"):
        fidelity.curve_difference(reference, candidate[:5], window=2, every=2)
    with pytest.raises(ValueError, match="no step to compare"):
        fidelity.curve_difference(reference, candidate, window=7, every=1)


def test_fidelity_runs_both_sides_records_a_row_and_fails_past_its_bound(tmp_path):
    """The default job twice (stock against fused kernels, which round differently), bound 0: the curves differ by a
    rounding, so the check fails with status 1, and its row (passed 0) reaches RESULTS.md."""
    from lightning_ft.bench.report import main
    from lightning_ft.bench.table import FIDELITY, read_rows

    out, record = tmp_path / "fidelity.json", tmp_path / "fidelity.csv"
    proc = subprocess.run(
        [sys.executable, "benchmarks/fidelity.py", "--name", "kernels", "--reference", "kernels=none", "--candidate",
         "kernels=all", "--window", "3", "--every", "2", "--curve-tol", "0", "--work", str(tmp_path / "runs"),
         "--out", str(out), "--record", str(record), "--", "trainer.max_steps=8", "data.val_fraction=0.1",
         "callbacks.progress_bar=null"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["steps"] == 8 and result["at_step"] in (4, 6, 8) and result["passed"] == 0
    assert 0 < result["max_curve_rel_diff"] < 1e-3  # the same math, rounded differently
    assert result["val_loss_reference"] > 0 and result["val_rel_diff"] < 1e-3
    for side in ("reference", "candidate"):
        assert (tmp_path / "runs" / side / "summary.json").exists()
    [row] = read_rows(record, FIDELITY)
    assert (row["name"], row["reference"], row["candidate"], row["passed"]) == ("kernels", "kernels=none", "kernels=all", 0)
    assert "--work" not in row["command"] and "--curve-tol 0" in row["command"]

    results = tmp_path / "results.csv"
    results.write_text("")  # an empty step table: the side tables beside it still render
    main(["--table", str(results), "--out", str(tmp_path / "RESULTS.md"), "--fidelity", str(record)])
    text = (tmp_path / "RESULTS.md").read_text()
    assert "[fidelity](#fidelity)" in text and "# Fidelity" in text
    assert "| kernels | `kernels=none` → `kernels=all` | 8 |" in text and "| **no** |" in text


def test_fidelity_names_a_failed_run_and_its_log(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/fidelity.py", "--name", "x", "--reference", "model.attention=nope",
         "--candidate", "lora.dropout=0.0", "--window", "1", "--every", "1", "--work", str(tmp_path), "--", *SHORT],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV,
    )
    assert proc.returncode == 1
    assert ("fidelity: fit trainer.max_steps=2 data.val_fraction=0.1 model.attention=nope ended with status 1: "
            f"see {tmp_path / 'reference.log'}") in proc.stderr


def test_fidelity_keeps_its_temporary_runs_when_one_fails_and_quotes_overrides_as_the_shell(tmp_path):
    """Without ``--work`` the failed run's log that the message names is still there; a side's quoted override with a
    space is one override, shown quoted."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/fidelity.py", "--name", "x", "--reference", "data=jsonl 'data.path=/no such.jsonl'",
         "--candidate", "lora.dropout=0.0", "--window", "1", "--every", "1", "--", *SHORT],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**ENV, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 1
    [work] = tmp_path.glob("fidelity_*")
    log = work / "reference.log"
    assert (f"fidelity: fit trainer.max_steps=2 data.val_fraction=0.1 data=jsonl 'data.path=/no such.jsonl' ended with "
            f"status 1: see {log} (the runs are kept in {work})") in proc.stderr
    assert "/no such.jsonl" in log.read_text()


def test_fidelity_refuses_a_record_table_with_other_columns_before_training(tmp_path):
    record = tmp_path / "other.csv"
    record.write_text("a,b\n1,2\n")
    proc = subprocess.run(
        [sys.executable, "benchmarks/fidelity.py", "--name", "x", "--reference", "kernels=none", "--candidate",
         "kernels=all", "--work", str(tmp_path / "runs"), "--record", str(record)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"fidelity: --record {record}: the header does not match the fidelity table's schema" in proc.stderr
    assert "unknown columns ['a', 'b']" in proc.stderr
    assert "fidelity: reference" not in proc.stdout and not (tmp_path / "runs").exists()
    assert record.read_text() == "a,b\n1,2\n"


def test_fidelity_refuses_an_unbalanced_quote_in_a_side_before_training(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/fidelity.py", "--name", "x", "--reference", "'kernels=none", "--candidate",
         "kernels=all", "--work", str(tmp_path / "runs")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=ENV,
    )
    assert proc.returncode == 2 and "fidelity.py: error: --reference: No closing quotation: \"'kernels=none\"" in proc.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("common, candidate, message, flags", [
    (("trainer.max_steps=4",), "kernels=all",
     "the reference run has no validation data, so no final validation loss: give both runs data.val_path or "
     "data.val_fraction", ()),
    (("trainer.max_steps=4", "data.val_fraction=0.1"), "trainer.max_steps=3",
     "the runs would train different numbers of steps (reference trainer.max_steps=4, candidate trainer.max_steps=3): "
     "give both the same", ()),
    (("trainer.max_steps=4", "data.val_fraction=0.1"), "kernels=all",
     "trainer.max_steps=4 is less than one smoothing window (--window 20): no step to compare", ()),
    (("trainer.max_steps=4", "data.val_fraction=0.1"), "lora.rank=eight",
     "fit trainer.max_steps=4 data.val_fraction=0.1 lora.rank=eight: lora.rank=eight: expected an integer", ()),
    (("trainer.max_steps=25", "data.val_fraction=0.1"), "kernels=all",
     "trainer.max_steps=25: the first step compared would be 30 (the first multiple of --every 15 from --window 20 on): "
     "lower --every or train more steps", ("--every", "15")),
])
def test_fidelity_refuses_runs_that_could_not_be_compared_before_training(tmp_path, common, candidate, message, flags):
    """Each side's config as Hydra composes it (``fit --cfg job``) is checked before anything trains."""
    proc = subprocess.run(
        [sys.executable, "benchmarks/fidelity.py", "--name", "x", "--reference", "kernels=none", "--candidate", candidate,
         "--work", str(tmp_path / "runs"), *flags, "--", *common],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=ENV,
    )
    assert proc.returncode == 2 and f"fidelity.py: error: {message}" in proc.stderr, proc.stderr[-1500:]
    assert not (tmp_path / "runs").exists()


def test_e4m3_base_rounds_the_lora_wrapped_weights_to_what_fp8_stores_and_nothing_else(tmp_path):
    """``--e4m3-base``'s checkpoint: each LoRA-wrapped weight is its e4m3 value (converting it again gives the same
    e4m3 bytes and scales, up to bf16's rounding of the dequantised value), the other weights are the random init's."""
    import torch

    from lightning_ft.data.tokenization import load_tokenizer
    from lightning_ft.kernels.fp8 import quantize_weight
    from lightning_ft.model.build import load_causal_lm

    config = _script().planned_config(["model.dtype=bfloat16"])  # the default job: tiny Qwen3-MoE, q/k/v/o LoRA
    overrides = _script().save_e4m3_base(config, tmp_path / "base")
    assert overrides == [f"model.name_or_path={tmp_path / 'base'}", "model.init=pretrained"]
    rounded = load_causal_lm(str(tmp_path / "base"), dtype="bfloat16")
    torch.manual_seed(config["seed"])
    cfg = config["model"]
    initial = load_causal_lm(None, init="random", config=cfg["config"], dtype="bfloat16",
                             vocab_size=len(load_tokenizer(cfg["tokenizer"])))
    targets = set(config["lora"]["target_modules"])
    changed = 0
    for (name, w), (name0, w0) in zip(rounded.named_parameters(), initial.named_parameters(), strict=True):
        assert name == name0
        if name.split(".")[-2] in targets:
            values, scales = quantize_weight(w0)
            assert torch.equal(w, (values.float() * scales[:, None]).bfloat16()), name
            again, scales_again = quantize_weight(w)
            assert (again.float() != values.float()).float().mean() < 1e-3 and torch.allclose(scales_again, scales, rtol=1e-2)
            changed += not torch.equal(w, w0)
        else:
            assert torch.equal(w, w0), name
    assert changed == 4 * config["model"]["config"]["num_hidden_layers"]
    with pytest.raises(ValueError, match="--e4m3-base rounds the weights LoRA wraps .* lora.enabled=false: give the runs LoRA"):
        _script().save_e4m3_base({**config, "lora": {**config["lora"], "enabled": False}}, tmp_path / "none")
