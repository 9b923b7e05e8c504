"""fp8 frozen base weights (strategy.fp8): conversion, a training step against bf16, plain PEFT adapters, errors.

On the CPU the products run through `fp8_linear`'s reference (the same quantised operands in fp32);
the GPU test runs them through torch._scaled_mm:
    python -m pytest -q tests/strategies/test_fp8_weights.py            (CPU)
    python -m pytest -q -m gpu tests/strategies/test_fp8_weights.py     (GPU, sm90+)

Bounds, fp8 base against the bf16 base from the same weights (one step of the tiny model): loss within
2% relative, each LoRA gradient within 15% relative (Frobenius; each GEMM is ~4% off, and LoRA
gradients pass through several).
"""

import pytest
import torch
from cli_helpers import FAST, run_cli
from peft import PeftModel
from tiny_model import LORA, TINY_MODEL

from lightning_ft.model.build import ModelBuilder
from lightning_ft.model.patching import apply_kernels
from lightning_ft.strategies.fp8 import Fp8Linear, check_fp8_device, convert_to_fp8
from lightning_ft.strategies.strategy import Execution

LORA_ALL = {**LORA, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def _build(device="cpu", dtype="bfloat16"):
    model = ModelBuilder(model={**TINY_MODEL, "dtype": dtype}, lora=LORA_ALL, seed=0)(torch.device(device)).model
    for name, p in model.named_parameters():  # non-zero lora_B: every LoRA weight gets gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model.to(device)


def _step(model, kernels, device="cpu", autocast=True):
    apply_kernels(model, kernels if isinstance(kernels, dict) else {"lora": kernels})
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 24), device=device)
    model.zero_grad()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):  # as under precision=bf16-mixed
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_converts_the_frozen_lora_base_weights_only_and_halves_their_memory():
    model = _build()
    before = {n: (p.dtype, p.requires_grad) for n, p in model.named_parameters() if "base_layer" not in n}
    linears = [m.base_layer for m in model.modules() if hasattr(m, "base_layer") and isinstance(m.base_layer, torch.nn.Linear)]
    bf16_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    assert convert_to_fp8(model) == len(linears) == 8  # q/k/v/o of 2 layers
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert sum(m.weight_bytes.numel() * m.weight_bytes.element_size() for m in fp8) == bf16_bytes // 2
    # LoRA A/B, norms, router, embeddings, lm_head: unchanged
    assert {n: (p.dtype, p.requires_grad) for n, p in model.named_parameters() if "base_layer" not in n} == before
    assert not any(p.requires_grad for m in fp8 for p in m.parameters())  # no gradient, no optimizer state
    assert convert_to_fp8(model) == 0  # nothing left to convert
    # a model.to(dtype) (a precision plugin's) leaves the e4m3 bytes and the fp32 scales alone
    saved = fp8[0].weight_fp8.float(), fp8[0].weight_scale.clone()
    model.to(torch.bfloat16)
    assert torch.equal(fp8[0].weight_fp8.float(), saved[0]) and fp8[0].weight_scale.dtype == torch.float32
    assert torch.equal(fp8[0].weight_scale, saved[1])


@pytest.mark.parametrize("kernels", [False, True])  # PEFT's forward over Fp8Linear; the fused LoRA forward
def test_training_step_matches_the_bf16_base(kernels):
    model = _build()
    loss_ref, grads_ref = _step(model, kernels)
    convert_to_fp8(model)
    loss, grads = _step(model, kernels)
    assert grads.keys() == grads_ref.keys() and len(grads) == 16  # A and B of every LoRA layer, no base weight
    assert abs(loss - loss_ref) / loss_ref < 0.02
    for name, g in grads.items():
        assert torch.isfinite(g).all() and _rel(g, grads_ref[name]) < 0.15, name


def test_fused_and_peft_forward_agree_over_the_fp8_base(monkeypatch):
    import lightning_ft.model.lora as lora_module

    model = _build(dtype="float32")  # fp32: the same fp8 base product, LoRA summed in another order
    convert_to_fp8(model)
    loss_peft, grads_peft = _step(model, kernels=False, autocast=False)
    fused, fused_op = [], lora_module.lora_linear
    monkeypatch.setattr(lora_module, "lora_linear", lambda *a, **k: fused.append(k["weight_scale"] is not None) or fused_op(*a, **k))
    loss_fused, grads_fused = _step(model, kernels=True, autocast=False)
    assert fused == [True] * 8  # the fused forward over the e4m3 weight (q/k/v/o of 2 layers), not PEFT's
    assert abs(loss_fused - loss_peft) / loss_peft < 1e-5
    for name, g in grads_fused.items():
        assert _rel(g, grads_peft[name]) < 1e-4, name


def test_adapter_saved_from_the_fp8_model_loads_in_plain_peft_on_the_bf16_base(tmp_path):
    model = _build()
    convert_to_fp8(model)
    model.save_pretrained(tmp_path / "adapter")
    bf16 = {**TINY_MODEL, "dtype": "bfloat16"}
    base = ModelBuilder(model=bf16, lora={**LORA, "enabled": False}, seed=0)(torch.device("cpu")).model
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    trained = {n: p for n, p in model.named_parameters() if "lora_" in n}
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert got.keys() == trained.keys() and all(torch.equal(got[n], trained[n]) for n in got)
    ids = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        rel = _rel(loaded(input_ids=ids).logits.float(), model(input_ids=ids).logits.float())
    assert rel < 0.1  # the same adapter over the bf16 weights the fp8 ones were quantised from


def _module(fused_ce, dtype="float32"):
    from lightning_ft.module import FinetuneModule

    module = FinetuneModule(ModelBuilder(model={**TINY_MODEL, "dtype": dtype}, lora=LORA_ALL, seed=0,
                                         kernels={"fused_linear_cross_entropy": fused_ce}))  # fmt: skip
    module.configure_model()
    for i, (name, p) in enumerate(module.model.named_parameters()):  # non-zero lora_B: every LoRA weight gets gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(i))
    return module


def _head_loss(module, batch):
    module.model.zero_grad(set_to_none=True)
    loss = module.loss_sum(batch)
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in module.model.named_parameters() if p.grad is not None}


def test_lm_head_in_e4m3_halves_its_memory_and_both_loss_paths_compute_its_fp8_math(monkeypatch):
    """strategy.fp8_lm_head: the bf16 head becomes an Fp8Linear; the chunked linear-CE (kernels.fused_linear_cross_entropy)
    runs its fp8 products (weight_scale passed) and agrees with the stock loss over Fp8Linear's forward (the same
    quantised operands, bf16 logits; loss 1e-3, LoRA gradients 2e-2 relative: the two losses' softmax sums differ in
    order, and a gradient a rounding apart can land an e4m3 step apart); against the bf16 head the loss stays within 1%
    and the LoRA gradients within 15%."""
    import lightning_ft.module as module_file
    from lightning_ft.data.packing import collate_packed
    from lightning_ft.strategies.fp8 import convert_lm_head_to_fp8

    torch.manual_seed(3)
    batch = collate_packed([(ids, ids) for ids in (torch.randint(0, 64, (n,)).tolist() for n in (11, 7, 19))])
    results = {}
    for fused_ce in (True, False):
        module = _module(fused_ce, dtype="bfloat16")
        results["bf16", fused_ce] = _head_loss(module, batch)
        head = module.hf_model.get_output_embeddings()
        line = convert_lm_head_to_fp8(module.model)
        assert line == "fp8: the lm_head (64 × 32) in e4m3, per-output-channel scales"
        fp8_head = module.hf_model.get_output_embeddings()
        assert isinstance(fp8_head, Fp8Linear) and fp8_head.weight_bytes.numel() == head.weight.numel()
        assert fp8_head.weight_bytes.element_size() * 2 == head.weight.element_size()  # half the bf16 head's bytes
        calls, fused_op = [], module_file.fused_linear_cross_entropy
        monkeypatch.setattr(module_file, "fused_linear_cross_entropy",
                            lambda *a, **k: calls.append(k.get("weight_scale") is not None) or fused_op(*a, **k))  # fmt: skip
        results["fp8", fused_ce] = _head_loss(module, batch)
        assert calls == ([True] if fused_ce else [])
        assert convert_lm_head_to_fp8(module.model).startswith("fp8: the lm_head stays")  # converted once
    (loss_fused, grads_fused), (loss_stock, grads_stock) = results["fp8", True], results["fp8", False]
    assert abs(loss_fused - loss_stock) <= 1e-3 * abs(loss_stock)
    for name, g in grads_fused.items():
        assert _rel(g, grads_stock[name]) < 2e-2, name
    loss_bf16, grads_bf16 = results["bf16", True]
    assert abs(loss_fused - loss_bf16) <= 0.01 * abs(loss_bf16)
    for name, g in grads_fused.items():
        assert _rel(g, grads_bf16[name]) < 0.15, name


def test_the_memory_plan_counts_the_loss_gradient_of_either_head():
    """`FinetuneModule.loss_gradient_bytes` (added to the plan's base: its measuring pass runs the loss without
    gradients): d hidden [T, H] with the chunked linear-CE; over the e4m3 head also its transposed copy [H, V] and a
    chunk's e4m3 dz rows with their scales; nothing without the chunked loss."""
    from lightning_ft.data.packing import collate_packed
    from lightning_ft.strategies.fp8 import convert_lm_head_to_fp8

    batch = collate_packed([(list(range(1, 30)), list(range(1, 30)))])
    tokens, hidden, vocab = 29, TINY_MODEL["config"]["hidden_size"], TINY_MODEL["config"]["vocab_size"]
    assert _module(fused_ce=False).loss_gradient_bytes(batch) == 0
    assert _module(fused_ce=True).loss_gradient_bytes(batch) == tokens * hidden * 4  # fp32: d hidden alone
    module = _module(fused_ce=True, dtype="bfloat16")
    assert module.loss_gradient_bytes(batch) == tokens * hidden * 2
    convert_lm_head_to_fp8(module.model)
    assert module.loss_gradient_bytes(batch) == tokens * hidden * 2 + vocab * hidden + tokens * (vocab + 4)


def test_lm_head_tied_or_trained_stays_as_it_is():
    from lightning_ft.strategies.fp8 import convert_lm_head_to_fp8

    tied = {**TINY_MODEL, "config": {**TINY_MODEL["config"], "tie_word_embeddings": True}}
    model = ModelBuilder(model=tied, lora=LORA_ALL, seed=0)(torch.device("cpu")).model
    assert convert_lm_head_to_fp8(model) == (
        "fp8: the lm_head stays as it is (tied to the input embeddings, which the lookup reads in full precision)"
    )
    trained = ModelBuilder(model=TINY_MODEL, lora={**LORA_ALL, "modules_to_save": ["lm_head"]}, seed=0)(torch.device("cpu")).model
    assert "lora.modules_to_save trains it" in convert_lm_head_to_fp8(trained)
    fp32 = ModelBuilder(model=TINY_MODEL, lora=LORA_ALL, seed=0)(torch.device("cpu")).model  # _scaled_mm takes bf16 only
    assert convert_lm_head_to_fp8(fp32) == ("fp8: the lm_head stays as it is (its fp8 GEMMs need a bf16 head of dims that "
                                            "are multiples of 16; it is float32 64 × 32)")
    assert not any(isinstance(m, Fp8Linear) for m in [*model.modules(), *trained.modules(), *fp32.modules()])


def test_fp8_lm_head_needs_fp8():
    with pytest.raises(ValueError, match="strategy.fp8_lm_head=true .* set strategy.fp8=true too, or strategy.fp8_lm_head=false"):
        Execution(fp8_lm_head=True).check()
    Execution(fp8=True, fp8_lm_head=True).check()  # allowed together (the device is checked when the model is built)


def test_refused_off_hopper_with_the_device_found():
    with pytest.raises(ValueError, match=r"compute capability 9\.0 or newer .*found cpu: set strategy.fp8=false"):
        check_fp8_device(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"strategy.fp8=true needs .*found none \(trainer.accelerator=cpu\)"):
        Execution(fp8=True).check(no_cuda="trainer.accelerator=cpu")
    with pytest.raises(ValueError, match="found cpu"):  # the builder refuses before any weight loads
        ModelBuilder(model=TINY_MODEL, lora=LORA, execution=Execution(fp8=True))(torch.device("cpu"))
    with pytest.raises(ValueError, match="not available with strategy=fsdp2"):
        ModelBuilder(model=TINY_MODEL, lora=LORA, execution=Execution(fp8=True))(torch.device("cpu"), sharded=True)


def test_fit_refuses_fp8_off_hopper_before_training(tmp_path):
    proc = run_cli(tmp_path, *FAST, "trainer.max_steps=1", "strategy.fp8=true", ok=False)
    assert "strategy.fp8=true needs an NVIDIA GPU of compute capability 9.0 or newer (Hopper, sm90+); found none" in proc.stderr
    assert "set strategy.fp8=false" in proc.stderr


@pytest.mark.gpu
def test_fp8_training_step_on_hopper_without_host_sync():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs sm90+ (row-wise torch._scaled_mm)")
    kernels = {"lora": True, "rms_norm": True}  # input_layernorm hands q/k/v its fp8 rows
    with torch.device("cuda"):  # built where it runs, as Lightning's configure_model does
        model = ModelBuilder(
            model={**TINY_MODEL, "dtype": "bfloat16"}, lora=LORA_ALL, seed=0, execution=Execution(fp8=True), kernels=kernels
        )(torch.device("cuda")).model
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 8
    loss_fp8, _ = _step(model, kernels, device="cuda")  # also the warm-up (lazy inits may sync)
    layer = model.get_base_model().model.layers[0]
    x = torch.randn(2, 32, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # the norm (writing fp8 rows) and the fused LoRA layers over the fp8 base, forward and backward: no sync
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = layer.input_layernorm(x)
            y = sum(layer.self_attn.get_submodule(p)(h).float().sum() for p in ("q_proj", "k_proj", "v_proj"))
        y.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    loss_bf16, _ = _step(_build("cuda"), kernels, device="cuda")
    assert abs(loss_fp8 - loss_bf16) / loss_bf16 < 0.02


TINY_LLAMA = {"init": "random", "config": dict(
    model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, vocab_size=64,
)}  # fmt: skip


def test_norms_and_swiglu_hand_their_fp8_rows_to_the_next_gemm(monkeypatch):
    import lightning_ft.kernels.fp8 as fp8
    import lightning_ft.model.patching as patching

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = ModelBuilder(model=TINY_LLAMA, lora={**LORA, "target_modules": targets}, seed=0)(torch.device("cpu")).model
    assert convert_to_fp8(model) == 14
    kernels = {"lora": True, "rms_norm": True, "swiglu": True}
    # per layer: input_layernorm (q/k/v), post_attention_layernorm (gate/up), the MLP's swiglu (down)
    assert apply_kernels(model, kernels)[-1] == "fp8: 6 x rms_norm / swiglu also write their output's fp8 rows for the next GEMM"
    given, run = [], fp8._Fp8Linear.forward
    monkeypatch.setattr(fp8._Fp8Linear, "forward", staticmethod(lambda ctx, *a: given.append(a[-1] is not None) or run(ctx, *a)))
    loss, grads = _step(model, kernels, autocast=False)
    layer = [True] * 3 + [False] + [True] * 3  # q/k/v; o_proj quantises its input; gate/up, down
    assert given == layer * 2
    # the rows are quantize_rows' of the same outputs (bit for bit on the CPU): the same step as without them
    monkeypatch.setattr(patching, "_mark_fp8_row_producers", lambda *a: 0)
    given.clear()
    loss_plain, grads_plain = _step(model, kernels, autocast=False)
    assert not any(given) and loss == loss_plain and all(torch.equal(g, grads_plain[n]) for n, g in grads.items())
