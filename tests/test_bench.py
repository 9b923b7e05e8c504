"""The benchmark harness: FLOP counting, and a CPU smoke run of the real `bench` command."""

import json
import subprocess
import sys

import pytest

from lightning_ft.bench.flops import matmul_params_per_token, train_step_flops

DENSE = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16,
             num_hidden_layers=3, vocab_size=10)


def test_flops_count_by_hand():
    # per layer: q 8·8, o 8·8, k 8·4, v 8·4 = 192; mlp 3·8·16 = 384 → 576; head 80
    assert matmul_params_per_token(DENSE) == (3 * 576, 80)
    moe = {**DENSE, "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 6}
    assert matmul_params_per_token(moe)[0] == 3 * (192 + 8 * 5 + 2 * 3 * 8 * 6)
    # LoRA (frozen base), no checkpointing: 4·P per token, plus forward + 2× backward of attention
    attn_fwd = 3 * 2 * 2 * 4 * (5 * 5 + 2 * 2)  # layers · 2 · heads · head_dim · Σ n²
    assert train_step_flops(DENSE, [5, 2], gradient_checkpointing=False) == 4 * (1728 + 80) * 7 + 3 * attn_fwd
    # checkpointing recomputes the layers' forward (not the LM head) and the attention forward
    assert train_step_flops(DENSE, [5, 2], True) - train_step_flops(DENSE, [5, 2], False) == 2 * 1728 * 7 + attn_fwd
    # full fine-tuning adds the weight gradients
    assert train_step_flops(DENSE, [5, 2], False, base_trainable=True) - train_step_flops(DENSE, [5, 2], False) == 2 * (1728 + 80) * 7

@pytest.mark.slow
def test_bench_smoke_runs_both_systems_with_the_same_math(tmp_path):
    cmd = [sys.executable, "-m", "lightning_ft", "bench", "+bench=tiny_cpu", f"hydra.run.dir={tmp_path}",
           "seq_lens=[48]", "warmup_steps=1", "timed_steps=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["system"], r["status"]) for r in rows] == [("hf_peft", "ok"), ("lightning_ft", "ok")]
    # same random model, same tokens, same optimizer: the same losses after two steps
    assert rows[1]["loss_last"] == pytest.approx(rows[0]["loss_last"], rel=1e-4)
    assert rows[1]["x_vs_hf_peft"] > 0
    assert "| hf_peft |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "results.png").stat().st_size > 0
