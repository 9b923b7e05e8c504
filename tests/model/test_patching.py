"""Patch tables end to end: a tiny random model of every table's architecture with PEFT LoRA, kernels all
on vs all off, forward and backward, and `revert_kernels` back to stock.

Tolerances, kernels on vs off:
    fp32  logits and loss atol/rtol 1e-5, LoRA gradients atol/rtol 1e-4. Both paths keep fp32
          intermediates; what remains is reduction order (RMSNorm's mean), amplified a little
          through two layers and the backward.
    bf16  loss within 1e-2 relative, logits within 5e-2 and each LoRA gradient within 15e-2 in
          relative L2 norm. bf16 keeps 8 significant bits (2^-9 relative per rounding); the fused
          ops round once where HF rounds after every op, so the two paths round in different
          places and the gaps compound through two layers forward and backward. Measured: loss
          equal, logits <= 2.2e-2, gradients <= 8e-2, while stock bf16 itself sits up to 4.5e-2 from
          an fp32 run of the same weights. Under the CPU interpreter the gaps are larger than on
          the GPU because the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even).
          Gemma 3 there: gradients within 20e-2 (measured 15.3e-2): its 13 norms (sandwich norms
          and q/k norms in two layers) each truncate toward zero, a bias that adds up, where the
          plain-torch reference of its norm is HF's bit for bit (tests/kernels/test_rms_norm.py).
"""

import functools
import importlib

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

from transformers.activations import ACT2FN

from lightning_ft.kernels._utils import INTERPRETER
from lightning_ft.kernels.swiglu import swiglu_reference
from lightning_ft.model.lora import _fused_lora_forward
from lightning_ft.model.patching import (
    GLU_ACTIVATIONS,
    PATCH_TABLES,
    _fused_apply_rotary_pos_emb,
    _fused_apply_rotary_pos_emb_half_tables,
    _fused_gate_up_mlp_forward,
    _fused_offset_rms_norm_forward,
    _fused_rms_norm_forward,
    _fused_swiglu_mlp_forward,
    apply_kernels,
    moe_classes,
    revert_kernels,
)

ALL_ON = {"rms_norm": True, "rope": True, "swiglu": True, "lora": True, "fused_linear_cross_entropy": True}
ALL_OFF = dict.fromkeys(ALL_ON, False)
LORA_TARGETS = [
    "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # MLA
]  # fmt: skip
FAMILIES = [
    "llama", "qwen2", "mistral", "phi3", "gemma3_text", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3",
    "glm4_moe_lite", "gpt_oss",
]  # fmt: skip
# Packed documents of length 3, 1, 4, 1, 1, 2: position_ids restart at 0 per document.
POSITION_IDS = [0, 1, 2, 0, 0, 1, 2, 3, 0, 0, 0, 1]

CPU_NEEDS_INTERPRETER = "Triton runs on the CPU only under TRITON_INTERPRET=1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETER, reason=CPU_NEEDS_INTERPRETER)),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def _tiny_config(model_type):
    common = dict(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )
    if model_type == "llama":
        return transformers.LlamaConfig(**common)
    if model_type == "qwen3":
        return transformers.Qwen3Config(**common)
    if model_type == "qwen2":  # q/k/v biases; layer 1 slides over 3 tokens
        return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=3, max_window_layers=1)
    if model_type == "mistral":
        return transformers.MistralConfig(**common, sliding_window=3)
    if model_type == "phi3":  # fused qkv_proj / gate_up_proj, partial rotary (12 of 16 dims)
        return transformers.Phi3Config(**common, partial_rotary_factor=0.75, pad_token_id=0)
    if model_type == "gemma3_text":  # a sliding and a full layer, two RoPE bases, query_pre_attn_scalar, tied; GeGLU
        return transformers.Gemma3TextConfig(
            **common, sliding_window=3, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
        )
    if model_type == "mixtral":  # every MLP sparse: no dense MLP for swiglu
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    grouped = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1)
    if model_type == "glm4_moe":  # layer 0 dense, layer 1 sparse with a shared expert (both patched); partial rotary
        return transformers.Glm4MoeConfig(**common, **grouped, attention_bias=True)
    if model_type == "deepseek_v3":  # as GLM-4.5, with MLA attention (its RoPE stays transformers')
        mla = dict(num_key_value_heads=4, head_dim=8, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        return transformers.DeepseekV3Config(**(common | mla), **grouped)
    if model_type == "glm4_moe_lite":  # DeepSeek-V3's MLA (value heads 16, q/k 8 + 16) and MoE; sparse per mlp_layer_types
        mla = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=16)
        grouped = {k: v for k, v in grouped.items() if k != "first_k_dense_replace"} | dict(mlp_layer_types=["dense", "sparse"])
        return transformers.Glm4MoeLiteConfig(**({k: v for k, v in common.items() if k != "head_dim"} | mla), **grouped)
    if model_type == "gpt_oss":  # a sliding and a full layer with sinks; yarn RoPE (half tables); fp32-scaled norms
        return transformers.GptOssConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 2, "truncate": False},
        )  # fmt: skip
    # Layer 0 dense (Qwen3MoeMLP, patched), layer 1 sparse (Qwen3MoeExperts, left alone).
    return transformers.Qwen3MoeConfig(
        **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0]
    )


def _tiny_lora_model(model_type, device):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_tiny_config(model_type), dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, lora).to(device)


def _step(model, device):
    """One forward + backward on a packed row; returns logits, loss and the LoRA gradients."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 96, (2, len(POSITION_IDS)), generator=generator).to(device)
    position_ids = torch.tensor([POSITION_IDS, POSITION_IDS], device=device)
    logits = model(input_ids=input_ids, position_ids=position_ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return logits.detach(), loss.detach(), grads


def _bound(module):
    """(function, keyword arguments) of a patched instance ``forward``."""
    fn = module.forward.__func__
    return (fn.func, fn.keywords) if isinstance(fn, functools.partial) else (fn, {})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_all_on_matches_all_off_and_reverts(model_type, device):
    model = _tiny_lora_model(model_type, device)
    table = PATCH_TABLES[model_type]
    modeling = importlib.import_module(table.modeling_module)
    stock_rope = modeling.apply_rotary_pos_emb

    assert apply_kernels(model, ALL_OFF) == []
    logits_off, loss_off, grads_off = _step(model, device)

    applied = apply_kernels(model, ALL_ON)
    assert [line.split(":")[0] for line in applied] == ["lora", "rms_norm", "swiglu", "rope"]
    norm_classes = tuple(getattr(modeling, name) for name in table.rms_norm)
    mlp_classes = tuple(getattr(modeling, name) for name in table.mlp)
    norms = [m for m in model.modules() if isinstance(m, norm_classes)]
    mlps = [m for m in model.modules() if isinstance(m, mlp_classes)]
    loras = [m for m in model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
    stock = dict(table.stock)  # pieces the table leaves to transformers (DeepSeek-V3's RoPE, Mixtral's MLP)
    assert loras and bool(norms) != ("rms_norm" in stock) and bool(mlps) != ("swiglu" in stock)
    assert [line for line in applied if "stock" in line] == [f"{name}: stock ({why})" for name, why in stock.items()]
    offsets = dict(table.rms_norm_offsets)
    for m in norms:
        name = type(m).__name__
        if name in offsets:
            assert _bound(m) == (_fused_offset_rms_norm_forward, {"offset": offsets[name]})
        else:
            assert _bound(m) == (_fused_rms_norm_forward, {})
    fused_mlp = _fused_gate_up_mlp_forward if table.fused_gate_up else _fused_swiglu_mlp_forward
    activation = "gelu_tanh" if model_type == "gemma3_text" else "silu"
    assert all(_bound(m) == (fused_mlp, {"activation": activation}) for m in mlps)
    if model_type == "gemma3_text":  # (1 + weight) norms, q/k norms included: 2 x (4 + 2) + the final norm; GeGLU
        assert offsets == {"Gemma3RMSNorm": 1.0}
        assert applied[1:3] == ["rms_norm: 13 x Gemma3RMSNorm", "swiglu: 2 x Gemma3MLP"]
    assert all(m.forward.__func__ is _fused_lora_forward for m in loras)
    rope = _fused_apply_rotary_pos_emb_half_tables if table.rope_half_tables else _fused_apply_rotary_pos_emb
    assert modeling.apply_rotary_pos_emb is (stock_rope if "rope" in stock else rope)
    logits_on, loss_on, grads_on = _step(model, device)

    torch.testing.assert_close(logits_on, logits_off, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_on, loss_off, atol=1e-5, rtol=1e-5)
    assert grads_on.keys() == grads_off.keys() and any("lora_A" in name for name in grads_on)
    for name, grad in grads_on.items():
        torch.testing.assert_close(grad, grads_off[name], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    revert_kernels(model)
    assert all("forward" not in m.__dict__ for m in norms + mlps + loras)
    assert modeling.apply_rotary_pos_emb is stock_rope
    logits_back, loss_back, grads_back = _step(model, device)
    assert torch.equal(logits_back, logits_off) and torch.equal(loss_back, loss_off)
    assert all(torch.equal(grads_back[name], grad) for name, grad in grads_off.items())


def _relative_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe", "gemma3_text", "gpt_oss"])
def test_all_on_matches_all_off_in_bf16(model_type, device):
    model = _tiny_lora_model(model_type, device).to(torch.bfloat16)
    logits_off, loss_off, grads_off = _step(model, device)
    apply_kernels(model, ALL_ON)
    logits_on, loss_on, grads_on = _step(model, device)
    revert_kernels(model)
    torch.testing.assert_close(loss_on, loss_off, atol=0, rtol=1e-2)
    assert _relative_l2(logits_on, logits_off) <= 5e-2
    grad_tol = 20e-2 if model_type == "gemma3_text" and device == "cpu" else 15e-2
    for name, grad in grads_on.items():
        assert _relative_l2(grad, grads_off[name]) <= grad_tol, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_fused_rope_is_a_drop_in_for_hf(device, unsqueeze_dim):
    modeling = importlib.import_module(PATCH_TABLES["llama"].modeling_module)
    torch.manual_seed(0)
    q, k = torch.randn(2, 5, 4, 16, device=device), torch.randn(2, 5, 2, 16, device=device)  # [B, T, H, D]
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = torch.randn(1, 5, 16, device=device), torch.randn(1, 5, 16, device=device)
    expected = modeling.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    got = _fused_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_fused_rope_with_half_tables_is_a_drop_in_for_gpt_oss(device, unsqueeze_dim):
    """gpt-oss's apply_rotary_pos_emb takes cos/sin of D/2 columns (yarn-scaled, from its rotary embedding)."""
    modeling = importlib.import_module(PATCH_TABLES["gpt_oss"].modeling_module)
    config = transformers.GptOssConfig(
        head_dim=16, max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 128, "truncate": False},
    )  # fmt: skip
    torch.manual_seed(0)
    q, k = torch.randn(2, 5, 4, 16, device=device), torch.randn(2, 5, 2, 16, device=device)  # [B, T, H, D]
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    position_ids = torch.tensor([[0, 1, 2, 0, 3000], [7, 8, 9, 10, 11]], device=device)
    cos, sin = modeling.GptOssRotaryEmbedding(config).to(device)(q, position_ids)
    assert cos.shape == (2, 5, 8)
    expected = modeling.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    got = _fused_apply_rotary_pos_emb_half_tables(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    for out, ref in zip(got, expected, strict=True):
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_rope_patch_is_reference_counted_across_models():
    modeling = importlib.import_module(PATCH_TABLES["llama"].modeling_module)
    stock_rope = modeling.apply_rotary_pos_emb
    first, second = _tiny_lora_model("llama", "cpu"), _tiny_lora_model("llama", "cpu")
    apply_kernels(first, {"rope": True})
    apply_kernels(second, {"rope": True})
    revert_kernels(first)
    assert modeling.apply_rotary_pos_emb is _fused_apply_rotary_pos_emb
    revert_kernels(second)
    assert modeling.apply_rotary_pos_emb is stock_rope


def test_applying_twice_replaces_the_first_patch():
    model = _tiny_lora_model("qwen3", "cpu")
    apply_kernels(model, {"rms_norm": True, "swiglu": True})
    # 2 layers x (input, post-attention, q, k norms) + the final norm
    assert apply_kernels(model, {"rms_norm": True}) == ["rms_norm: 9 x Qwen3RMSNorm"]
    assert not any("forward" in m.__dict__ for m in model.modules() if type(m).__name__ == "Qwen3MLP")
    revert_kernels(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("name", sorted(GLU_ACTIVATIONS))
def test_every_glu_activation_name_computes_what_transformers_does(name):
    """Each transformers activation name the swiglu patch takes is the kernel activation it maps to."""
    torch.manual_seed(0)
    gate, up = 4 * torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    expected = ACT2FN[name](gate) * up
    torch.testing.assert_close(swiglu_reference(gate, up, GLU_ACTIVATIONS[name]), expected, atol=1e-9, rtol=1e-9)


def test_an_mlp_activation_without_a_kernel_runs_stock():
    model = _tiny_lora_model("llama", "cpu")
    model.config.hidden_act = "relu"
    assert apply_kernels(model, {"swiglu": True}) == [
        f"swiglu: stock (the MLP's activation 'relu' is none of {sorted(GLU_ACTIVATIONS)})"
    ]
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_rejects_unknown_switches_and_runs_an_unknown_architecture_stock():
    model = _tiny_lora_model("llama", "cpu")
    with pytest.raises(ValueError, match="unknown kernel switches"):
        apply_kernels(model, {"rmsnorm": True})
    model.config.model_type = "gpt2"
    lines = apply_kernels(model, ALL_ON)
    assert lines[0].startswith("lora: ") and lines[0].endswith(" x peft lora.Linear")
    for line, name in zip(lines[1:], ["rms_norm", "swiglu", "rope"], strict=True):
        assert line.startswith(f"{name}: stock (no patch table for model_type 'gpt2'; tables exist for ['deepseek_v3', ")
    assert not any("forward" in m.__dict__ for m in model.modules() if "RMSNorm" in type(m).__name__)
    assert apply_kernels(model, ALL_OFF) == []


@pytest.mark.parametrize("model_type", sorted(PATCH_TABLES))
def test_every_class_a_patch_table_names_exists_in_its_modeling_module(model_type):
    """A renamed transformers class fails here, by name, rather than as an unpatched (stock, slower) model."""
    table = PATCH_TABLES[model_type]
    modeling = importlib.import_module(table.modeling_module)
    names = [*table.rms_norm, *table.mlp, "apply_rotary_pos_emb"]
    if table.moe is not None:
        names += [table.moe.sparse_block, table.moe.router, table.moe.decoder_layer]
    assert [n for n in names if not hasattr(modeling, n)] == []
    if table.moe is not None:
        assert getattr(modeling, table.moe.sparse_block) in moe_classes("sparse_block")
