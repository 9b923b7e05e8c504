"""Every MoE expert backend (`lightning_ft.kernels.moe.experts.moe_experts`) against the dense
float64 reference with materialised LoRA, forward and backward, and the backend selection."""

import pytest
import torch
import torch.nn.functional as F

import lightning_ft.kernels.moe.experts as experts
import moe_cases
from lightning_ft.kernels.moe import BACKENDS, ExpertLoRA, moe_experts, select_backend
from lightning_ft.kernels.mxfp4 import Mxfp4Weight, quantize_mxfp4
from lightning_ft.kernels.nf4 import Nf4ExpertWeight
from moe_cases import CASES, DEVICES, Case, _assert_close, _make, _reference_run, _run, _skip_unless_runnable

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_materialised_reference(backend, case_name, dtype, device):
    _skip_unless_runnable(backend, device)
    case = CASES[case_name]
    topk_idx, tensors = _make(case, device)
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1)).to(device)
    ref_out, ref_grads = _reference_run(case, topk_idx, tensors, grad_out, dtype)
    out, grads = _run(backend, case, topk_idx, tensors, dtype, grad_out)

    assert out.dtype == dtype and out.shape == (case.tokens, case.hidden)
    _assert_close(out, ref_out, dtype, "output")
    for name, ref_grad in ref_grads.items():
        assert grads[name] is not None, f"{name} got no gradient"
        assert grads[name].dtype == dtype
        _assert_close(grads[name], ref_grad, dtype, f"grad of {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["native_torch", "grouped_mm"])
def test_plain_activation_path_equals_the_fused_one(backend, device):
    """An act_fn that is not SiLU runs act(gate) * up * weight in plain torch: same output and grads."""
    case = CASES["base"]
    topk_idx, tensors = _make(case, device)
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1)).to(device)
    fused = _run(backend, case, topk_idx, tensors, torch.float32, grad_out)
    plain = _run(backend, case, topk_idx, tensors, torch.float32, grad_out, act_fn=lambda h: F.silu(h))
    torch.testing.assert_close(plain[0], fused[0], rtol=1e-5, atol=1e-5)
    for name, grad in fused[1].items():
        torch.testing.assert_close(plain[1][name], grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("trainable", [("x",), ("topk_weight", "gate_up_B"), ("gate_up_A", "down_B"), ("down_A",)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_only_what_requires_grad_gets_the_reference_gradient(backend, trainable, device):
    """Frozen inputs or LoRA factors: each backend's hand-written backward skips them, the rest is exact."""
    _skip_unless_runnable(backend, device)
    case = CASES["e6_top1_empty"]
    topk_idx, tensors = _make(case, device)
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1)).to(device)
    _, expected = _reference_run(case, topk_idx, tensors, grad_out)
    _, grads = _run(backend, case, topk_idx, tensors, torch.float32, grad_out, trainable=trainable)
    for name in trainable:
        _assert_close(grads[name], expected[name], torch.float32, f"{backend} {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_an_unneeded_output_is_zeros_with_the_same_gradients(backend, device, gpt_oss):
    """``output_needed=False`` (a recompute that only differentiates): grouped_mm and triton skip the
    down projection (and gpt-oss's routed down bias) and return zeros, native_torch computes it; every
    gradient (the biases' and the routing weights' included) is unchanged."""
    _skip_unless_runnable(backend, device)
    case = CASES["odd_sizes"] if backend != "grouped_mm" else CASES["base"]  # grouped_mm: aligned sizes
    case = CASES["gpt_oss"] if gpt_oss else case
    topk_idx, tensors = _make(case, device)
    grad_out = torch.randn(case.tokens, case.hidden).to(device)
    out, grads = _run(backend, case, topk_idx, tensors, torch.float32, grad_out)
    skipped, skipped_grads = _run(backend, case, topk_idx, tensors, torch.float32, grad_out, output_needed=False)
    if backend == "native_torch":
        torch.testing.assert_close(skipped, out, rtol=0, atol=0)
    else:
        assert skipped.shape == out.shape and not skipped.any()
    # the gate/up bias's gradient sums its rows with index_add_, whose atomics on CUDA add in a varying order
    order = dict(rtol=1e-5, atol=1e-6) if gpt_oss and device == "cuda" else dict(rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(skipped_grads[name], grad, **order, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_gives_an_empty_output_that_backpropagates(backend, device):
    _skip_unless_runnable(backend, device)
    case = Case(tokens=0, hidden=32, intermediate=16, experts=4, top_k=2, rank=4)
    topk_idx, tensors = _make(case, device)
    out, grads = _run(backend, case, topk_idx, tensors, torch.float32, torch.zeros(0, case.hidden, device=device))
    assert out.shape == (0, case.hidden) and out.requires_grad  # and its backward ran in _run
    for name, grad in grads.items():  # None where a backend never touched the tensor, else zero-sized or zeros
        assert grad is None or not grad.any(), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_expert_lora_tensor_gets_gradient(backend, device):
    _skip_unless_runnable(backend, device)
    case = Case(tokens=12, hidden=32, intermediate=16, experts=6, top_k=2, rank=4)
    _, tensors = _make(case, device)
    topk_idx = (torch.arange(case.tokens)[:, None] + torch.arange(case.top_k)) % case.experts  # every expert
    grad_out = torch.randn(case.tokens, case.hidden).to(device)
    _, grads = _run(backend, case, topk_idx.to(device), tensors, torch.float32, grad_out)
    for name in ("gate_up", "down"):
        lora_grad = ExpertLoRA(grads[f"{name}_A"], grads[f"{name}_B"], 1.0, case.experts)
        a_ERC, b_ENR, _ = lora_grad.factors(torch.float32)
        assert torch.all(a_ERC.abs().sum(dim=(1, 2)) > 0), f"{backend}: an expert's {name} lora_A got no gradient"
        assert torch.all(b_ENR.abs().sum(dim=(1, 2)) > 0), f"{backend}: an expert's {name} lora_B got no gradient"


def test_select_backend(monkeypatch):
    if not torch.cuda.is_available():
        assert select_backend("auto") == "native_torch"
    assert select_backend("native_torch") == "native_torch"
    with pytest.raises(ValueError, match="unknown MoE backend"):
        select_backend("megablocks")
    with pytest.raises(ValueError, match="unknown MoE backend"):
        moe_experts(None, None, None, None, None, None, backend="auto")
    monkeypatch.setattr(experts, "_INTERPRET", False)
    case = CASES["base"]
    topk_idx, tensors = _make(case, "cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _run("triton", case, topk_idx, tensors, torch.float32, torch.zeros(case.tokens, case.hidden))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        select_backend("triton")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
def test_backend_has_no_host_sync(backend):
    """The per-layer hot path (routing + experts, forward and backward) never waits for the GPU."""
    case = Case(tokens=2048, hidden=256, intermediate=128, experts=16, top_k=4, rank=16, empty=(3,))
    topk_idx, tensors = _make(case, "cuda")
    grad_out = torch.randn(case.tokens, case.hidden, device="cuda")
    _run(backend, case, topk_idx, tensors, torch.bfloat16, grad_out)  # probe, autotune, compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(backend, case, topk_idx, tensors, torch.bfloat16, grad_out)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _nf4_expert_weights(tensors: dict, dtype: torch.dtype) -> dict:
    """gpt-oss's stored [E, D, F] / [E, I, D] in NF4 (bitsandbytes' QLoRA quantisation), passed as transposed views
    as the model passes them (`lightning_ft.model.moe`); ``tensors`` get the dequantised stored weights."""
    bnb = pytest.importorskip("bitsandbytes.functional", reason='NF4 needs bitsandbytes: pip install -e ".[qlora]"')
    quantised = {}
    for name in ("w_gate_up", "w_down"):
        packed, state = bnb.quantize_4bit(tensors[name].to(dtype), blocksize=64, compress_statistics=True, quant_type="nf4")
        stored = Nf4ExpertWeight.from_quant_state(packed, state, dtype)
        quantised[name], tensors[name] = stored.transpose(1, 2), stored.dequantize().float()
    return quantised


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nf4"])
def test_4bit_experts_equal_their_dequantised_twin(fmt, dtype, device, monkeypatch):
    """gpt-oss experts held in MXFP4 (`Mxfp4Weight`) or NF4 (`Nf4ExpertWeight`), frozen, on the triton backend:
    output and every gradient (x, routing weights, LoRA, biases) those of the same backend on the dequantised dense
    weights; expert 1 gets no tokens. Bitwise under the interpreter; on CUDA NF4 bitwise too (dequantised into the
    reused buffer, then the dense twin's own launches), MXFP4 within the bf16/fp32 tolerances (its tile loads
    dequantise, so it is autotuned apart from the dense twin). Other backends refuse 4-bit weights."""
    _skip_unless_runnable("triton", device)
    case = Case(tokens=13, hidden=64, intermediate=32, experts=5, top_k=3, rank=4, empty=(1,), gpt_oss=True)
    topk_idx, tensors = _make(case, device)
    if fmt == "nf4":
        quantised = _nf4_expert_weights(tensors, dtype)
    else:
        quantised = {}
        for name in ("w_gate_up", "w_down"):  # stored [E, C, N]: MXFP4 keeps [E, N, C], quantised along C
            quantised[name] = Mxfp4Weight.from_checkpoint(*quantize_mxfp4(tensors[name].transpose(1, 2)), dtype)
            tensors[name] = quantised[name].dequantize().transpose(1, 2).float()
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1)).to(device)
    dense_out, dense_grads = _run("triton", case, topk_idx, tensors, dtype, grad_out)
    monkeypatch.setattr(moe_cases, "_weights", lambda case, t: (quantised["w_gate_up"], quantised["w_down"]))
    out, grads = _run("triton", case, topk_idx, tensors, dtype, grad_out)
    assert grads.keys() == dense_grads.keys()
    for name, value, twin in [("output", out, dense_out)] + [(n, grads[n], g) for n, g in dense_grads.items()]:
        if device == "cpu" or fmt == "nf4":
            assert torch.equal(value, twin), name
        else:
            _assert_close(value, twin.double(), dtype, name)
    with pytest.raises(ValueError, match="moe.backend=triton"):
        _run("native_torch", case, topk_idx, tensors, dtype, grad_out)


@pytest.mark.parametrize("c_dtype", [torch.float32, torch.bfloat16])
def test_an_unread_addmm_has_addmms_dtype_and_gradients(c_dtype):
    """`_UnreadAddmm`: ``c + a @ b``'s dtype (promoted, fp32 c with bf16 factors too) and its gradients, bit for bit."""
    from lightning_ft.kernels.moe._common import _UnreadAddmm

    torch.manual_seed(0)
    c = torch.randn(5, 3, dtype=c_dtype, requires_grad=True)
    a = torch.randn(5, 7, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(7, 3, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(5, 3, dtype=torch.promote_types(c_dtype, torch.bfloat16))
    expected = c + a @ b
    expected_grads = torch.autograd.grad(expected, (c, a, b), grad)
    unread = _UnreadAddmm.apply(c, a, b)
    assert unread.dtype == expected.dtype and unread.shape == expected.shape
    for got, want in zip(torch.autograd.grad(unread, (c, a, b), grad), expected_grads):
        assert got.dtype == want.dtype and torch.equal(got, want)
