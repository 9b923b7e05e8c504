"""``python -m lightning_ft export``: the exported adapter and merged model compute the trained model's logits."""

import json
import os
import subprocess
import sys

import pytest
import torch

from cli_helpers import FAST, TESTS_DIR, run_cli
from lightning_ft.export import main as export_main

#: fp32 on the CPU: the same weights through another module tree (PEFT over a reloaded base; the merged
#: W + B·A·scaling in fp32) differ by summation order only
ATOL = RTOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny default trained for 4 steps (checkpoints at steps 2 and 4), and its logits on fixed ids."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    run_cli(
        run_dir, *FAST, "trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=2",
        f"+callbacks.logits._target_=cli_helpers.DumpLogits", f"+callbacks.logits.path={run_dir / 'logits.pt'}",
    )
    return run_dir


def _export(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "lightning_ft", "export", *args], capture_output=True, text=True, timeout=300, env=env)


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.slow
def test_exported_adapter_and_merged_model_compute_the_trained_logits(run, capsys):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    proc = _export(str(run), "--merge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = run / "export"
    # what was loaded and what was written, not the model build's report of a training run
    assert proc.stdout.splitlines() == [f"{name}: {out / name}" for name in ("adapter", "base", "merged")]
    logged = [line for line in proc.stderr.splitlines() if line]  # no progress bars either (they come with --verbose)
    assert logged == [f"export: a random qwen3_moe base (model.init=random, seed 42) with the trained weights of {run / 'checkpoints' / 'last.ckpt'}"]
    assert {"adapter", "base", "merged"} <= {p.name for p in out.iterdir()} and not list(run.glob(".export.*"))
    reference = torch.load(run / "logits.pt")
    ids, trained = reference["input_ids"], reference["logits"]

    # the adapter over the base it names (the random base, rebuilt from the run's seed)
    base_path = json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_path == str(out / "base")
    base = AutoModelForCausalLM.from_pretrained(base_path)
    base_logits = _logits(base, ids)
    assert (base_logits - trained).abs().max() > 1e-3  # the adapter changes the output: the comparison means something
    adapted = PeftModel.from_pretrained(base, str(out / "adapter"))
    torch.testing.assert_close(_logits(adapted, ids), trained, atol=ATOL, rtol=RTOL)

    # the merged folder: plain transformers, the base dtype, no trace of the training setup
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"))
    assert merged.dtype == torch.float32 and not hasattr(merged, "peft_config")
    torch.testing.assert_close(_logits(merged, ids), trained, atol=ATOL, rtol=RTOL)
    config = json.loads((out / "merged" / "config.json").read_text())
    assert config["use_cache"] is True and "lightning_ft" not in json.dumps(config)
    assert (out / "merged" / "generation_config.json").is_file() and (out / "merged" / "tokenizer.json").is_file()

    # README's lines: generate from the adapter
    model = AutoPeftModelForCausalLM.from_pretrained(str(out / "adapter"))
    tok = AutoTokenizer.from_pretrained(str(out / "adapter"))
    text = tok.decode(model.generate(**tok("What is 12 + 30?", return_tensors="pt"), max_new_tokens=4)[0])
    assert text.startswith("What is 12 + 30?")

    # an existing export is kept unless --force
    before = (out / "merged" / "model.safetensors").stat().st_mtime_ns
    assert export_main([str(run)]) == 1
    assert "export exists: pass --force to replace it" in capsys.readouterr().err
    assert (out / "merged" / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_export_picks_the_checkpoint_asked_for(run, tmp_path, capsys):
    """--checkpoint best (the callback's best: step 4 here), a step checkpoint by path; refusals name the fix."""
    assert export_main([str(run), "--checkpoint", "best", "--output", str(tmp_path / "best")]) == 0
    assert export_main([str(run), "--checkpoint", str(run / "checkpoints" / "step000002.ckpt"), "--output", str(tmp_path / "two")]) == 0
    capsys.readouterr()
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    best = torch.load(run / "checkpoints" / "step000004.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(last[k], best[k]) for k in last)
    from safetensors.torch import load_file

    exported = {name: load_file(str(tmp_path / name / "adapter" / "adapter_model.safetensors")) for name in ("best", "two")}
    key = next(k for k in exported["best"] if "lora_B" in k)
    assert not torch.equal(exported["best"][key], exported["two"][key])

    assert export_main([str(tmp_path / "nowhere")]) == 1
    assert "no such folder; expected a run folder" in capsys.readouterr().err
    assert export_main([str(tmp_path)]) == 1  # holds only the exports above
    assert "not a run folder (no config.json" in capsys.readouterr().err
    no_checkpoints = tmp_path / "no_checkpoints"
    no_checkpoints.mkdir()
    (no_checkpoints / "config.json").write_text((run / "config.json").read_text())
    assert export_main([str(no_checkpoints)]) == 1
    assert "the run stopped before its first checkpoint" in capsys.readouterr().err


def test_an_export_of_a_run_still_training_says_so(run, tmp_path, caplog):
    import fcntl

    from lightning_ft.run_dir import run_in_progress

    assert not run_in_progress(run) and not run_in_progress(tmp_path)  # finished; no lock file
    with open(run / ".lock", "w") as lock:  # as fit holds it while the run loads and trains
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert run_in_progress(run)
        with caplog.at_level("WARNING", logger="lightning_ft.export"):
            assert export_main([str(run), "--output", str(tmp_path / "mid")]) == 0
    assert f"{run}: the run is still training; exporting {run / 'checkpoints' / 'last.ckpt'}, its weights so far" in caplog.text
    assert not run_in_progress(run)


@pytest.mark.slow
def test_force_replaces_an_earlier_export_and_nothing_else(run, tmp_path, capsys):
    """--force never deletes the run, a folder holding it, a file, or a folder that is not an export."""
    import shutil

    copy = tmp_path / "work" / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("export"))  # the default export of an earlier test
    (tmp_path / "work" / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "adapter").write_text("mine")  # a file named as an export's folder
    for output, expected in (
        (copy, f"--output {copy} holds the run folder {copy}: replacing it would delete the run"),
        (tmp_path / "work", f"--output {tmp_path / 'work'} holds the run folder {copy}"),
        (copy / "adapter", f"--output {copy / 'adapter'} is not an earlier export (it holds README.md, adapter_config.json"),
        (tmp_path / "file", f"--output {tmp_path / 'file'} is a file"),
        (tmp_path / "file" / "sub", f"--output {tmp_path / 'file' / 'sub'}: {tmp_path / 'file'} is a file"),
        (tmp_path / "plain", f"--output {tmp_path / 'plain'} is not an earlier export (it holds adapter)"),
    ):
        assert export_main([str(copy), "--output", str(output), "--force"]) == 1
        assert expected in capsys.readouterr().err
    assert (copy / "checkpoints" / "last.ckpt").is_file() and (copy / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "work" / "notes.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"
    assert export_main([str(copy)]) == 0 and export_main([str(copy)]) == 1  # RUN_DIR/export, then it exists
    assert "exists: pass --force to replace it" in capsys.readouterr().err
    for name in (".DS_Store", "._adapter"):  # a file browser's: still an earlier export
        (copy / "export" / name).write_bytes(b"\0")
    assert export_main([str(copy), "--force"]) == 0  # an earlier export: replaced
    assert sorted(p.name for p in (copy / "export").iterdir()) == ["adapter", "base"]


@pytest.mark.slow
def test_a_checkpoint_cut_short_is_named_by_fit_and_export_with_the_others_to_use(run, tmp_path, capsys):
    """A damaged last.ckpt (cut short: no zip directory at its end): one error line naming the file and the folder's
    other checkpoints, from a resume (nothing written: the summary stays as it was) and from an export."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    last = copy / "checkpoints" / "last.ckpt"
    with open(last, "r+b") as f:
        f.truncate(1000)
    summary_before = (copy / "summary.json").read_text()
    expected = f"{last}: not a readable checkpoint (File is not a zip file: cut short or overwritten?); the folder's " \
               "other checkpoints: step000002.ckpt, step000004.ckpt (pass one's path instead)"
    proc = run_cli(copy, *FAST, "ckpt_path=last", "trainer.max_steps=8", ok=False)
    assert f"error: {expected}" in proc.stderr and "Traceback" not in proc.stderr
    assert (copy / "summary.json").read_text() == summary_before
    assert export_main([str(copy), "--output", str(tmp_path / "export")]) == 1
    assert expected in capsys.readouterr().err and not (tmp_path / "export").exists()
    assert export_main([str(copy), "--checkpoint", "best", "--output", str(tmp_path / "export")]) == 1  # reads last.ckpt
    assert expected in capsys.readouterr().err


def test_ctrl_c_during_an_export_prints_one_line_and_exits_130(tmp_path, monkeypatch, capsys):
    import lightning_ft.export

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(lightning_ft.export, "export", interrupted)
    assert export_main([str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err.startswith("python -m lightning_ft export: interrupted: stopped by Ctrl-C (SIGINT); ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_inference_settings_fall_back_to_eager_attention_where_sdpa_is_not_supported():
    """gpt-oss (attention sinks) has no SDPA attention in transformers: export sets eager there, SDPA elsewhere."""
    import types
    from pathlib import Path

    import yaml

    from lightning_ft.config import config_dir
    from lightning_ft.export import _for_inference
    from lightning_ft.model.build import load_causal_lm

    tokenizer = types.SimpleNamespace(eos_token_id=1, pad_token_id=0, bos_token_id=2)
    for name, want in (("gpt_oss_tiny", "eager"), ("qwen2_tiny", "sdpa")):
        model_cfg = yaml.safe_load((Path(config_dir()) / "model" / f"{name}.yaml").read_text())
        config = model_cfg.get("model", model_cfg)["config"]
        model = load_causal_lm(None, "random", dict(config, vocab_size=64))
        _for_inference(model, tokenizer)
        assert model.config._attn_implementation == want and model.config.use_cache


@pytest.mark.slow
def test_merge_of_a_qlora_run_is_a_dequantised_model_with_the_trained_logits(tmp_path, caplog):
    """model.quantization=nf4: merged/ is the adapter merged into the NF4 base dequantised to model.dtype (a
    plain checkpoint that serves), not a 4-bit one; adapter/ over base/ (still NF4) is what was trained."""
    pytest.importorskip("bitsandbytes", reason='model.quantization=nf4 needs bitsandbytes: pip install -e ".[qlora]"')
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    run_cli(run_dir, *FAST, "trainer.max_steps=2", "model.quantization=nf4",
            "+callbacks.logits._target_=cli_helpers.DumpLogits", f"+callbacks.logits.path={run_dir / 'logits.pt'}")
    with caplog.at_level("INFO", logger="lightning_ft.export"):
        assert export_main([str(run_dir), "--merge"]) == 0
    assert "export: merged/ in float32: 16 NF4 linear layers of the base dequantised before the adapter is merged" in caplog.messages
    reference = torch.load(run_dir / "logits.pt")
    ids, trained = reference["input_ids"], reference["logits"]
    out = run_dir / "export"
    assert json.loads((out / "base" / "config.json").read_text())["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(out / "base")), str(out / "adapter"))
    # the training forward's math first: NF4 dequantised, then the matmul (bitsandbytes' train-mode path; lora.dropout
    # is 0, so train mode changes nothing else). An eval forward on the CPU repacks the weights for bitsandbytes'
    # inference kernel, which rounds otherwise (by ~0.06 here) and is then used in both modes.
    with torch.no_grad():
        dequantised = adapted.train()(input_ids=ids).logits
    torch.testing.assert_close(_logits(adapted, ids), trained, atol=ATOL, rtol=RTOL)  # the kernel DumpLogits ran
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"))
    assert "quantization_config" not in json.loads((out / "merged" / "config.json").read_text()) and merged.dtype == torch.float32
    assert not any(type(m).__name__ == "Linear4bit" for m in merged.modules())
    torch.testing.assert_close(_logits(merged, ids), dequantised, atol=ATOL, rtol=RTOL)
    # from the saved adapter instead of the checkpoint (the base is then built without LoRA layers): the same model
    assert export_main([str(run_dir), "--checkpoint", "adapter", "--merge", "--output", str(tmp_path / "from_adapter")]) == 0
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "from_adapter" / "merged"))
    torch.testing.assert_close(_logits(again, ids), _logits(merged, ids))


@pytest.mark.slow
def test_a_run_that_trains_whole_modules_exports_the_untouched_base_and_the_trained_copies(tmp_path):
    """moe.train_router=true and lora.modules_to_save: the routers and the LM head train in full (PEFT's trainable
    copies, saved in the adapter). base/ holds the weights they were trained from, the adapter over it and merged/
    compute the trained logits."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lightning_ft.export import build_stock_model, run_config

    run_dir = tmp_path / "run"
    run_cli(run_dir, *FAST, "trainer.max_steps=3", "moe.train_router=true", "lora.modules_to_save=[lm_head]",
            "+callbacks.logits._target_=cli_helpers.DumpLogits", f"+callbacks.logits.path={run_dir / 'logits.pt'}")
    assert export_main([str(run_dir), "--merge"]) == 0
    out = run_dir / "export"
    cfg = run_config(run_dir)
    cfg = {**cfg, "lora": {**cfg["lora"], "modules_to_save": None}, "moe.train_router": False}  # the base alone
    fresh = build_stock_model(cfg, vocab_size=AutoModelForCausalLM.from_pretrained(str(out / "base")).config.vocab_size,
                              lora=False, device="cpu").model.state_dict()
    base = load_file(out / "base" / "model.safetensors")
    whole = [name for name in base if name == "lm_head.weight" or name.endswith("mlp.gate.weight")]
    assert len(whole) == 1 + 4 and all(torch.equal(base[name], fresh[name]) for name in whole), whole  # untrained
    trained_copies = load_file(out / "adapter" / "adapter_model.safetensors")
    assert any("lm_head" in name for name in trained_copies) and any("mlp.gate" in name for name in trained_copies)
    reference = torch.load(run_dir / "logits.pt")
    ids, trained = reference["input_ids"], reference["logits"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(out / "base")), str(out / "adapter"))
    torch.testing.assert_close(_logits(adapted, ids), trained, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(str(out / "merged")), ids), trained, atol=ATOL, rtol=RTOL)
