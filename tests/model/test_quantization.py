"""model.quantization=nf4 (model/quantization.py): the base in bitsandbytes' NF4, the QLoRA step against PEFT + bitsandbytes."""

import sys

import pytest
import torch

from lightning_ft.model.build import ModelBuilder, load_causal_lm
from lightning_ft.model.patching import apply_kernels
from lightning_ft.model.quantization import check_quantization, check_quantized_training
from lightning_ft.strategies.strategy import Execution

bnb = pytest.importorskip("bitsandbytes", reason='model.quantization=nf4 needs bitsandbytes: pip install -e ".[qlora]"')

# row lengths that are multiples of 64: bitsandbytes 0.50.2's CPU kernel, the reference here, misplaces
# blocks for some others (tests/kernels/test_nf4.py)
CONFIG = dict(
    model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, vocab_size=64,
)  # fmt: skip
LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
LINEARS = 14  # 7 per layer


def _build(dtype="float32", quantization="nf4", kernels=False, lora=LORA, precision=None, device="cpu"):
    model = {"init": "random", "config": CONFIG, "dtype": dtype, "quantization": quantization, "attention": "sdpa"}
    with torch.device(device):
        return ModelBuilder(model, lora, kernels={"lora": kernels}, seed=0)(torch.device(device), precision=precision).model


def _base(quantization="nf4"):
    """The random base `_build` trains, without LoRA."""
    torch.manual_seed(0)
    return load_causal_lm(None, init="random", config=CONFIG, quantization=quantization)


def _linear4bit(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def test_random_init_quantises_each_linear_but_the_lm_head_as_bitsandbytes_does():
    dense, quantised = _base("none"), _base()
    layers = _linear4bit(quantised)
    assert len(layers) == LINEARS and type(quantised.lm_head) is torch.nn.Linear
    with pytest.raises(ValueError, match="cannot cast a bitsandbytes model"):  # as for a loaded one (uint8 bytes kept)
        quantised.to(torch.bfloat16)
    for name, layer in layers.items():
        state = layer.weight.quant_state
        assert (state.quant_type, state.nested, state.blocksize, state.state2.blocksize) == ("nf4", True, 64, 256)
        packed, expected = bnb.functional.quantize_4bit(
            dense.get_submodule(name).weight.detach(), blocksize=64, compress_statistics=True, quant_type="nf4"
        )
        assert torch.equal(layer.weight.data, packed) and torch.equal(state.absmax, expected.absmax), name
        assert torch.equal(state.state2.absmax, expected.state2.absmax) and torch.equal(state.offset, expected.offset)


def test_checkpoints_quantise_at_load_and_bitsandbytes_4bit_ones_load_as_they_are(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG), dtype=torch.bfloat16)
    dense.save_pretrained(tmp_path / "bf16")
    loaded = load_causal_lm(str(tmp_path / "bf16"), dtype="bfloat16", quantization="nf4")
    layers = _linear4bit(loaded)
    assert len(layers) == LINEARS
    q_proj = layers["model.layers.0.self_attn.q_proj"]
    packed, _ = bnb.functional.quantize_4bit(dense.model.layers[0].self_attn.q_proj.weight, compress_statistics=True, quant_type="nf4")
    assert torch.equal(q_proj.weight.data, packed) and q_proj.weight.quant_state.nested

    loaded.save_pretrained(tmp_path / "nf4")  # a checkpoint as bitsandbytes stores it
    again = _linear4bit(load_causal_lm(str(tmp_path / "nf4"), dtype="bfloat16", quantization="nf4"))
    assert torch.equal(again["model.layers.0.self_attn.q_proj"].weight.data, packed)
    with pytest.raises(ValueError, match="quantised in 4 bits by bitsandbytes: set model.quantization=nf4"):
        load_causal_lm(str(tmp_path / "nf4"), dtype="bfloat16")

    # transformers' default 4-bit config (FP4, no double quantisation) loads as it is too
    AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", quantization_config=BitsAndBytesConfig(load_in_4bit=True)
    ).save_pretrained(tmp_path / "fp4")
    fp4 = _linear4bit(load_causal_lm(str(tmp_path / "fp4"), dtype="bfloat16", quantization="nf4"))
    state = fp4["model.layers.0.self_attn.q_proj"].weight.quant_state
    assert len(fp4) == LINEARS and (state.quant_type, state.nested) == ("fp4", False)


def test_bad_quantization_settings_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"model.quantization=int4: expected one of none, nf4, mxfp4$"):
        check_quantization("int4", None, False)
    with pytest.raises(ValueError, match=r"already quantised \(mxfp4\).*set model.quantization=none"):
        check_quantization("nf4", "mxfp4", False)
    with pytest.raises(ValueError, match="only LoRA can train: set lora.enabled=true"):
        check_quantized_training("nf4", lora=False, sharded=False)
    with pytest.raises(ValueError, match="does not run under strategy=fsdp2"):
        check_quantized_training("nf4", lora=True, sharded=True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(ImportError, match=r'needs bitsandbytes: pip install -e "\.\[qlora\]"'):
        check_quantization("nf4", None, False)


@pytest.mark.parametrize(("precision", "device"), [
    ("fp32", "cpu"), ("bf16_autocast", "cpu"), pytest.param("bf16_autocast", "cuda", marks=pytest.mark.gpu),
])  # fmt: skip
def test_qlora_step_gives_peft_and_bitsandbytes_lora_gradients(precision, device):
    """Our dequantisation + GEMMs (kernels.lora) against PEFT's bnb layers over bitsandbytes' matmul_4bit: the
    same model, LoRA A and B drawn on the CPU (B non-zero), one loss and backward. fp32: equal to rounding. bf16: the two bf16 paths
    are 1e-2 to 2e-2 of a gradient's norm apart and each 3e-2 to 1e-1 from fp32 math (CPU), so each is measured
    against the fp32 step and ours may be no farther from it than PEFT + bitsandbytes (within 25%, or 1e-2)."""
    bf16 = precision != "fp32"

    def step(kernels, bf16):
        model = _build("bfloat16" if bf16 else "float32", kernels=kernels, precision="bf16-mixed" if bf16 else None, device=device)
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_" in name:  # drawn on the CPU: the same values on every device and dtype
                p.data.copy_(torch.empty(p.shape).normal_(0, 0.1, generator=gen))
        if kernels:  # every LoRA layer runs our fused forward
            assert apply_kernels(model, {"lora": True}) == [f"lora: {LINEARS} x peft lora.Linear"]
        ids = torch.randint(0, 64, (2, 16), generator=gen).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}

    exact_loss, exact = step(kernels=False, bf16=False)
    (peft_loss, peft), (ours_loss, ours) = step(kernels=False, bf16=bf16), step(kernels=True, bf16=bf16)
    assert exact.keys() == peft.keys() == ours.keys() and len(exact) == 2 * LINEARS
    if not bf16:
        assert ours_loss == pytest.approx(peft_loss, rel=1e-5)
        for name, expected in peft.items():
            assert expected.abs().max() > 0, name
            torch.testing.assert_close(ours[name], expected, rtol=0, atol=1e-5 * expected.abs().max().item())
        return
    assert abs(ours_loss - exact_loss) <= 1.25 * abs(peft_loss - exact_loss) + 1e-2 * exact_loss
    for name, expected in exact.items():
        norm = expected.norm()
        assert norm > 0, name
        ours_error, peft_error = (ours[name] - expected).norm() / norm, (peft[name] - expected).norm() / norm
        assert ours_error <= 1.25 * peft_error + 1e-2, f"{name}: ours {ours_error:.3g}, PEFT + bitsandbytes {peft_error:.3g} from fp32"


def test_adapter_saves_in_peft_format_and_loads_on_the_stock_bitsandbytes_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _base().save_pretrained(tmp_path / "base")  # the random base, in 4 bits
    ours = _build(kernels=True)
    for name, p in ours.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    ours.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    assert len(_linear4bit(stock)) == LINEARS
    stock.train()  # in eval mode bitsandbytes repacks the weights for its own CPU inference kernel (other roundings)
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, stock(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_fit_trains_the_default_model_on_an_nf4_base_through_the_cli(tmp_path):
    """The built-in default with model.quantization=nf4 and our fused QLoRA layers (Triton under the interpreter
    here): the base quantised after the random init, the loss falls, the adapter is PEFT's."""
    from cli_helpers import FAST, run_cli, summary

    proc = run_cli(tmp_path / "run", *FAST, "trainer.max_steps=3", "model.quantization=nf4", "kernels.lora=true")
    out = proc.stdout + proc.stderr
    assert "quantization: 16 linear layers quantised to NF4 after the random init" in out
    assert "qwen3_moe kernel lora: 16 x peft lora.Linear" in out
    s = summary(tmp_path / "run")
    assert s["steps"] == 3 and s["final_loss"] < s["initial_loss"]
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()


def test_qwen3_14b_qlora_experiment_has_the_published_shape_and_an_nf4_base(tmp_path):
    from hydra import compose, initialize_config_dir

    from lightning_ft.config import config_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir(), version_base="1.3"):
        cfg = compose("fit", overrides=["+experiment=qwen3_14b_qlora", f"run_dir={tmp_path}"])
    c = cfg.model.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size) == (40, 5120, 17408, 40, 8, 128, 151936)  # fmt: skip
    assert cfg.model.quantization == "nf4" and cfg.model.dtype == "bfloat16" and cfg.trainer.precision == "bf16-mixed"
    assert list(cfg.lora.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert cfg.kernels.lora


@pytest.mark.gpu
def test_a_bf16_checkpoint_is_quantised_weight_by_weight_on_the_gpu(tmp_path):
    """Loading with nf4 never holds the bf16 model on the GPU: the peak stays near the 4-bit size (~0.3 of bf16's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {**CONFIG, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 128}  # fmt: skip
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    bf16_bytes = sum(p.numel() * 2 for p in dense.parameters())
    dense.save_pretrained(tmp_path)
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        model = load_causal_lm(str(tmp_path), dtype="bfloat16", quantization="nf4")
    assert len(_linear4bit(model)) == 7 * 8
    assert torch.cuda.max_memory_allocated() - start < 0.5 * bf16_bytes


def _nf4_fp8(monkeypatch, lora=LORA, fp8=True, kernels=True, device="cpu"):
    """The bf16 nf4 model under bf16-mixed, with strategy.fp8 (on the CPU the builder's device check is passed by
    hand: the CPU has no fp8 GEMMs, the products run their reference math)."""
    import lightning_ft.model.build as build

    if device == "cpu":
        monkeypatch.setattr(build, "check_fp8_device", lambda device: None)
    model = {"init": "random", "config": CONFIG, "dtype": "bfloat16", "quantization": "nf4", "attention": "sdpa"}
    builder = ModelBuilder(model, lora, kernels={"lora": kernels}, seed=0, execution=Execution(fp8=fp8))
    with torch.device(device):
        return builder(torch.device(device), precision="bf16-mixed").model


def _nf4_step(model, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_" in name:  # B non-zero: every LoRA weight gets a gradient
            p.data.copy_(torch.empty(p.shape).normal_(0, 0.1, generator=gen))
    ids = torch.randint(0, 64, (2, 16), generator=gen).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_strategy_fp8_over_nf4_computes_the_4bit_bases_in_e4m3(monkeypatch, caplog, device):
    """strategy.fp8 with model.quantization=nf4: every 4-bit base under LoRA keeps its 4 bits and gets its e4m3 row
    scales (frozen int32 bits, not trained, not saved in the adapter), logged; the fused forward computes in fp8. One
    step against the nf4 model without fp8 (same weights, bf16-mixed): loss within 2% (measured 3e-5), each LoRA
    gradient within 25% relative (Frobenius) and their mean within 10% (measured: 18% at most, for layer 0's A, whose
    gradient passes through every layer's fp8 input gradient; 7% mean). On CUDA (sm90+) through torch._scaled_mm."""
    from lightning_ft.kernels.nf4 import e4m3_scales_4bit
    from lightning_ft.model.quantization import quant4bit_weight
    from lightning_ft.strategies.fp8 import fp8_scale_4bit

    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        model = _nf4_fp8(monkeypatch, device=device)
    assert f"fp8: {LINEARS} 4-bit base weights computed in e4m3 (NF4 storage, per-output-channel scales)" in caplog.messages
    assert not any("frozen LoRA base weights in e4m3" in m for m in caplog.messages)  # no nn.Linear under LoRA
    layers = _linear4bit(model)
    assert len(layers) == LINEARS
    for name, layer in layers.items():
        assert layer.fp8_scale_bits.dtype == torch.int32 and not layer.fp8_scale_bits.requires_grad, name
        assert torch.equal(fp8_scale_4bit(layer), e4m3_scales_4bit(quant4bit_weight(layer))), name
    fused = []
    import lightning_ft.model.lora as lora_module

    qlora = lora_module.qlora_linear
    monkeypatch.setattr(lora_module, "qlora_linear", lambda *a: fused.append(a[-1] is not None) or qlora(*a))
    loss, grads = _nf4_step(model, device)
    assert fused == [True] * LINEARS  # every layer through the fused forward, in fp8
    reference_loss, reference = _nf4_step(_nf4_fp8(monkeypatch, fp8=False, device=device), device)
    assert grads.keys() == reference.keys() and len(grads) == 2 * LINEARS
    assert abs(loss - reference_loss) / reference_loss < 0.02
    errors = {n: ((g - reference[n]).norm() / reference[n].norm()).item() for n, g in grads.items()}
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert max(errors.values()) < 0.25 and sum(errors.values()) / len(errors) < 0.10, errors


def test_an_adapter_trained_over_nf4_in_fp8_loads_on_the_nf4_model_without_fp8(monkeypatch, tmp_path):
    """The fp8 part is compute only: the adapter file holds the LoRA weights alone (no scales), and loads with PEFT on
    the nf4 model built without strategy.fp8 (as export builds it): the same LoRA weights, logits within fp8's
    error (5% relative, Frobenius)."""
    from peft import PeftModel

    model = _nf4_fp8(monkeypatch)
    _nf4_step(model)
    model.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    nf4 = {"init": "random", "config": CONFIG, "dtype": "bfloat16", "quantization": "nf4", "attention": "sdpa"}
    base = ModelBuilder(nf4, {**LORA, "enabled": False}, seed=0, dense_experts=True)(torch.device("cpu")).model  # export's
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    apply_kernels(loaded, {"lora": True})
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, trained = loaded.train()(input_ids=ids).logits.float(), model(input_ids=ids).logits.float()
    assert ((got - trained).norm() / trained.norm()).item() < 0.05


def test_strategy_fp8_over_nf4_refusals(monkeypatch):
    """Only the fused LoRA forward computes a 4-bit base in fp8: kernels.lora=false is refused with the pair (naming
    the setting); mxfp4 with fp8 stays refused; off Hopper the device check refuses as for any fp8 run."""
    import lightning_ft.model.build as build

    with pytest.raises(ValueError, match="in the fused LoRA forward only: set kernels.lora=true"):
        _nf4_fp8(monkeypatch, kernels=False)
    with pytest.raises(ValueError, match="strategy.fp8=true with model.quantization=mxfp4 is not supported"):
        build._check_fp8(torch.device("cpu"), False, LORA, "mxfp4", True)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="compute capability 9.0 or newer .*found cpu"):
        ModelBuilder({"init": "random", "config": CONFIG, "quantization": "nf4"}, LORA, kernels={"lora": True},
                     execution=Execution(fp8=True))(torch.device("cpu"))


def test_strategy_fp8_over_nf4_says_which_bases_keep_computing_in_model_dtype(monkeypatch, caplog):
    """LoRA dropout: PEFT's forward serves those layers (the fused one does not), so their 4-bit bases get no e4m3
    scales and compute in model.dtype, as logged."""
    from lightning_ft.strategies.fp8 import fp8_scale_4bit

    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        model = _nf4_fp8(monkeypatch, lora={**LORA, "dropout": 0.1})
    assert "fp8: 0 4-bit base weights computed in e4m3 (NF4 storage, per-output-channel scales)" in caplog.messages
    assert (f"fp8: {LINEARS} 4-bit base weights under LoRA compute in bfloat16: the fused LoRA forward does not serve "
            "their adapters (LoRA dropout, DoRA or a LoRA bias)") in caplog.messages
    assert not any(fp8_scale_4bit(layer) is not None for layer in _linear4bit(model).values())
