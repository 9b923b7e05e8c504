"""The fused LoRA forward on PEFT's ``lora.Linear`` layers (`lightning_ft.model.lora`, installed by the
``lora`` kernel switch of `lightning_ft.model.patching`) against PEFT's own forward, and the adapters
it takes (`lora_linear_adapters`)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from lightning_ft.kernels.lora import lora_linear
from lightning_ft.model.lora import _fused_lora_forward, lora_linear_adapters
from lightning_ft.model.patching import apply_kernels, revert_kernels

def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _peft_model(**lora_kwargs):
    """A one-layer random Llama with LoRA on q_proj and v_proj."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **lora_kwargs)
    return get_peft_model(model, lora)


def _lora_layers(model):
    return [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast"])
def test_the_patch_computes_what_peft_computes(precision, monkeypatch):
    import lightning_ft.model.lora as lora_module

    calls = []
    monkeypatch.setattr(lora_module, "lora_linear", lambda *a, **kw: calls.append(1) or lora_linear(*a, **kw))
    model = _peft_model()
    input_ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            logits = model(input_ids=input_ids).logits
        trainable = [p for p in model.parameters() if p.requires_grad]
        return logits, torch.autograd.grad(logits.float().square().mean(), trainable)

    expected = step()
    assert apply_kernels(model, {"lora": True}) == ["lora: 2 x peft lora.Linear"]
    assert all(m.forward.__func__ is _fused_lora_forward for m in _lora_layers(model))
    got = step()
    assert len(calls) == 2  # q_proj and v_proj took our path
    revert_kernels(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    tol = 1e-5 if precision == "fp32" else 5e-2  # bf16: through a whole layer and back (measured 1.4e-2)
    assert got[0].dtype == expected[0].dtype
    assert _rel(got[0], expected[0]) <= tol
    for g, e in zip(got[1], expected[1], strict=True):
        assert g.dtype == e.dtype and _rel(g, e) <= tol


def test_peft_forward_runs_where_the_math_would_differ():
    """Dropout, DoRA or a LoRA bias: the layer is not patched. Two active adapters, disabled or merged adapters,
    per-call adapter_names, a bf16 input to fp32 adapters without autocast: PEFT's forward runs (bit for bit)."""
    for name, kwargs in {"dropout": {"lora_dropout": 0.1}, "dora": {"use_dora": True}, "lora_bias": {"lora_bias": True}}.items():
        model = _peft_model(**kwargs)
        assert lora_linear_adapters(_lora_layers(model)[0]) == frozenset(), name
        assert apply_kernels(model, {"lora": True}) == ["lora: 0 x peft lora.Linear"], name

    def two_adapters():
        model = _peft_model()
        torch.manual_seed(1)
        model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        return model, _lora_layers(model)[0]

    x = torch.randn(5, 32)

    def outputs(model, layer):  # merging and unmerging moves the base weight by rounding: a fresh model each time
        got = {"adapter_names": layer(x, adapter_names=["second"] * 5)}
        layer.set_adapter(["default", "second"])
        got["two_active"] = layer(x)
        layer.set_adapter("default")
        with model.disable_adapter():
            got["disabled"] = layer(x)
        layer.merge()
        got["merged"] = layer(x)
        layer.unmerge()
        layer.base_layer.to(torch.bfloat16)  # bf16 base and input, fp32 adapters, no autocast: PEFT casts to fp32
        got["bf16_no_autocast"] = layer(x.bfloat16())
        layer.base_layer.to(torch.float32)
        return got

    expected = outputs(*two_adapters())
    model, layer = two_adapters()
    assert lora_linear_adapters(layer) == {"default", "second"}
    apply_kernels(model, {"lora": True})
    assert layer.forward.__func__ is _fused_lora_forward
    got = outputs(model, layer)
    for case, value in expected.items():
        assert torch.equal(got[case], value), case
    revert_kernels(model)
    assert "_lightning_ft_lora" not in layer.__dict__ and "forward" not in layer.__dict__


def test_an_adapter_recreated_after_patching_or_a_hooked_base_layer_gets_peft_forward():
    """An adapter deleted and added again under the same name (here with dropout) is new to the patch: PEFT's
    forward runs; a base layer with a forward hook is not patched (lora_linear reads its weight directly)."""
    model = _peft_model()
    apply_kernels(model, {"lora": True})
    model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.set_adapter("other")
    model.delete_adapter("default")
    model.add_adapter("default", LoraConfig(r=4, lora_dropout=0.5, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.set_adapter("default")
    model.train()
    layer = _lora_layers(model)[0]
    x = torch.randn(5, 32)
    torch.manual_seed(3)
    got = layer(x)
    torch.manual_seed(3)
    assert torch.equal(got, type(layer).forward(layer, x))  # the same dropout draw: PEFT's own forward ran

    model = _peft_model()
    _lora_layers(model)[0].base_layer.register_forward_hook(lambda module, args, out: out * 0)
    assert apply_kernels(model, {"lora": True}) == ["lora: 1 x peft lora.Linear"]  # v_proj only


def test_all_linear_leaves_out_transformers_linear_subclasses_with_a_forward_of_their_own(caplog):
    """Phi-MoE's router is an ``nn.Linear`` returning a tuple: ``all-linear`` wraps every other linear (not the head)
    and the step runs; a model without such a subclass passes PEFT's ``all-linear`` through."""
    import logging

    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_ft.model.lora import add_lora, all_linear_targets
    from lightning_ft.model.support import tiny_config

    lora = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
    assert all_linear_targets(AutoModelForCausalLM.from_config(tiny_config(AutoConfig.for_model("llama")))) == "all-linear"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(AutoConfig.for_model("phimoe")))
    with caplog.at_level(logging.INFO):
        model = add_lora(model, lora)
    assert "leaving out router (PhimoeTopKRouter): nn.Linear subclasses whose forward is not a plain linear map" in caplog.text
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert "router" not in wrapped and "lm_head" not in wrapped and {"q_proj", "o_proj"} <= wrapped
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n and "self_attn" in n)
