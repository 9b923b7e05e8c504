"""The real CLI and the real configs, the way a user runs them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_ft.config import config_dir, register_configs

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml"))


def _compose(overrides):
    register_configs()
    with initialize_config_dir(config_dir(), version_base="1.3"):
        return compose("fit", overrides=overrides)


def _run_cli(tmp_path, *overrides, cwd=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_ft", "fit", f"hydra.run.dir={tmp_path}", "callbacks.progress_bar=null", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=cwd or tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "summary.json").read_text()), proc


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment, tmp_path):
    cfg = _compose([f"+experiment={experiment}", "data.path=x.jsonl", f"run_dir={tmp_path}"])
    assert cfg.model.config.model_type in ("qwen3_moe", "qwen3", "llama")
    assert cfg.trainer.max_steps > 0


def test_qwen3_moe_experiment_has_the_published_shape(tmp_path):
    cfg = _compose(["+experiment=qwen3_moe", f"run_dir={tmp_path}"])
    c = cfg.model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (
        48, 2048, 128, 8, 768,
    )
    assert cfg.model.dtype == "bfloat16" and cfg.trainer.precision == "bf16-mixed"
    assert list(cfg.lora.target_parameters) == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_unknown_key_is_rejected_at_composition(tmp_path):
    with pytest.raises(Exception, match="max_token"):
        _compose(["data.max_token=3", f"run_dir={tmp_path}"])


@pytest.mark.slow
def test_default_fit_trains_and_leaves_its_artifacts(tmp_path):
    summary, proc = _run_cli(tmp_path, "trainer.max_steps=40", "callbacks.checkpoint.every_n_train_steps=20")
    for key in ("initial_loss", "final_loss", "steps", "train_tokens", "tokens_per_s", "peak_memory_bytes",
                "adapter_dir", "checkpoint_path", "config"):
        assert summary[key] is not None, key
    assert summary["steps"] == 40
    assert summary["final_loss"] < 0.8 * summary["initial_loss"]
    assert summary["config"]["model"]["config"]["model_type"] == "qwen3_moe"
    assert Path(summary["checkpoint_path"]).exists()
    assert (tmp_path / "loss_curve.png").stat().st_size > 0
    assert (tmp_path / "logs" / "metrics.csv").exists()
    assert "data: 4000 examples" in proc.stderr + proc.stdout

    adapter_config = json.loads((Path(summary["adapter_dir"]) / "adapter_config.json").read_text())
    assert adapter_config["r"] == summary["config"]["lora"]["rank"]
    assert (Path(summary["adapter_dir"]) / "tokenizer.json").exists()


@pytest.mark.slow
def test_gsm8k_experiment_on_real_data(tmp_path):
    if not SHARED_DATA.exists():
        pytest.skip(f"the shared data folder {SHARED_DATA} is absent (it exists on the project's machines)")
    summary, proc = _run_cli(
        tmp_path, "+experiment=gsm8k_tiny", f"data.path={SHARED_DATA / 'gsm8k_train.jsonl'}", "data.num_examples=300",
        "trainer.max_steps=12", "data.max_tokens=768",
    )
    assert "'qa' format" in proc.stderr + proc.stdout
    assert summary["final_loss"] < summary["initial_loss"]


@pytest.mark.slow
def test_full_fine_tuning_and_chat_data(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}"}]}
        for i in range(64)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary, _ = _run_cli(tmp_path / "run", "lora=none", f"data.path={data}", "data.format=auto", "data.num_examples=null",
                          "trainer.max_steps=4", "data.max_tokens=128")
    assert summary["steps"] == 4
    assert (Path(summary["adapter_dir"]) / "config.json").exists()  # full model saved
