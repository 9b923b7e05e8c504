"""fp8 MoE experts (strategy.fp8 on the triton and grouped_mm MoE backends): conversion, a training step against bf16, plain PEFT
adapters, where the experts stay in bf16 and why, `moe.backend=auto`.

    python -m pytest -q tests/strategies/test_fp8_experts.py            (CPU, Triton interpreted)
    python -m pytest -q -m gpu tests/strategies/test_fp8_experts.py     (GPU, sm90+)

On the CPU the builder refuses strategy.fp8 (no row-wise fp8 GEMMs), so the tests convert a built model's
experts as the builder does (`convert_experts_to_fp8`). Bounds, fp8 experts against bf16 experts from the same
weights, everything else equal (one step of the tiny Qwen3-MoE, bf16): logits within 3% relative (Frobenius; 0.8%
measured), the loss within 0.5%, each LoRA gradient within 8% (3.5% measured at most). The fp8 linear layers
(`convert_to_fp8`, tests/strategies/test_fp8_weights.py) move the experts' LoRA gradients of this model more, by
up to ~18%, so the GPU test, which builds with both, compares against a model whose linear layers are in fp8 too.
"""

import logging
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel
from tiny_model import LORA, TINY_MODEL

from lightning_ft.config import config_dir
from lightning_ft.kernels.fp8 import Fp8ExpertWeight
from lightning_ft.kernels.moe import moe_experts
from lightning_ft.model.build import ModelBuilder
from lightning_ft.model.moe import convert_experts_to_fp8
from lightning_ft.strategies.fp8 import convert_to_fp8, fp8_expert_weight
from lightning_ft.strategies.strategy import Execution

LORA_MOE = {**LORA, "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
EXPERT_WEIGHTS = 4  # gate_up and down in each of 2 layers


def _build(backend="triton", device="cpu", execution=None, model=TINY_MODEL):
    model = ModelBuilder(
        model={**model, "dtype": "bfloat16"}, lora=LORA_MOE, moe={"backend": backend}, seed=0, execution=execution
    )(torch.device(device)).model
    torch.manual_seed(1)
    for name, param in sorted(model.named_parameters()):
        # drawn here, not by PEFT's initialisation (it changed between releases, and in a whole model the routing of
        # the second layer's tokens, which fp8 may flip near a tie, follows it); B non-zero: every factor gets a gradient
        if "lora_A" in name or "lora_B" in name:
            param.data.normal_(0, 0.1)
    return model


def _experts(model, layer=0):
    return model.get_base_model().model.layers[layer].mlp.experts.base_layer.base_layer


def _step(model, device="cpu"):
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2)).to(device)
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), out.loss.item(), grads


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _assert_close_step(step, reference, grad_bound=0.08):
    """The bounds of the module docstring, and gradients for the same LoRA factors (A and B of the experts too)."""
    (logits, loss, grads), (logits_ref, loss_ref, grads_ref) = step, reference
    assert grads.keys() == grads_ref.keys() and sum("experts" in n for n in grads) == 2 * EXPERT_WEIGHTS
    assert _rel(logits, logits_ref) < 0.03 and abs(loss - loss_ref) / loss_ref < 0.005
    for name, grad in grads.items():
        assert torch.isfinite(grad).all() and _rel(grad, grads_ref[name]) < grad_bound, name


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_training_step_over_fp8_experts_matches_bf16_and_the_adapter_is_plain_peft(tmp_path, backend):
    model = _build(backend)
    logits_ref, loss_ref, grads_ref = _step(model)
    gate_up = _experts(model).gate_up_proj.detach().clone()
    assert convert_experts_to_fp8(model) == (EXPERT_WEIGHTS, None)
    assert convert_experts_to_fp8(model) == (0, None)  # nothing left
    experts = _experts(model)
    assert experts.gate_up_proj_fp8.dtype == torch.uint8 and experts.gate_up_proj_fp8.shape == (4, 48, 32)
    assert experts.gate_up_proj_fp8_scale.dtype == torch.int32 and experts.gate_up_proj_fp8_scale.shape == (4,)  # one per expert
    assert experts.gate_up_proj.shape == (4, 48, 32) and experts.gate_up_proj.untyped_storage().nbytes() == 2  # placeholder
    assert not any(p.requires_grad for n, p in experts.named_parameters())
    weight = fp8_expert_weight(experts, "gate_up_proj")
    assert isinstance(weight, Fp8ExpertWeight) and _rel(weight.dequantize().float(), gate_up.float()) < 0.05

    _assert_close_step(_step(model), (logits_ref, loss_ref, grads_ref))

    # what export --merge and PEFT load: the adapter holds LoRA only and loads on the bf16 base
    model.save_pretrained(tmp_path / "adapter")
    base = ModelBuilder(model={**TINY_MODEL, "dtype": "bfloat16"}, lora={**LORA, "enabled": False}, seed=0)(torch.device("cpu")).model
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    trained = {n: p for n, p in model.named_parameters() if "lora_" in n}
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert got.keys() == trained.keys() and all(torch.equal(got[n], trained[n]) for n in got)
    assert not any("_fp8" in n for n in loaded.state_dict())


def _block_step(block):
    """Output, input gradient and LoRA gradients of one MoE block on fixed bf16 inputs."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 12, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    out = block(x)[0]
    block.zero_grad()
    (out.float() * torch.randn(out.shape, generator=gen)).sum().backward()
    lora = {n: p.grad.float().clone() for n, p in block.named_parameters() if p.grad is not None}
    return [out.detach().float(), x.grad.float()], lora


def test_gpt_oss_experts_transposed_with_biases_in_fp8():
    """gpt-oss's layout (weights stored [E, C, N], interleaved gate/up, biases): quantised as the [E, N, C] the
    backends read. One MoE block on the same input (in a whole model a small change reroutes tokens in the next
    layer, which no bound covers): output and input gradient within 8% of bf16 (5% measured: two fp8 GEMMs in a
    row), each LoRA gradient within 10% (5% measured)."""
    gpt_oss = {"init": "random", "attention": "sdpa",
               "config": {**yaml.safe_load((Path(config_dir()) / "model" / "gpt_oss_tiny.yaml").read_text())["config"], "vocab_size": 64}}
    model = _build(model=gpt_oss)
    block = model.get_base_model().model.layers[0].mlp
    reference, reference_lora = _block_step(block)
    stored = _experts(model).gate_up_proj.detach().clone()  # [E, C, N]
    assert convert_experts_to_fp8(model) == (EXPERT_WEIGHTS, None)
    weight = fp8_expert_weight(_experts(model), "gate_up_proj")
    assert weight.shape == (4, 64, 64) and _rel(weight.dequantize().float(), stored.transpose(1, 2).float()) < 0.05
    tensors, lora = _block_step(block)
    assert all(_rel(t, r) < 0.08 for t, r in zip(tensors, reference))
    assert lora.keys() == reference_lora.keys() and len(lora) == 4  # A and B of gate_up and down
    for name, grad in lora.items():
        assert _rel(grad, reference_lora[name]) < 0.10, name


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_the_builder_converts_the_experts_under_strategy_fp8_and_logs_it(monkeypatch, caplog, backend):
    """ModelBuilder with strategy.fp8 (its device check passed by hand: the CPU has no fp8 GEMMs): the linear
    layers under LoRA and the experts under LoRA in fp8, each count logged; grouped_mm lays out no LoRA slots for them."""
    import lightning_ft.model.build as build

    monkeypatch.setattr(build, "check_fp8_device", lambda device: None)
    caplog.set_level(logging.INFO)
    model = _build(backend, execution=Execution(fp8=True))
    assert "fp8: 6 frozen LoRA base weights in e4m3" in caplog.text  # q/v/o of 2 layers
    assert f"fp8: {EXPERT_WEIGHTS} frozen expert weights under LoRA in e4m3" in caplog.text
    assert f"moe: {backend} experts backend" in caplog.text and "spare rows and columns" not in caplog.text
    assert all(fp8_expert_weight(_experts(model, i), n) is not None for i in (0, 1) for n in ("gate_up_proj", "down_proj"))


def test_fp8_experts_stay_in_bf16_off_the_triton_and_grouped_mm_backends_saying_why(monkeypatch, caplog):
    for backend in ("hf", "native_torch"):
        model = _build(backend=backend)
        assert convert_experts_to_fp8(model) == (0, f"only moe.backend=triton or grouped_mm reads fp8 experts "
                                                    f"(moe.backend={backend}): set moe.backend=triton")
        assert fp8_expert_weight(_experts(model), "gate_up_proj") is None
    import lightning_ft.model.build as build

    monkeypatch.setattr(build, "check_fp8_device", lambda device: None)
    caplog.set_level(logging.INFO)
    model = _build(backend="native_torch", execution=Execution(fp8=True))  # the builder logs it and goes on
    assert "fp8: 6 frozen LoRA base weights in e4m3" in caplog.text
    assert "fp8: the MoE experts stay in bfloat16: only moe.backend=triton or grouped_mm reads fp8 experts" in caplog.text
    assert fp8_expert_weight(_experts(model), "down_proj") is None


def test_moe_backend_auto_is_triton_where_the_experts_are_held_in_fp8(monkeypatch, caplog):
    """``moe.backend=auto`` (the MoE experiments') takes the triton backend for fp8 experts, logged; without LoRA on
    the experts, auto resolves by the hardware as before; CUDA graphs replay the fp8 experts too."""
    import lightning_ft.model.build as build

    monkeypatch.setattr(build, "check_fp8_device", lambda device: None)
    caplog.set_level(logging.INFO)
    model = _build(backend="auto", execution=Execution(fp8=True))
    assert "moe: backend auto -> triton, which reads fp8 experts" in caplog.text
    assert f"fp8: {EXPERT_WEIGHTS} frozen expert weights under LoRA in e4m3" in caplog.text
    assert fp8_expert_weight(_experts(model, 1), "gate_up_proj") is not None
    cpu = torch.device("cpu")
    assert build._moe_backend("auto", cpu, "none", Execution(fp8=True, cuda_graphs=True), LORA_MOE) == "triton"
    assert build._moe_backend("auto", cpu, "none", Execution(fp8=True), LORA) == "auto"  # no LoRA on the experts
    assert build._moe_backend("auto", cpu, "mxfp4", Execution(), LORA_MOE) == "triton"
    assert build._moe_backend("grouped_mm", cpu, "none", Execution(fp8=True), LORA_MOE) == "grouped_mm"  # as asked


def test_fp8_expert_weights_are_refused_by_native_torch():
    model = _build()
    convert_experts_to_fp8(model)
    experts = _experts(model)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp8 expert weights run on the triton and grouped_mm MoE backends, not native_torch: "
                                         "set moe.backend=triton"):
        moe_experts(x, torch.ones(4, 1), None, fp8_expert_weight(experts, "gate_up_proj"), experts.down_proj, torch.nn.SiLU(),
                    backend="native_torch")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
def test_fp8_experts_training_step_on_hopper(backend):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs sm90+ (row-wise torch._scaled_mm)")
    with torch.device("cuda"):  # built where it runs, as Lightning's configure_model does
        model = _build(backend, device="cuda", execution=Execution(fp8=True))
        reference = _build(backend, device="cuda")
    assert convert_to_fp8(reference) == 6  # q/v/o of 2 layers, as in the fp8 build: only the experts differ
    assert sum(fp8_expert_weight(_experts(model, i), n) is not None for i in (0, 1) for n in ("gate_up_proj", "down_proj")) == 4
    # on an H100 the largest LoRA gradient difference was 9.0% (layer 1's experts' B): the fp8 linear layers and
    # experts round through two layers' backward, torch._scaled_mm's accumulation is not the CPU reference's
    _assert_close_step(_step(model, "cuda"), _step(reference, "cuda"), grad_bound=0.12)
