"""Building the model from the config: LoRA targets and model config values refused by key, before PEFT or
transformers would drop or reject them."""

from pathlib import Path

import pytest
import torch

from lightning_ft.kernels.mxfp4 import dequantize_mxfp4_reference

from lightning_ft.model.build import ModelBuilder
from tiny_model import LORA, TINY_MODEL

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("key", "targets", "message"),
    [
        ("target_modules", ["q_proj", "vv_proj"], r"lora.target_modules: \['vv_proj'\] are not in the model; its layers have: .*self_attn.q_proj"),
        ("target_parameters", ["mlp.experts.foo"], r"lora.target_parameters: \['mlp.experts.foo'\] are not in the model; .*: mlp.experts.down_proj, mlp.experts.gate_up_proj$"),
        ("target_modules", ["all-linear"], r"lora.target_modules: all-linear is a name for PEFT's shorthand, not a layer: pass it alone, lora.target_modules=all-linear$"),
    ],
)
def test_a_lora_target_that_matches_nothing_is_refused_by_key(key, targets, message):
    """PEFT drops an unmatched name of a target list (or only warns, for target_parameters) and trains without it."""
    with pytest.raises(ValueError, match=message):
        ModelBuilder(model=TINY_MODEL, lora={**LORA, key: targets})(CPU)


def test_an_unmatched_lora_target_names_the_lora_groups_that_fit():
    """MLA (DeepSeek-V3) has no q/k/v_proj: the message points at lora=mla."""
    import yaml

    from lightning_ft.config import config_dir

    model = yaml.safe_load((Path(config_dir()) / "model" / "deepseek_v3_tiny.yaml").read_text())
    with pytest.raises(ValueError, match=r"\['q_proj', 'v_proj'\] are not in the model; .*; the lora groups that fit this model: lora=mla$"):
        ModelBuilder(model=model, lora=LORA)(CPU)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        # PEFT reads a str as a regex that must match a whole module name: "q_proj" matches nothing
        ("target_modules", "q_proj", r"^lora.target_modules='q_proj' matches no module: a string is a regular expression over "
         r"full module names \(such as model.layers.0.self_attn.q_proj\); for module names use a list, such as "
         r"lora.target_modules=\[q_proj\]; its layers have: .*self_attn.q_proj"),
        ("target_modules", r"layers\.\d+\.self_attn\.q_proj", r"matches no module: .* such as lora.target_modules=\[self_attn.q_proj\];"),
        ("target_modules", "q_proj[", r"^lora.target_modules='q_proj\[': a string is a regular expression .* not valid"),
        # PEFT takes no str here (TypeError); list() would have split it into characters
        ("target_parameters", "mlp.experts.gate_up_proj", r"^lora.target_parameters='mlp.experts.gate_up_proj': expected a list "
         r"of parameter names, such as lora.target_parameters=\[mlp.experts.gate_up_proj\]$"),
    ],
)
def test_a_lora_target_string_that_matches_no_module_name_is_refused_by_key(key, value, message):
    """Before the model would reach PEFT, which raises NoMatchingPeftModuleError (or a TypeError, or re.error)."""
    with pytest.raises(ValueError, match=message):
        ModelBuilder(model=TINY_MODEL, lora={**LORA, key: value})(CPU)


def test_a_lora_target_string_is_a_regex_over_full_names_as_peft_reads_it():
    """A regex that matches (anchored or not) and ``all-linear`` still reach PEFT: the same adapters as the list."""
    def adapted(target_modules):
        model = ModelBuilder(model=TINY_MODEL, lora={**LORA, "target_modules": target_modules})(CPU).model
        return sorted(n for n, p in model.named_parameters() if p.requires_grad)

    listed = adapted(LORA["target_modules"])
    assert listed and adapted(r".*\.(q_proj|v_proj|o_proj)") == listed
    assert adapted(r"model\.layers\.\d+\.self_attn\.(q|v|o)_proj") == listed
    assert set(listed) < set(adapted("all-linear"))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_hidden_layers": "abc"}, r"^model.config.num_hidden_layers='abc': expected int, got str \(value: 'abc'\)$"),
        ({"norm_topk_prob": "yes"}, r"^model.config.norm_topk_prob='yes': expected bool, got str"),
        ({"hidden_size": 2.5}, r"^model.config.hidden_size=2.5: expected int, got float"),
    ],
)
def test_a_model_config_value_of_the_wrong_type_is_refused_by_key(config, message):
    """transformers' configs are strict dataclasses: huggingface_hub raised StrictDataclassFieldValidationError."""
    model = {**TINY_MODEL, "config": {**TINY_MODEL["config"], **config}}
    with pytest.raises(ValueError, match=message):
        ModelBuilder(model=model, lora=LORA)(CPU)


def test_a_model_config_key_that_is_a_near_miss_of_a_field_is_refused(caplog, monkeypatch):
    """transformers keeps any extra key as an attribute nothing reads: num_hidden_layer built the default depth."""
    model = {**TINY_MODEL, "config": {**TINY_MODEL["config"], "num_hidden_layer": 1}}
    with pytest.raises(ValueError, match=r"^model.config.num_hidden_layer: Qwen3MoeConfig has no such field; did you mean model.config.num_hidden_layers\?$"):
        ModelBuilder(model=model, lora=LORA)(CPU)
    # a key the class does not declare but a model may read (Qwen3-MoE's head_dim is one) is set as given
    model = {**TINY_MODEL, "config": {**TINY_MODEL["config"], "my_note": "x"}}
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        built = ModelBuilder(model=model, lora=LORA)(CPU).model
    assert built.config.my_note == "x" and built.config.head_dim == 16
    assert caplog.messages.count("model.config.my_note: not a declared field of Qwen3MoeConfig; set on the config as given") == 1
    # said once a run: the other ranks of a multi-device run, which build the model too, say nothing
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_ft.model.build import _check_config_keys

    caplog.clear()
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        _check_config_keys(built.config, {"my_note": "x"})
    assert caplog.messages == []


def test_a_model_config_activation_that_transformers_lacks_is_refused_with_the_closest_names():
    """An activation transformers' ACT2FN lacks is refused by key, with the closest names, before the model is built."""
    model = {**TINY_MODEL, "config": {**TINY_MODEL["config"], "hidden_act": "gelu_typo"}}
    with pytest.raises(ValueError, match=r"^model.config.hidden_act=gelu_typo: expected one of .*silu.*; did you mean model.config.hidden_act=gelu"):
        ModelBuilder(model=model, lora=LORA)(CPU)
    model = {**TINY_MODEL, "config": {**TINY_MODEL["config"], "hidden_act": "gelu"}}  # a name it has builds
    assert ModelBuilder(model=model, lora=LORA)(CPU).model.config.hidden_act == "gelu"


#: the tiny Qwen3-MoE without its head_dim: the config derives the head size, hidden_size / num_attention_heads
_DERIVED_HEADS = {k: v for k, v in TINY_MODEL["config"].items() if k != "head_dim"}


@pytest.mark.parametrize(
    ("config", "message"),
    [  # Qwen3-MoE's config checks none of these
        ({"num_attention_heads": 5, "num_key_value_heads": 2}, r"^model.config.num_attention_heads=5 with num_key_value_heads=2: .*must divide"),
        ({"num_attention_heads": 5}, r"^model.config.num_attention_heads=5 with hidden_size=32: does not divide it; "),
        ({"hidden_size": 96, "num_attention_heads": 32},
         r"^model.config.num_attention_heads=32 with hidden_size=96: gives each head 3 channels, and RoPE needs an even"),
    ],
)
def test_model_config_head_counts_that_do_not_fit_are_refused_by_key(config, message):
    model = {**TINY_MODEL, "config": {**_DERIVED_HEADS, **config}}
    with pytest.raises(ValueError, match=message):
        ModelBuilder(model=model, lora=LORA)(CPU)
    fits = {**TINY_MODEL, "config": {**_DERIVED_HEADS, "num_attention_heads": 4, "num_key_value_heads": 2}}
    assert ModelBuilder(model=fits, lora=LORA)(CPU).model.config.num_attention_heads == 4  # 8-wide heads, groups of 2


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_head_sizes_a_config_stores_derived_are_checked_too(model_type):
    """Llama's and Mistral's configs store the head size they derive (hidden_size / num_attention_heads): an odd one
    is refused as for configs without one."""
    base = {"model_type": model_type, "vocab_size": 64, "intermediate_size": 64, "num_hidden_layers": 1, "num_key_value_heads": 4}
    with pytest.raises(ValueError, match=r"^model.config.num_attention_heads=32 with hidden_size=96: gives each head 3 channels"):
        ModelBuilder(model={**TINY_MODEL, "config": {**base, "hidden_size": 96, "num_attention_heads": 32}}, lora=LORA)(CPU)


def _dequantise_mxfp4(blocks, scales):
    """The [E, C, N] weight that gpt-oss's ``<proj>_blocks`` [E, N, C/32, 16] / ``<proj>_scales`` [E, N, C/32] stand for."""
    return dequantize_mxfp4_reference(blocks, scales, torch.float32).transpose(1, 2)


def _write_checkpoint(folder, config, state_dict, quantization=None):
    import json

    from safetensors.torch import save_file

    folder.mkdir()
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    values = {**config.to_dict(), "architectures": ["GptOssForCausalLM"]}
    if quantization is not None:
        values["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(values))


def _mxfp4_checkpoint_and_bf16_twin(tmp_path):
    """A tiny gpt-oss checkpoint with its experts in the published MXFP4 layout (random codes and scales), and a
    bf16 checkpoint holding the same values; returns the MXFP4 state."""
    import transformers
    import yaml

    from lightning_ft.config import config_dir

    overrides = yaml.safe_load((Path(config_dir()) / "model" / "gpt_oss_tiny.yaml").read_text())["config"]
    config = transformers.AutoConfig.for_model(overrides.pop("model_type"), **overrides, vocab_size=64)
    torch.manual_seed(0)
    state = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).state_dict()
    quantised, twin = dict(state), dict(state)
    for name, weight in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, c_dim, n_dim = weight.shape
            blocks = torch.randint(0, 256, (experts, n_dim, c_dim // 32, 16), dtype=torch.uint8)
            scales = torch.randint(122, 130, (experts, n_dim, c_dim // 32), dtype=torch.uint8)
            del quantised[name]
            quantised |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
            twin[name] = _dequantise_mxfp4(blocks, scales).to(torch.bfloat16)  # exact: 2 significant bits
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    _write_checkpoint(tmp_path / "mxfp4", config, quantised, mxfp4)
    _write_checkpoint(tmp_path / "bf16", config, twin)
    return quantised


def test_an_mxfp4_gpt_oss_checkpoint_loads_as_its_dequantised_bf16_twin(tmp_path):
    """Experts stored in the published MXFP4 layout load through the normal from_pretrained path dequantised to
    model.dtype: every weight and the logits equal those of a bf16 checkpoint holding the same values."""
    from lightning_ft.model.build import load_causal_lm

    _mxfp4_checkpoint_and_bf16_twin(tmp_path)
    loaded = load_causal_lm(str(tmp_path / "mxfp4"), dtype="bfloat16", attn_implementation="eager")
    reference = load_causal_lm(str(tmp_path / "bf16"), dtype="bfloat16", attn_implementation="eager")
    assert not getattr(loaded, "is_quantized", False)
    loaded_state = loaded.state_dict()
    assert loaded_state.keys() == reference.state_dict().keys()
    for name, weight in reference.state_dict().items():
        assert loaded_state[name].dtype == weight.dtype and torch.equal(loaded_state[name], weight), name
    ids = torch.tensor([[3, 7, 1, 9, 4, 2]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_model_quantization_mxfp4_keeps_an_mxfp4_checkpoint_s_experts_as_they_are(tmp_path):
    """model.quantization=mxfp4: the checkpoint's blocks and scales are the experts' buffers byte for byte (not
    dequantised and quantised again); the bf16 twin is quantised after loading to the same values; dequantised,
    every weight equals the twin's."""
    from lightning_ft.model.build import load_causal_lm
    from lightning_ft.model.mxfp4 import dequantize_experts

    quantised = _mxfp4_checkpoint_and_bf16_twin(tmp_path)
    kept = load_causal_lm(str(tmp_path / "mxfp4"), dtype="bfloat16", attn_implementation="eager", quantization="mxfp4")
    requantised = load_causal_lm(str(tmp_path / "bf16"), dtype="bfloat16", attn_implementation="eager", quantization="mxfp4")
    state = kept.state_dict()
    for name, value in quantised.items():
        if name.endswith(("_blocks", "_scales")):
            assert torch.equal(state[name], value), name
            assert requantised.state_dict()[name].shape == value.shape, name
    reference = load_causal_lm(str(tmp_path / "bf16"), dtype="bfloat16", attn_implementation="eager")
    for model in (kept, requantised):
        assert dequantize_experts(model) == 4
        assert model.state_dict().keys() == reference.state_dict().keys()
        for name, weight in reference.state_dict().items():
            assert torch.equal(model.state_dict()[name], weight), name


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_an_encoder_config_built_as_a_causal_lm_is_refused_unless_it_is_a_decoder(model_type):
    """BERT's family reads ``is_decoder=False`` as an encoder, whose tokens see the later ones: the next-token loss
    would read the answer. ``is_decoder=true`` builds; GPT-NeoX, causal whatever its flag says, builds as it is."""
    from transformers import AutoConfig

    from lightning_ft.model.build import load_causal_lm
    from lightning_ft.model.support import tiny_config

    def config(name, **values):
        return {**{k: v for k, v in tiny_config(AutoConfig.for_model(name)).to_dict().items() if k != "transformers_version"},
                "model_type": name, **values}

    state = torch.random.get_rng_state()
    with pytest.raises(ValueError, match=rf"model.config.is_decoder is false \(the default of '{model_type}' configs\): the "
                                         r"model then lets each token see the later ones.*\+model.config.is_decoder=true$"):
        load_causal_lm(None, init="random", config=config(model_type))
    assert torch.equal(torch.random.get_rng_state(), state)  # the probe leaves the seeded random state alone
    assert load_causal_lm(None, init="random", config=config(model_type, is_decoder=True)).config.is_decoder
    assert load_causal_lm(None, init="random", config=config("gpt_neox")).config.is_decoder is False


def test_a_router_trained_in_full_that_all_linear_also_targets_is_refused_by_key():
    """moe.train_router puts the routers in lora.modules_to_save; PEFT's all-linear on Qwen3-MoE also gives the router
    weight LoRA, and PEFT then fails with a TypeError deep in its wrapping: a ValueError naming both keys instead."""
    with pytest.raises(ValueError, match=r"lora.modules_to_save=\['mlp.gate'\] \(moe.train_router adds the routers there\): "
                                         r"PEFT's lora.target_modules=all-linear already puts LoRA on one of them .*e.g. lora=moe\)$"):
        ModelBuilder(model=TINY_MODEL, lora={**LORA, "target_modules": "all-linear"}, moe={"train_router": True}, seed=0)(CPU)


@pytest.mark.parametrize("interpreter", [False, True])
def test_the_start_log_says_where_triton_kernels_run_their_reference(caplog, monkeypatch, interpreter):
    """On the CPU without Triton's interpreter the kernels switched on run their plain-torch references: one line says
    which (they are logged as fused above it); with the interpreter, none."""
    import lightning_ft.model.build as build

    monkeypatch.setattr(build, "INTERPRETER", interpreter)
    kernels = dict(rms_norm=True, rope=False, swiglu=True, lora=True, fused_linear_cross_entropy=False)
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        ModelBuilder(TINY_MODEL, LORA, kernels=kernels, seed=0)(torch.device("cpu"))
    lines = [m for m in caplog.messages if "Triton cannot run" in m]
    assert lines == ([] if interpreter else [
        "qwen3_moe kernels: Triton cannot run on the CPU (without TRITON_INTERPRET=1): rms_norm, swiglu run their "
        "plain-torch references, same math"])


def test_the_start_log_names_the_stock_experts_backend_of_an_moe_model(caplog):
    """moe=hf on an MoE model says so (each of our backends has its own line)."""
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        ModelBuilder(TINY_MODEL, LORA, moe={"backend": "hf"}, seed=0)(torch.device("cpu"))
    assert "moe: hf experts backend (transformers' own; moe=auto, grouped_mm or triton for ours)" in caplog.messages


def test_an_adapter_or_checkpoint_of_another_shape_is_refused_by_key(tmp_path):
    """lora.init_from with an adapter of other dims, and a checkpoint loaded under a model.config of another shape:
    one ValueError naming the key and the mismatch, not PEFT's or transformers' report."""
    built = ModelBuilder(model=TINY_MODEL, lora=LORA)(CPU)
    built.model.save_pretrained(tmp_path / "adapter")
    wider = {**TINY_MODEL, "config": {**TINY_MODEL["config"], "hidden_size": 48}}
    with pytest.raises(ValueError, match=r"lora.init_from=.*: the adapter does not fit this model \(size mismatch for .*q_proj"):
        ModelBuilder(model=wider, lora={**LORA, "init_from": str(tmp_path / "adapter")})(CPU)
    from lightning_ft.model.build import load_causal_lm

    load_causal_lm(None, "random", dict(TINY_MODEL["config"])).save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match=r"model.name_or_path=.*base: its weights do not fit .*\(hidden_size=48\)"):
        load_causal_lm(str(tmp_path / "base"), "pretrained", {"hidden_size": 48})
