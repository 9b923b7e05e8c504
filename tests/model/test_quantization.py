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
        check_quantized_training("nf4", lora=False, sharded=False, cuda_graphs=False)
    with pytest.raises(ValueError, match="does not run under strategy=fsdp2"):
        check_quantized_training("nf4", lora=True, sharded=True, cuda_graphs=False)
    with pytest.raises(ValueError, match="set strategy.cuda_graphs=false"):
        builder = ModelBuilder({"init": "random", "config": CONFIG, "quantization": "nf4"}, LORA, execution=Execution(cuda_graphs=True))
        builder(torch.device("cpu"))
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
