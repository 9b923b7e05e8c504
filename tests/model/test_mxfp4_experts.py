"""model.quantization=mxfp4 (model/mxfp4.py): gpt-oss's frozen experts kept in MXFP4 on the triton and grouped_mm MoE
backends."""

from pathlib import Path

import pytest
import torch
import yaml

from lightning_ft.config import config_dir
from lightning_ft.model.build import ModelBuilder
from lightning_ft.model.mxfp4 import dequantize_experts, experts_bytes, quantize_experts
from lightning_ft.model.quantization import check_quantization, check_quantized_training
from lora_step_checks import assert_same_step, lora_step

CONFIG = {**yaml.safe_load((Path(config_dir()) / "model" / "gpt_oss_tiny.yaml").read_text())["config"], "vocab_size": 64}
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "o_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
EXPERT_WEIGHTS = 4  # gate_up and down in each of 2 layers
LOGGER = "lightning.pytorch.utilities.rank_zero"


def _build(quantization="mxfp4", dtype="float32", backend="triton"):
    model = {"init": "random", "config": CONFIG, "dtype": dtype, "quantization": quantization, "attention": "sdpa"}
    return ModelBuilder(model, LORA, moe={"backend": backend}, seed=0)(torch.device("cpu")).model


def test_random_init_keeps_the_experts_in_mxfp4_at_about_a_quarter_of_the_bytes(caplog):
    """Blocks and scales in the checkpoints' names and layout; the dense parameter a 2-byte placeholder of its
    shape (PEFT reads it); bf16 experts: (1/2 + 1/32) bytes a weight against 2, exactly; the start log says both."""
    dense = _build("none", "bfloat16")
    with caplog.at_level("INFO", logger=LOGGER):
        kept = _build("mxfp4", "bfloat16")
    assert (f"quantization: {EXPERT_WEIGHTS} expert weights quantised to MXFP4 after the random init: "
            "0.02 MiB (0.09 MiB in model.dtype)") in caplog.messages
    experts = kept.get_base_model().model.layers[0].mlp.experts.base_layer.base_layer
    assert experts.gate_up_proj_blocks.shape == (4, 64, 2, 16) and experts.gate_up_proj_scales.shape == (4, 64, 2)
    assert experts.down_proj_blocks.shape == (4, 64, 1, 16) and experts.down_proj_blocks.dtype == torch.uint8
    assert experts.gate_up_proj.shape == (4, 64, 64) and experts.gate_up_proj.untyped_storage().nbytes() == 2
    weights = 2 * (4 * 64 * 64 + 4 * 32 * 64)  # 2 layers: gate_up [4, 64, 64], down [4, 32, 64]
    assert experts_bytes(dense) == (2 * weights, 2 * weights)
    assert experts_bytes(kept) == (weights // 2 + weights // 32 + 2 * EXPERT_WEIGHTS, 2 * weights)
    assert experts_bytes(kept)[0] / experts_bytes(dense)[0] < 0.27


def test_random_init_draws_each_experts_module_right_before_it_is_quantised(monkeypatch):
    """The model is built on the meta device and each experts module is drawn just before it is quantised (the later
    ones still on meta then), so a model whose dense experts exceed the GPU (gpt-oss-120b) can be built; nothing is
    left on meta; the seed gives the same weights every build, drawn as transformers draws them (RoPE buffers equal a
    stock build's, norms at 1, biases at 0, the rest with the configured spread; not the stock build's values: its
    layers' constructors draw torch's default init first)."""
    import lightning_ft.model.build as build
    import lightning_ft.model.mxfp4 as mxfp4

    found, still_meta = [], []
    monkeypatch.setattr(build, "gpt_oss_experts", lambda model: found.extend(mxfp4.gpt_oss_experts(model)) or found)
    quantize = mxfp4.quantize_mxfp4

    def spy(weight):
        still_meta.append([m.gate_up_proj.is_meta for m in found])
        return quantize(weight)

    monkeypatch.setattr(mxfp4, "quantize_mxfp4", spy)
    kept = _build("mxfp4").get_base_model()
    assert still_meta == [[False, True], [False, True], [False, False], [False, False]]
    assert not any(t.is_meta for t in (*kept.parameters(), *kept.buffers()))
    monkeypatch.undo()
    again = _build("mxfp4").get_base_model()
    for (name, got), (again_name, want) in zip(kept.state_dict().items(), again.state_dict().items(), strict=True):
        assert name == again_name and torch.equal(got, want), name
    stock = _build("none").get_base_model()
    assert torch.equal(kept.model.rotary_emb.inv_freq, stock.model.rotary_emb.inv_freq)
    layer = kept.model.layers[1]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64))
    assert layer.self_attn.sinks.std() > 0 and abs(layer.self_attn.q_proj.base_layer.weight.std() - 0.1) < 0.01
    experts = layer.mlp.experts.base_layer.base_layer
    assert torch.equal(experts.gate_up_proj_bias, torch.zeros(4, 64))
    assert abs(mxfp4.mxfp4_weight(experts, "gate_up_proj").dequantize().std() - 0.1) < 0.01
    logits = kept(torch.arange(10)[None]).logits
    assert logits.isfinite().all()


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_logits_and_lora_gradients_equal_the_dequantised_twin(backend):
    """fp32: the model with MXFP4 experts and the same model with them dequantised to dense weights (both on the
    same backend) give the same logits and LoRA gradients (the weights dequantise exactly into the buffer the same
    GEMMs then read): bitwise on triton, whose tile loads take any strides; on grouped_mm to 1e-5 of each tensor's
    largest value (2e-7 seen), as torch's grouped GEMM sums the twin's transposed gpt-oss weight, stored [E, C, N],
    in another order than the buffer's [E, N, C]. The expert LoRA's B is made non-zero so that every factor gets a
    gradient."""
    twin = _build(backend=backend)
    assert dequantize_experts(twin) == EXPERT_WEIGHTS
    assert_same_step(lora_step(_build(backend=backend)), lora_step(twin), 2 * EXPERT_WEIGHTS,
                     rtol=1e-5 if backend == "grouped_mm" else 0.0)


def test_bad_mxfp4_settings_are_refused():
    with pytest.raises(ValueError, match=r"only moe.backend=triton or grouped_mm reads \(moe.backend=native_torch\): "
                                         r"set moe.backend=grouped_mm, or triton on a GPU"):
        check_quantized_training("mxfp4", lora=True, sharded=False, moe_backend="native_torch")
    check_quantized_training("mxfp4", lora=True, sharded=False, moe_backend="grouped_mm")
    with pytest.raises(ValueError, match="only moe.backend=triton or grouped_mm reads"):
        _build(backend="hf")
    with pytest.raises(ValueError, match="mxfp4 does not run under strategy=fsdp2"):
        check_quantized_training("mxfp4", lora=True, sharded=True)
    with pytest.raises(ValueError, match="mxfp4 freezes the base.*set lora.enabled=true"):
        check_quantized_training("mxfp4", lora=False, sharded=False)
    with pytest.raises(ValueError, match=r"already quantised \(bitsandbytes\)"):
        check_quantization("mxfp4", "bitsandbytes", True)
    check_quantization("mxfp4", "mxfp4", False)
    with pytest.raises(ValueError, match="is for gpt-oss's MoE experts \\(model_type gpt_oss\\), which Linear does not have"):
        quantize_experts(torch.nn.Linear(32, 32))


@pytest.mark.slow
def test_fit_on_mxfp4_experts_then_export_merge_writes_dequantised_experts(tmp_path):
    """The CLI: tiny gpt-oss, LoRA on attention and experts, experts in MXFP4 on the triton backend (Triton
    interpreted here): the loss falls, the adapter is plain PEFT (no MXFP4 tensors); ``export --merge`` writes the
    base's experts dequantised (values on the MXFP4 grid) and the merged model computes what the adapter over that
    base computes (fp32; the merge rounds, 1e-4)."""
    from cli_helpers import FAST, run_cli, summary
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lightning_ft.export import main as export_main
    from lightning_ft.kernels.mxfp4 import dequantize_mxfp4_reference, quantize_mxfp4

    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, *FAST, "trainer.max_steps=3", "scheduler.num_warmup_steps=0", "model=gpt_oss_tiny",
                   "lora=moe", "moe.backend=triton", "model.quantization=mxfp4",
                   "+callbacks.logits._target_=cli_helpers.DumpLogits", f"+callbacks.logits.path={run_dir / 'logits.pt'}")
    assert f"quantization: {EXPERT_WEIGHTS} expert weights quantised to MXFP4 after the random init" in proc.stdout + proc.stderr
    s = summary(run_dir)
    assert s["steps"] == 3 and s["final_loss"] < s["initial_loss"]
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert any("experts" in key for key in adapter) and not any(key.endswith(("_blocks", "_scales")) for key in adapter)
    assert export_main([str(run_dir), "--merge"]) == 0
    out = run_dir / "export"
    base, merged = (AutoModelForCausalLM.from_pretrained(str(out / name)) for name in ("base", "merged"))
    for model in (base, merged):
        assert not any(key.endswith(("_blocks", "_scales")) for key in model.state_dict())
    for name in ("gate_up_proj", "down_proj"):
        stored = base.state_dict()[f"model.layers.0.mlp.experts.{name}"].transpose(1, 2)  # [E, N, C]
        assert torch.equal(dequantize_mxfp4_reference(*quantize_mxfp4(stored), torch.float32), stored), name
        assert not torch.equal(merged.state_dict()[f"model.layers.0.mlp.experts.{name}"], stored.transpose(1, 2)), name
    reference = torch.load(run_dir / "logits.pt")  # the trained model's own logits (MXFP4 experts, our kernels)
    ids, trained = reference["input_ids"], reference["logits"]
    adapted = PeftModel.from_pretrained(base, str(out / "adapter"))
    with torch.no_grad():
        for model in (merged, adapted):
            torch.testing.assert_close(model.eval()(input_ids=ids).logits, trained, atol=1e-4, rtol=1e-4)
