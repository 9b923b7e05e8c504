"""`lightning_ft.model.support`: which architectures take packed rows and the chunked CE, and the start log."""

import re

import pytest
import torch
from transformers import AutoConfig

from lightning_ft.model.build import ModelBuilder
from lightning_ft.model.patching import KERNEL_KEYS
from lightning_ft.model.support import architecture_support, tiny_config


@pytest.mark.parametrize(
    ("model_type", "packing", "plain_head"),
    [
        ("mistral", None, None),
        ("gpt2", None, None),  # learned absolute positions, read from position_ids
        ("bloom", "its attention does not go through transformers' attention-function registry", None),
        ("mamba", "its attention does not go through transformers' attention-function registry", None),
        ("gemma2", None, "the model changes its logits"),  # soft-capped attention: flex / sdpa
        ("cohere", None, "the model changes its logits after the LM head"),
        ("deepseek_v3", None, None),  # MLA: value heads narrower than query/key heads
        ("glm4_moe_lite", None, None),  # MLA, dense / sparse layers per mlp_layer_types
        # compressed keys joined to the row's own: refused by the packed attention, so padded rows
        ("deepseek_v4", r"its forward fails on a packed row \(ValueError: deepseek_v4: its attention has \d+ keys for the "
                        r"row's 7 tokens", None),
    ],
)
def test_each_architecture_is_checked_on_a_tiny_copy(model_type, packing, plain_head):
    support = architecture_support(AutoConfig.for_model(model_type))
    for got, expected in ((support.packing, packing), (support.plain_head, plain_head)):
        assert got is None if expected is None else got is not None and re.match(expected, got)
    assert support.causal is None


@pytest.mark.parametrize(("model_type", "causal"), [("bert", False), ("roberta", False), ("gpt_neox", True)])
def test_a_config_built_as_an_encoder_is_found_not_causal(model_type, causal):
    """``is_decoder=False`` (the config's default) builds BERT's family as an encoder; GPT-NeoX is causal whatever it says."""
    support = architecture_support(AutoConfig.for_model(model_type, is_decoder=False))
    assert support.causal is None if causal else support.causal.startswith("each token sees the later ones")
    assert architecture_support(AutoConfig.for_model(model_type, is_decoder=True)).causal is None


def test_the_check_leaves_every_generator_as_it_was(monkeypatch):
    """The tiny copy is drawn from the CPU's generator, restored after; no GPU's generator is reseeded (the run's
    seed governs what is drawn there: LoRA's init, dropout)."""
    from lightning_ft.model import support

    monkeypatch.setattr(support, "_support", support._support.__wrapped__)  # no cached answer: the check runs
    torch.manual_seed(5)
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    monkeypatch.setattr(torch.cuda, "manual_seed", reseeded.append)
    state, expected = torch.get_rng_state(), torch.rand(3)
    torch.set_rng_state(state)
    assert architecture_support(AutoConfig.for_model("llama")).packing is None
    assert reseeded == [] and torch.equal(torch.rand(3), expected)


def test_a_tiny_config_keeps_the_structure():
    big = AutoConfig.for_model("gemma3_text", sliding_window=4096, layer_types=["sliding_attention"] * 5 + ["full_attention"], num_hidden_layers=6)
    tiny = tiny_config(big)
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.vocab_size, tiny.sliding_window) == (32, 2, 64, 2)
    assert tiny.layer_types == ["sliding_attention", "full_attention"]
    assert tiny.hidden_activation == big.hidden_activation and tiny.tie_word_embeddings == big.tie_word_embeddings
    assert tiny_config(AutoConfig.for_model("gpt2")).n_embd == 32  # through attribute_map
    mla = tiny_config(AutoConfig.for_model("glm4_moe_lite"))  # 47 layers: the first dense; head_dim aliases the RoPE part
    assert (mla.num_hidden_layers, mla.mlp_layer_types, mla.num_key_value_heads) == (2, ["dense", "sparse"], 2)
    assert (mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim, mla.head_dim) == (16, 8, 8)


def test_per_layer_fields_follow_the_kept_layers():
    """Lists one entry per layer and dicts keyed by layer index keep the kept layers' entries (the first of each
    distinct layer type), renumbered; sizes inside them shrink too."""
    gemma3n = tiny_config(AutoConfig.for_model("gemma3n_text", num_kv_shared_layers=0))  # 35 layers, full every 5th
    assert gemma3n.layer_types == ["sliding_attention", "full_attention"]
    assert gemma3n.activation_sparsity_pattern == [0.95, 0.95] and gemma3n.intermediate_size == [48, 48]
    gemma4 = tiny_config(AutoConfig.for_model("gemma4_text"))  # per_layer_config {"05": {"head_dim": 512}, ...}
    assert gemma4.num_hidden_layers == 2 and set(gemma4.layer_types) == {"sliding_attention", "full_attention"}
    laguna = tiny_config(AutoConfig.for_model("laguna"))  # 40 layers of 48 heads each
    assert len(laguna.num_attention_heads_per_layer) == laguna.num_hidden_layers == len(laguna.layer_types)
    zaya = tiny_config(AutoConfig.for_model("zaya"))  # top 1 of its experts: not raised to top 2
    assert zaya.num_experts_per_tok == 1


@pytest.mark.parametrize("model_type", ["bamba", "mamba2", "falcon_h1"])
def test_a_mamba2_mixer_fills_its_width_at_the_tiny_head_size(model_type):
    support = architecture_support(AutoConfig.for_model(model_type))
    assert support.plain_head is None and not support.packing.startswith("no tiny copy")


def test_a_config_whose_tiny_copy_cannot_be_built_trains_stock():
    config = AutoConfig.for_model("kolibri1_1")  # index_layers hold layer indices of the 50 layers
    support = architecture_support(config)
    assert support.packing.startswith("no tiny copy of kolibri1_1 to check it on") and support.plain_head == support.packing


def test_a_model_that_picks_its_attention_class_by_name_builds_with_stock_attention():
    """Git looks its attention class up by ``attn_implementation``: it is built without our packed attention's name."""
    model = {"init": "random", "config": {**tiny_config(AutoConfig.for_model("git")).to_dict(), "model_type": "git"}}
    lora = {"rank": 2, "alpha": 4, "dropout": 0.0, "target_modules": "all-linear"}
    with pytest.warns(UserWarning, match="git: one document per padded row"):
        built = ModelBuilder(model=model, lora=lora)(torch.device("cpu"))
    assert not built.packed


def test_the_start_log_lists_every_piece_for_an_architecture_without_a_table(caplog):
    """kernels=all on an unknown model_type builds: the fused pieces that apply, the stock ones and why."""
    model = {"init": "random", "config": {**tiny_config(AutoConfig.for_model("bloom")).to_dict(), "model_type": "bloom"}}
    kernels = dict.fromkeys(KERNEL_KEYS, True) | {"rope": False}
    with caplog.at_level("INFO"), pytest.warns(UserWarning, match=r"bloom: one document per padded row, not packed rows \(its attention"):
        built = ModelBuilder(model=model, lora={"rank": 2, "alpha": 4, "dropout": 0.0, "target_modules": "all-linear"}, kernels=kernels)(torch.device("cpu"))
    assert not built.packed and built.plain_head and built.fused_linear_cross_entropy
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("bloom ")]
    why = "no patch table for model_type 'bloom'"
    assert lines[0].startswith("bloom packing: stock, one document per padded row (its attention does not go through")
    assert lines[1].startswith(f"bloom kernel rms_norm: stock ({why}")
    assert lines[2] == "bloom kernel rope: off (kernels.rope=false)"
    assert lines[3].startswith(f"bloom kernel swiglu: stock ({why}")
    assert lines[4].startswith("bloom kernel lora: ") and lines[4].endswith(" x peft lora.Linear")
    assert lines[5] == "bloom kernel fused_linear_cross_entropy: chunked over the vocabulary (no [T, vocab] logits)"
    assert len(lines) == 6
