"""model.quantization=nf4 on an MoE model (model/nf4_experts.py): the frozen experts in NF4 on the triton and grouped_mm
MoE backends."""

import pytest
import torch

from lightning_ft.kernels.moe import moe_experts, sort_by_expert
from lightning_ft.model.build import ModelBuilder
from lightning_ft.model.nf4_experts import dequantize_experts, experts_bytes, nf4_weight
from lora_step_checks import assert_same_step, lora_step
from tiny_model import TINY_MODEL

bnb = pytest.importorskip("bitsandbytes", reason='model.quantization=nf4 needs bitsandbytes: pip install -e ".[qlora]"')

LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "o_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
EXPERT_WEIGHTS = 4  # gate_up and down in each of 2 layers
LOGGER = "lightning.pytorch.utilities.rank_zero"


def _build(quantization="nf4", backend="triton", dtype="float32", device="cpu"):
    model = {**TINY_MODEL, "quantization": quantization, "dtype": dtype, "attention": "sdpa"}
    with torch.device(device):
        return ModelBuilder(model, LORA, moe={"backend": backend}, seed=0)(torch.device(device)).model


def _experts(model, layer=0):
    return model.get_base_model().model.layers[layer].mlp.experts.base_layer.base_layer


def test_random_init_keeps_the_experts_as_bitsandbytes_quantises_them_in_qloras_bytes(caplog):
    """Each expert weight is bitsandbytes' NF4 + double quantisation of the dense one (the same random init), the
    parameter a 2-byte placeholder of its shape (PEFT reads it); bf16: (1/2 + 1/64) bytes a weight and a few
    tables against 2."""
    dense = _experts(_build("none", dtype="bfloat16"))
    with caplog.at_level("INFO", logger=LOGGER):
        model = _build(dtype="bfloat16")
    assert f"quantization: {EXPERT_WEIGHTS} expert weights quantised to NF4: 0.01 MiB (0.04 MiB in model.dtype)" in caplog.messages
    experts = _experts(model)
    for name, shape in (("gate_up_proj", (4, 48, 32)), ("down_proj", (4, 32, 24))):
        placeholder = getattr(experts, name)
        assert placeholder.shape == shape and placeholder.untyped_storage().nbytes() == 2 and not placeholder.requires_grad
        packed, state = bnb.functional.quantize_4bit(
            getattr(dense, name).detach(), blocksize=64, compress_statistics=True, quant_type="nf4"
        )
        weight = nf4_weight(experts, name)
        assert weight.dtype == torch.bfloat16 and torch.equal(weight.packed, packed.view(-1)), name
        assert torch.equal(weight.absmax, state.absmax) and torch.equal(weight.absmax2, state.state2.absmax), name
    held, dense_bytes = experts_bytes(model)
    weights = 2 * (4 * 48 * 32 + 4 * 32 * 24)
    assert dense_bytes == 2 * weights and held == weights // 2 + weights // 64 + EXPERT_WEIGHTS * (4 + 273 * 4 + 2)


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize(("dtype", "device"), [
    ("float32", "cpu"), ("bfloat16", "cpu"), pytest.param("bfloat16", "cuda", marks=pytest.mark.gpu),
])  # fmt: skip
def test_logits_and_lora_gradients_equal_the_dequantised_twin(dtype, device, backend):
    """The model with NF4 experts and the same model with them dequantised to dense weights (both on the same
    backend) give the same logits and LoRA gradients: the NF4 weights are dequantised into the reused buffer and
    then run the dense twin's launches, so bitwise on the CPU; on CUDA to 1e-2 of each tensor's largest value (the
    rest of the step, attention's backward included, need not repeat bit for bit on the GPU). The expert LoRA's B
    is made non-zero so that every factor gets a gradient. (The twin's dense weights get no LoRA slots on
    grouped_mm: it dequantises after the build.)"""
    model, twin = _build(backend=backend, dtype=dtype, device=device), _build(backend=backend, dtype=dtype, device=device)
    assert nf4_weight(_experts(model, 1), "down_proj") is not None and dequantize_experts(twin) == EXPERT_WEIGHTS
    assert_same_step(lora_step(model), lora_step(twin), 2 * EXPERT_WEIGHTS, rtol=1e-2 if device == "cuda" else 0.0)


def test_moe_backend_auto_takes_triton_for_nf4_experts_on_cuda_only_as_export_rebuilds_them(caplog):
    """``auto`` is triton on CUDA (the backend that reads NF4 experts), as a pure function of the config and the run's
    device, which export reads back; on the CPU the experts stay dense, logged with why."""
    from lightning_ft.model.build import nf4_experts_backend

    assert nf4_experts_backend("auto", on_cuda=True) == "triton" and nf4_experts_backend("auto", on_cuda=False) == "auto"
    assert nf4_experts_backend("native_torch", on_cuda=True) == "native_torch"
    with caplog.at_level("INFO", logger=LOGGER):
        model = _build(backend="auto")
    assert "quantization: the MoE experts stay in float32: moe.backend=auto takes triton, which keeps them in NF4 too, " \
           "on CUDA only (moe.backend=grouped_mm keeps them in NF4 anywhere)" in caplog.messages
    assert nf4_weight(_experts(model), "gate_up_proj") is None


def test_other_backends_keep_the_experts_dense_and_refuse_nf4_weights(caplog):
    """moe.backend other than triton and grouped_mm: the linear layers in NF4, the experts in model.dtype (logged once);
    the experts function refuses NF4 weights there."""
    with caplog.at_level("INFO", logger=LOGGER):
        model = _build(backend="native_torch")
    assert caplog.messages.count("quantization: the MoE experts stay in float32: moe.backend=native_torch reads dense "
                                 "weights (moe.backend=triton or grouped_mm keeps them in NF4 too)") == 1
    experts = _experts(model)
    assert nf4_weight(experts, "gate_up_proj") is None and experts.gate_up_proj.untyped_storage().nbytes() == 4 * 48 * 32 * 4
    weight = nf4_weight(_experts(_build()), "gate_up_proj")
    x = torch.randn(3, 32)
    topk = torch.tensor([[0, 1], [1, 2], [3, 0]])
    with pytest.raises(ValueError, match="NF4 expert weights run on the triton and grouped_mm MoE backends, not native_torch: "
                                         "set moe.backend=triton"):
        moe_experts(x, torch.rand(3, 2), sort_by_expert(topk, 4), weight, torch.randn(4, 32, 24), torch.nn.functional.silu,
                    backend="native_torch")


@pytest.mark.slow
def test_fit_on_nf4_experts_then_export_merge_reproduces_the_trained_logits(tmp_path, caplog):
    """The CLI: the tiny default Qwen3-MoE, LoRA on attention and experts, the base in NF4 (linear layers through
    kernels.lora, experts through the triton backend; Triton interpreted here): the loss falls, the adapter is plain
    PEFT (no NF4 tensors); ``export --merge`` writes dense experts (its summary line counts them with the linear
    layers), and the merged model computes the trained model's logits (fp32; the merge rounds, 1e-4)."""
    from cli_helpers import FAST, run_cli, summary
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lightning_ft.export import main as export_main

    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *FAST, "trainer.max_steps=3", "scheduler.num_warmup_steps=0", "lora=moe", "moe.backend=triton",
                   "model.quantization=nf4", "kernels.lora=true", "model.config.num_hidden_layers=1", "data.max_tokens=64",
                   "+callbacks.logits._target_=cli_helpers.DumpLogits", f"+callbacks.logits.path={run_dir / 'logits.pt'}")
    assert "quantization: 2 expert weights quantised to NF4" in proc.stdout + proc.stderr
    s = summary(run_dir)
    assert s["steps"] == 3 and s["final_loss"] < s["initial_loss"]
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert any("experts" in key for key in adapter) and not any("_nf4_" in key for key in adapter)
    with caplog.at_level("INFO", logger="lightning_ft.export"):
        assert export_main([str(run_dir), "--merge"]) == 0
    assert ("export: merged/ in float32: 4 NF4 linear layers and 2 NF4 expert weights of the base dequantised before "
            "the adapter is merged") in caplog.messages
    merged = AutoModelForCausalLM.from_pretrained(str(run_dir / "export" / "merged"))
    state = merged.state_dict()
    assert not any("_nf4_" in key for key in state) and state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 256, 128)
    assert not any(type(m).__name__ == "Linear4bit" for m in merged.modules())
    reference = torch.load(run_dir / "logits.pt")  # the trained model's own logits (NF4 base, our kernels)
    with torch.no_grad():
        logits = merged.eval()(input_ids=reference["input_ids"]).logits
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=1e-4)


def test_the_nf4_refusals_hold_for_moe_models_on_the_triton_backend():
    """No LoRA and FSDP2 are refused before any weight loads, as for a dense nf4 model."""

    model = {**TINY_MODEL, "quantization": "nf4"}
    with pytest.raises(ValueError, match="only LoRA can train: set lora.enabled=true"):
        ModelBuilder(model, {**LORA, "enabled": False}, moe={"backend": "triton"})(torch.device("cpu"))
    with pytest.raises(ValueError, match="does not run under strategy=fsdp2"):
        ModelBuilder(model, LORA, moe={"backend": "triton"})(torch.device("cpu"), sharded=True)


def test_strategy_fp8_leaves_the_nf4_experts_in_nf4_computing_in_model_dtype(monkeypatch, caplog):
    """strategy.fp8 over nf4 (the device check passed by hand): the LoRA linear layers' 4-bit bases get their e4m3
    scales, the NF4 experts stay NF4 (not converted to fp8 from their placeholders), said once."""
    import lightning_ft.model.build as build
    from lightning_ft.strategies.fp8 import fp8_expert_weight
    from lightning_ft.strategies.strategy import Execution

    monkeypatch.setattr(build, "check_fp8_device", lambda device: None)
    model = {**TINY_MODEL, "quantization": "nf4", "dtype": "bfloat16", "attention": "sdpa"}
    with caplog.at_level("INFO", logger=LOGGER):
        built = ModelBuilder(model, LORA, kernels={"lora": True}, moe={"backend": "triton"}, seed=0,
                             execution=Execution(fp8=True))(torch.device("cpu")).model
    assert "fp8: 4 4-bit base weights computed in e4m3 (NF4 storage, per-output-channel scales)" in caplog.messages  # q/o
    assert caplog.messages.count("fp8: the NF4 MoE experts compute in bfloat16 (dequantised to it before the grouped GEMM)") == 1
    experts = _experts(built)
    assert all(nf4_weight(experts, n) is not None and fp8_expert_weight(experts, n) is None for n in ("gate_up_proj", "down_proj"))


def test_a_checkpoints_experts_are_quantized_one_at_a_time_as_they_load(tmp_path, monkeypatch, caplog):
    """A 16-bit checkpoint (transformers stores the experts one by one and stacks them as it loads): each fused expert
    weight is quantised as soon as it is set, while no other expert weight is dense yet, so the 16-bit experts are
    never on the device together; the result is bitwise the same as quantising after loading, and the log says so."""
    import lightning_ft.model.nf4_experts as nf4_experts
    from lightning_ft.model.build import load_causal_lm

    load_causal_lm(None, "random", dict(TINY_MODEL["config"]), dtype="bfloat16").save_pretrained(tmp_path / "bf16")
    after = load_causal_lm(str(tmp_path / "bf16"), dtype="bfloat16", quantization="nf4")  # experts dense on load
    assert nf4_experts.quantize_experts(after) == EXPERT_WEIGHTS

    dense_alive = []
    quantize = nf4_experts._quantize

    def spy(experts, name):
        model_experts = [m for m in loading_model[0].modules() if m is not experts and hasattr(m, "gate_up_proj")]
        dense_alive.append(sum(getattr(getattr(m, n), "ndim", 0) == 3 and getattr(m, n).stride(0) != 0
                               and not hasattr(m, f"{n}_nf4_packed") and getattr(m, n).device.type != "meta"
                               for m in model_experts for n in ("gate_up_proj", "down_proj")))
        return quantize(experts, name)

    loading_model = []
    import transformers.core_model_loading as loading

    original_set = loading.set_param_for_module

    def remember(model, *args, **kwargs):  # the model being loaded, for the spy
        loading_model[:] = [model]
        return original_set(model, *args, **kwargs)

    monkeypatch.setattr(loading, "set_param_for_module", remember)
    monkeypatch.setattr(nf4_experts, "_quantize", spy)
    on_load = load_causal_lm(str(tmp_path / "bf16"), dtype="bfloat16", quantization="nf4", experts_in_nf4=True)
    assert len(dense_alive) == EXPERT_WEIGHTS and dense_alive == [0] * EXPERT_WEIGHTS
    assert loading.set_param_for_module is remember  # the load's own hook undone
    for layer in (0, 1):
        ours, reference = (m.model.layers[layer].mlp.experts for m in (on_load, after))
        for name in ("gate_up_proj", "down_proj"):
            a, b = nf4_weight(ours, name), nf4_weight(reference, name)
            assert a is not None and all(torch.equal(getattr(a, p), getattr(b, p)) for p in ("packed", "absmax", "absmax2", "tables"))
    assert nf4_experts.quantize_experts(on_load) == 0  # nothing left to quantise after the load
