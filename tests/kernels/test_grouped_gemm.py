"""Expert backends against a dense reference with materialised LoRA (W + s·B·A), forward and backward.

The reference is the stock PEFT math (delta weight per expert, then one linear per routed pair) in
float64; each backend runs at fp32 (tight) and bf16 (against the same float64 reference).
"""

import contextlib
import itertools
import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import lightning_ft.kernels.moe.grouped_gemm as gg
from lightning_ft.kernels.moe import (
    BACKENDS,
    ExpertLoRA,
    grouped_mm_mode,
    moe_experts,
    select_backend,
    sort_by_expert,
)
from lightning_ft.kernels.moe.grouped_gemm import grouped_gemm, grouped_wgrad
from lightning_ft.strategies import kept

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2}}


@dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    rank: int | None  # None: no LoRA, the expert weights are trained instead (full fine-tuning)
    empty: tuple[int, ...] = ()  # experts that receive no tokens


CASES = {
    "base": Case(tokens=16, hidden=32, intermediate=16, experts=4, top_k=2, rank=4),
    "e6_top1_empty": Case(tokens=11, hidden=40, intermediate=24, experts=6, top_k=1, rank=8, empty=(2, 5)),
    "odd_sizes": Case(tokens=9, hidden=33, intermediate=10, experts=6, top_k=3, rank=3, empty=(0,)),
    "full_finetune": Case(tokens=12, hidden=32, intermediate=16, experts=5, top_k=2, rank=None, empty=(4,)),
}


def _skip_unless_runnable(backend: str, device: str) -> None:
    if backend == "triton" and device == "cpu" and not TRITON_ON_CPU:
        pytest.skip("the triton backend runs on the CPU only under TRITON_INTERPRET=1")


def _make(case: Case, device: str, seed: int = 0):
    """Random inputs (fp32, on device) and distinct top-k expert ids avoiding ``case.empty``."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    scores = torch.rand(case.tokens, case.experts, generator=gen)
    scores[:, list(case.empty)] = -1.0
    topk_idx = scores.argsort(dim=-1, descending=True)[:, : case.top_k].to(device)
    tensors = {
        "x": rand(case.tokens, case.hidden),
        "topk_weight": torch.rand(case.tokens, case.top_k, generator=gen).to(device),
        "w_gate_up": rand(case.experts, 2 * case.intermediate, case.hidden, scale=case.hidden**-0.5),
        "w_down": rand(case.experts, case.hidden, case.intermediate, scale=case.intermediate**-0.5),
    }
    if case.rank is not None:
        r, e = case.rank, case.experts
        tensors |= {
            "gate_up_A": rand(e * r, case.hidden, scale=case.hidden**-0.5),
            "gate_up_B": rand(2 * case.intermediate, r * e, scale=0.3),  # non-zero B: LoRA A gets gradients
            "down_A": rand(e * r, case.intermediate, scale=case.intermediate**-0.5),
            "down_B": rand(case.hidden, r * e, scale=0.3),
        }
    return topk_idx, tensors


def _trainable(case: Case) -> list[str]:
    if case.rank is None:
        return ["x", "topk_weight", "w_gate_up", "w_down"]
    return ["x", "topk_weight", "gate_up_A", "gate_up_B", "down_A", "down_B"]


def _loras(case: Case, t: dict) -> tuple[ExpertLoRA | None, ExpertLoRA | None]:
    if case.rank is None:
        return None, None
    scaling = 2.0
    return (
        ExpertLoRA(t["gate_up_A"], t["gate_up_B"], scaling, case.experts),
        ExpertLoRA(t["down_A"], t["down_B"], scaling, case.experts),
    )


def _reference(case: Case, topk_idx: torch.Tensor, t: dict) -> torch.Tensor:
    """Stock math: per-expert W + s·B_e·A_e (PEFT's delta, PEFT's layout), one linear per pair."""
    w_gate_up, w_down = t["w_gate_up"], t["w_down"]
    if case.rank is not None:
        e, r = case.experts, case.rank
        for name, base in (("gate_up", "w_gate_up"), ("down", "w_down")):
            a_ERC = t[f"{name}_A"].view(e, r, -1)
            b_NRE = t[f"{name}_B"].view(-1, r, e)
            delta = torch.einsum("nre,erc->enc", b_NRE, a_ERC) * 2.0
            if base == "w_gate_up":
                w_gate_up = w_gate_up + delta
            else:
                w_down = w_down + delta
    h = torch.einsum("td,tkfd->tkf", t["x"], w_gate_up[topk_idx])
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("tki,tkdi->tkd", F.silu(gate) * up, w_down[topk_idx])
    return (y * t["topk_weight"][..., None]).sum(dim=1)


def _run(
    backend, case, topk_idx, tensors, dtype, grad_out, act_fn=torch.nn.SiLU(), trainable=None, output_needed=True, keep=None
):  # fmt: skip
    """Forward + backward of one backend; returns the output and the grads of the trainable tensors.

    ``nn.SiLU`` (what transformers' experts hold) takes the fused SwiGLU kernel with the routing
    weight folded in; any other callable takes the plain-torch activation path. ``trainable``: the
    tensors that require grad (default: `_trainable`). ``keep``: kept activations inside
    `kept.keeping` (a recompute when ``grad_out`` is given, else a forward only, without grad).
    """
    trainable = _trainable(case) if trainable is None else trainable
    t = {name: v.detach().to(dtype).requires_grad_(name in trainable) for name, v in tensors.items()}
    gate_up_lora, down_lora = _loras(case, t)
    routing = sort_by_expert(topk_idx, case.experts)
    keeping = kept.keeping(keep, recompute=grad_out is not None) if keep is not None else contextlib.nullcontext()
    with keeping, torch.set_grad_enabled(grad_out is not None):
        out = moe_experts(
            t["x"], t["topk_weight"], routing, t["w_gate_up"], t["w_down"], act_fn,
            gate_up_lora=gate_up_lora, down_lora=down_lora, backend=backend, output_needed=output_needed, keep=keep,
        )
    if grad_out is None:
        return out, {}
    out.backward(grad_out.to(dtype))
    return out, {name: t[name].grad for name in trainable}


def _reference_run(case, topk_idx, tensors, grad_out):
    t = {name: v.detach().double().requires_grad_(name in _trainable(case)) for name, v in tensors.items()}
    out = _reference(case, topk_idx, t)
    out.backward(grad_out.double())
    return out, {name: t[name].grad for name in _trainable(case)}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    scale = expected.abs().max().clamp_min(1e-6)  # bf16 tolerances relative to the tensor's range
    tol = TOL[dtype]
    torch.testing.assert_close(
        actual.double() / scale, expected / scale, rtol=tol["rtol"], atol=tol["atol"], msg=lambda m: f"{what}: {m}"
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_materialised_reference(backend, case_name, dtype, device):
    _skip_unless_runnable(backend, device)
    case = CASES[case_name]
    topk_idx, tensors = _make(case, device)
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1)).to(device)
    ref_out, ref_grads = _reference_run(case, topk_idx, tensors, grad_out)
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
def test_an_unneeded_output_is_zeros_with_the_same_gradients(backend, device):
    """``output_needed=False`` (a recompute that only differentiates): grouped_mm and triton skip the
    down projection and return zeros, native_torch computes it; every gradient is unchanged."""
    _skip_unless_runnable(backend, device)
    case = CASES["odd_sizes"] if backend != "grouped_mm" else CASES["base"]  # grouped_mm: aligned sizes
    topk_idx, tensors = _make(case, device)
    grad_out = torch.randn(case.tokens, case.hidden).to(device)
    out, grads = _run(backend, case, topk_idx, tensors, torch.float32, grad_out)
    skipped, skipped_grads = _run(backend, case, topk_idx, tensors, torch.float32, grad_out, output_needed=False)
    if backend == "native_torch":
        torch.testing.assert_close(skipped, out, rtol=0, atol=0)
    else:
        assert skipped.shape == out.shape and not skipped.any()
    for name, grad in grads.items():
        torch.testing.assert_close(skipped_grads[name], grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


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


KEPT_CASES = {name: CASES[name] for name in ("base", "e6_top1_empty", "full_finetune")} | {
    "padded_rank": Case(tokens=16, hidden=32, intermediate=16, experts=4, top_k=2, rank=3, empty=(1,)),
}


@pytest.mark.parametrize("thin", ["grouped_mm", "triton"])
@pytest.mark.parametrize("mode", ["views", "copies"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_name", list(KEPT_CASES))
def test_kept_gate_up_recompute_gives_the_plain_gradients_bit_for_bit(case_name, dtype, mode, thin, monkeypatch):
    """grouped_mm with the gate/up output kept (the CUDA graphs' recompute, `_KeptGroupedMMLinear`):
    after a first and a later forward without grad keep h and s·x·Aᵀ, the recompute on the same
    inputs reads the tokens through the routing (no [S, D] gather) and gives the plain path's
    output and every gradient bit for bit: top_k=1 with empty experts, a rank padded to 16-byte
    rows, full fine-tuning of the experts (no LoRA: dW from the tokens), the weights' views and
    copies modes, and each thin-product candidate (Triton's LoRA A gradient then gathers in its
    loads). CPU: the same kernels on both paths (on CUDA the candidates are timed per key)."""
    case = KEPT_CASES[case_name]
    monkeypatch.setattr(gg, "grouped_mm_mode", lambda device, dtype: mode)
    if thin == "triton":
        monkeypatch.setattr(gg, "_thin_product", lambda kind, rows, a, grouped_mm_fn, triton_fn: triton_fn())
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1))
    want_out, want = _run("grouped_mm", case, topk_idx, tensors, dtype, grad_out)
    keep = kept.KeptActivations("projections", allow=lambda nbytes: True)
    for scale in (0.5, 1.0):  # the first forward's results become the buffers, the later one's land in them
        _run("grouped_mm", case, topk_idx, tensors | {"x": tensors["x"] * scale}, dtype, None, keep=keep)
    assert keep.enabled and len(keep.kept) == 1
    permuted = []
    real_permute = gg.permute_tokens
    monkeypatch.setattr(gg, "permute_tokens", lambda *args: permuted.append(args) or real_permute(*args))
    got_out, got = _run("grouped_mm", case, topk_idx, tensors, dtype, grad_out, keep=keep)
    assert not permuted
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0)
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_grouped_gemm_gather_scatter_lora(device):
    """One kernel call with every option on, against plain torch; expert 1 has no rows."""
    _skip_unless_runnable("triton", device)
    torch.manual_seed(0)
    rows, experts, c_dim, n_dim, rank = 23, 3, 20, 37, 5
    counts = torch.tensor([9, 0, 14])
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    expert_of_row = torch.repeat_interleave(torch.arange(experts), counts).to(device)
    src = torch.randn(7, c_dim, device=device)
    src_idx = torch.randint(0, 7, (rows,), device=device)
    out_idx = torch.randperm(rows, device=device)
    w_ECN = torch.randn(experts, n_dim, c_dim, device=device).transpose(1, 2)  # a strided view
    scale = torch.rand(rows, device=device)
    mid = torch.randn(rows, rank, device=device)
    lora_b = torch.randn(experts, rank, n_dim, device=device)

    out = grouped_gemm(
        src, w_ECN, offsets, rows, src_idx_S=src_idx, out_idx_S=out_idx, row_scale_S=scale,
        lora_mid_SR=mid, lora_b_ERN=lora_b, scaling=0.5,
    )
    per_row = torch.einsum("sc,scn->sn", src[src_idx], w_ECN[expert_of_row])
    per_row = per_row + 0.5 * torch.einsum("sr,srn->sn", mid, lora_b[expert_of_row])
    expected = torch.empty_like(out)
    expected[out_idx] = per_row * scale[:, None]
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_grouped_gemm_accumulates_in_place(device, dtype):
    """``accumulate_into``: a thin per-expert GEMM added into an existing output, once, in place; with
    ``out`` the sum goes there (a strided view here) and ``accumulate_into`` is left as it was."""
    _skip_unless_runnable("triton", device)
    torch.manual_seed(0)
    counts = torch.tensor([6, 0, 13, 2])
    rows, rank, n_dim = int(counts.sum()), 16, 35
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts).to(device)
    mid = torch.randn(rows, rank, device=device, dtype=dtype)
    b_ERN = torch.randn(4, rank, n_dim, device=device, dtype=dtype)
    out = torch.randn(rows, n_dim, device=device, dtype=dtype)
    expected = out.float() + torch.einsum("sr,srn->sn", mid.float(), b_ERN.float()[expert_of_row])

    tolerance = {} if dtype == torch.float32 else TOL[dtype]
    before = out.clone()
    dest = torch.full((n_dim, rows), float("nan"), device=device, dtype=dtype).t()
    assert grouped_gemm(mid, b_ERN, offsets, rows, accumulate_into=out, out=dest) is dest
    torch.testing.assert_close(dest.float(), expected, **tolerance)
    assert torch.equal(out, before)
    result = grouped_gemm(mid, b_ERN, offsets, rows, accumulate_into=out)
    assert result is out
    torch.testing.assert_close(out.float(), expected, **tolerance)
    with pytest.raises(ValueError, match="accumulate_into"):
        grouped_gemm(mid, b_ERN, offsets, rows, accumulate_into=out[:, :-1])
    with pytest.raises(ValueError, match="out= is for accumulate_into"):
        grouped_gemm(mid, b_ERN, offsets, rows, out=dest)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_grouped_gemm_stores_the_rows_it_gathers(device, dtype):
    """``gathered_out``: the gathered rows land bit for bit in a padded [S, C] view (its spare
    columns untouched), beside ``alpha`` times the product; C spans two tiles and N two column tiles
    (each row stored once is the kernel's business, the same values either way)."""
    _skip_unless_runnable("triton", device)
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 12, 3])
    rows, c_dim, n_dim, pad = int(counts.sum()), 70, 80, 3
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts).to(device)
    src = torch.randn(9, c_dim, generator=gen).to(device, dtype)
    src_idx = torch.randint(0, 9, (rows,), generator=gen).to(device)
    w_ECN = torch.randn(4, c_dim, n_dim, generator=gen).to(device, dtype)
    padded = torch.full((rows, c_dim + pad), float("nan"), device=device, dtype=dtype)

    out = grouped_gemm(src, w_ECN, offsets, rows, src_idx_S=src_idx, gathered_out=padded[:, :c_dim], alpha=0.25)
    assert torch.equal(padded[:, :c_dim], src[src_idx])
    assert padded[:, c_dim:].isnan().all()
    expected = 0.25 * torch.einsum("sc,scn->sn", src[src_idx].double(), w_ECN[expert_of_row].double())
    _assert_close(out, expected, dtype, "alpha * product")
    with pytest.raises(ValueError, match="gathered_out"):
        grouped_gemm(src, w_ECN, offsets, rows, src_idx_S=src_idx, gathered_out=padded[:, : c_dim - 1])


def test_thin_handoff_gives_its_product_to_that_gradient_once():
    """`_ThinHandoff`: the dy B product goes to the gradient it was computed from, once; a view of
    other strides, another tensor, or the same one changed in place (autograd accumulating into
    it) get None, and the projection computes its own."""
    handoff, dy, dyb = gg._ThinHandoff(), torch.randn(6, 4), torch.randn(6, 2)
    handoff.put(dy, dyb)
    assert handoff.take(dy) is dyb and handoff.take(dy) is None
    for other in (lambda: dy[:, :3], lambda: dy.clone(), lambda: dy.add_(1.0)):
        handoff.put(dy, dyb)
        assert handoff.take(other()) is None


@pytest.mark.parametrize("case_name", ["base", "e6_top1_empty"])  # odd_sizes: grouped_mm needs 16-byte rows
def test_grouped_mm_backend_gathers_into_the_thin_products(case_name, monkeypatch):
    """Where Triton runs, the grouped_mm backend computes gate/up's x A^T in the pass that gathers x
    into expert order and down's dy B in the pass that gathers the output gradient (no separate
    thin product runs for those two), the down projection's backward takes that dy B, and the
    output and every gradient match the reference."""
    _skip_unless_runnable("triton", "cpu")
    thin, kinds = gg._thin_product, []

    def counted(kind, *args):
        kinds.append(kind)
        return thin(kind, *args)

    taken = []
    take = gg._ThinHandoff.take
    monkeypatch.setattr(gg, "_thin_product", counted)
    monkeypatch.setattr(gg._ThinHandoff, "take", lambda self, dy: taken.append(take(self, dy)) or taken[-1])
    case = CASES[case_name]
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = _reference_run(case, topk_idx, tensors, grad_out)
    out, grads = _run("grouped_mm", case, topk_idx, tensors, torch.float32, grad_out)
    assert len(taken) == 1 and taken[0] is not None
    # down's x A^T (its input comes from the SwiGLU kernel) and gate/up's dy B (from its backward)
    assert sorted(kinds) == ["dA", "dA", "dB", "dB", "dyb", "xa"]
    _assert_close(out, ref_out, torch.float32, "output")
    for name, ref_grad in ref_grads.items():
        _assert_close(grads[name], ref_grad, torch.float32, f"grad of {name}")


def test_fused_gather_computes_no_input_gradient_that_x_does_not_need(monkeypatch):
    """With x frozen (a first layer, LoRA on the experts only), the gate/up projection's backward
    computes no input gradient: the fused gather's output does not require grad through A."""
    _skip_unless_runnable("triton", "cpu")
    needs = []
    backward = gg._grouped_mm_linear_backward
    monkeypatch.setattr(gg, "_grouped_mm_linear_backward", lambda *args: needs.append(args[10][0]) or backward(*args))
    case = CASES["base"]
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1))
    trainable = ["gate_up_A", "gate_up_B", "down_A", "down_B"]
    _, grads = _run("grouped_mm", case, topk_idx, tensors, torch.float32, grad_out, trainable=trainable)
    assert needs == [True, False]  # down (its input a depends on gate/up's LoRA), then gate/up
    _, ref_grads = _reference_run(case, topk_idx, tensors, grad_out)
    for name in trainable:
        _assert_close(grads[name], ref_grads[name], torch.float32, f"grad of {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_triton_grouped_wgrad_ragged_with_empty_expert(device):
    _skip_unless_runnable("triton", device)
    torch.manual_seed(0)
    counts = torch.tensor([0, 5, 18, 1])
    rows = int(counts.sum())
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    lhs = torch.randn(rows, 6, device=device)
    rhs = torch.randn(10, 33, device=device)
    rhs_idx = torch.randint(0, 10, (rows,), device=device)
    scale = torch.rand(rows, device=device)

    out = grouped_wgrad(lhs, rhs, offsets, rhs_idx_S=rhs_idx, row_scale_S=scale, scaling=2.0)
    bounds = zip([0, *offsets[:-1].tolist()], offsets.tolist())
    expected = torch.stack([2.0 * (lhs[s:e] * scale[s:e, None]).T @ rhs[rhs_idx[s:e]] for s, e in bounds])
    assert torch.all(out[0] == 0)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_thin_products_equal_grouped_mm(device, dtype):
    """The four thin LoRA products `_thin_product` chooses between, both ways: xa = x A_e^T,
    dyb = dy B_e, dA = dyb^T x, dB = dy^T xa; 5 experts, one with no rows, odd row counts
    (C, N, R aligned to 16 bytes: grouped_mm needs it)."""
    _skip_unless_runnable("triton", device)
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([7, 0, 13, 1, 10])
    rows, c_dim, n_dim, rank = int(counts.sum()), 40, 24, 8
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    x_SC, dy_SN, a_ERC, b_ENR = rand(rows, c_dim), rand(rows, n_dim), rand(5, rank, c_dim), rand(5, n_dim, rank)
    xa_SR = gg._GROUPED_MM(x_SC, a_ERC.transpose(1, 2), offs=offsets)
    dyb_SR = gg._GROUPED_MM(dy_SN, b_ENR, offs=offsets)
    pairs = {
        "xa": (xa_SR, grouped_gemm(x_SC, a_ERC.transpose(1, 2), offsets, rows)),
        "dyb": (dyb_SR, grouped_gemm(dy_SN, b_ENR, offsets, rows)),
        "dA": (gg._GROUPED_MM(dyb_SR.t(), x_SC, offs=offsets), grouped_wgrad(dyb_SR, x_SC, offsets)),
        "dB": (gg._GROUPED_MM(dy_SN.t(), xa_SR, offs=offsets), grouped_wgrad(dy_SN, xa_SR, offsets)),
    }
    for kind, (expected, actual) in pairs.items():
        assert actual.shape == expected.shape and actual.dtype == dtype, kind
        _assert_close(actual, expected.double(), dtype, kind)
    assert not pairs["dA"][1][1].any() and not pairs["dB"][1][1].any()  # the expert with no rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_backend_with_the_triton_thin_products(dtype, monkeypatch):
    """The grouped_mm backend as it runs where Triton was timed faster for every thin product (on
    CUDA only; forced here): output and gradients match the reference."""
    _skip_unless_runnable("triton", "cpu")
    monkeypatch.setattr(gg, "_thin_product", lambda kind, rows_S, a_ERC, grouped_mm_fn, triton_fn: triton_fn())
    case = CASES["e6_top1_empty"]
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = _reference_run(case, topk_idx, tensors, grad_out)
    out, grads = _run("grouped_mm", case, topk_idx, tensors, dtype, grad_out)
    _assert_close(out, ref_out, dtype, "output")
    for name, ref_grad in ref_grads.items():
        _assert_close(grads[name], ref_grad, dtype, f"grad of {name}")


def test_thin_product_times_once_per_key_and_never_while_capturing(monkeypatch, caplog):
    """The choice logic with fake candidates, timer and device: the faster is timed once, cached and
    reused per (product, sizes, power-of-two rows); nothing is timed during capture or off CUDA."""
    monkeypatch.setattr(gg, "_THIN_CHOICES", {})
    monkeypatch.setattr(gg, "_LOGGED", set())
    monkeypatch.setattr(gg, "_INTERPRET", False)
    capturing = False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    calls = []

    def candidate(name):
        def run():
            calls.append(name)
            return name
        return run

    grouped_mm_fn, triton_fn = candidate("grouped_mm"), candidate("triton")
    times_ms = {grouped_mm_fn: 0.2, triton_fn: 0.1}
    timed = []
    monkeypatch.setattr(gg, "_time_ms", lambda fn: timed.append(fn) or times_ms[fn])

    def thin(kind, rows, dtype=torch.bfloat16, device=torch.device("cuda", 0)):  # only shape, dtype, device are read
        rows_S = SimpleNamespace(shape=(rows, 64), dtype=dtype, device=device)
        return gg._thin_product(kind, rows_S, torch.empty(6, 16, 64), grouped_mm_fn, triton_fn)

    with caplog.at_level(logging.INFO, logger="lightning_ft.kernels.moe.grouped_gemm"):
        assert thin("xa", 1000) == "triton"  # warm-up of each, timed, the faster's warm-up result returned
        assert calls == ["grouped_mm", "triton"] and timed == [grouped_mm_fn, triton_fn]
        assert thin("xa", 1024) == "triton"  # the same power-of-two bucket: cached
        assert len(timed) == 2 and calls[2:] == ["triton"]
    assert list(gg._THIN_CHOICES.values()) == ["triton"]
    assert sum("using triton" in r.message for r in caplog.records) == 1

    times_ms[triton_fn] = 0.2  # a tie keeps grouped_mm
    assert thin("dB", 1000) == "grouped_mm" and len(timed) == 4

    capturing = True
    calls.clear()
    assert thin("xa", 600) == "triton"  # cached (bucket 1024): replayed as chosen
    assert thin("xa", 3000) == "grouped_mm"  # new bucket: grouped_mm, untimed, not cached
    assert calls == ["triton", "grouped_mm"] and len(timed) == 4 and len(gg._THIN_CHOICES) == 2

    capturing = False
    for device, dtype in ((torch.device("cpu"), torch.bfloat16), (torch.device("cuda", 0), torch.float64)):
        assert thin("dA", 1000, dtype, device) == "grouped_mm"
    monkeypatch.setattr(gg, "_INTERPRET", True)
    assert thin("dA", 1000) == "grouped_mm"
    assert len(timed) == 4 and len(gg._THIN_CHOICES) == 2

    # the real backend off CUDA: no timing, no cache entries
    case = CASES["base"]
    topk_idx, tensors = _make(case, "cpu")
    _run("grouped_mm", case, topk_idx, tensors, torch.float32, torch.randn(case.tokens, case.hidden))
    assert len(timed) == 4 and len(gg._THIN_CHOICES) == 2


def test_grouped_mm_probe_and_fallback(caplog, monkeypatch):
    """On this torch the view path is probed once, with the same answer when the first call comes from
    inference_mode (generation before training); misaligned sizes fall back to the loop, logged once."""
    monkeypatch.setattr(gg, "_GROUPED_MM_MODES", {})
    with torch.inference_mode():
        mode = grouped_mm_mode(torch.device("cpu"), torch.float32)
    has_grouped_mm = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")
    assert mode in (("views", "copies") if has_grouped_mm else ("unsupported",))
    assert grouped_mm_mode(torch.device("cpu"), torch.float32) == mode  # cached

    case = CASES["odd_sizes"]  # hidden 33: rows of 132 bytes, not a multiple of 16
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden)
    gg._LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_ft.kernels.moe.grouped_gemm"):
        out, _ = _run("grouped_mm", case, topk_idx, tensors, torch.float32, grad_out)
        _run("grouped_mm", case, topk_idx, tensors, torch.float32, grad_out)
    assert sum("running the native_torch loop" in r.message for r in caplog.records) == 1
    native, _ = _run("native_torch", case, topk_idx, tensors, torch.float32, grad_out)
    torch.testing.assert_close(out, native, rtol=0, atol=0)


def test_select_backend(monkeypatch):
    if not torch.cuda.is_available():
        assert select_backend("auto") == "native_torch"
    assert select_backend("native_torch") == "native_torch"
    with pytest.raises(ValueError, match="unknown MoE backend"):
        select_backend("megablocks")
    with pytest.raises(ValueError, match="unknown MoE backend"):
        moe_experts(None, None, None, None, None, None, backend="auto")
    monkeypatch.setattr(gg, "_INTERPRET", False)
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


@pytest.mark.gpu
@pytest.mark.parametrize("timing", ["measured", "triton_faster"])
def test_grouped_mm_thin_products_timed_once_on_cuda(timing, monkeypatch):
    """The grouped_mm backend on CUDA: the first forward+backward times the six thin products that
    run apart (four per projection, but gate/up's x A^T and down's dy B, which the gathers compute;
    "triton_faster" fakes the timer so the Triton ones surely run), the second reuses the choices;
    both match the reference."""
    monkeypatch.setattr(gg, "_THIN_CHOICES", {})
    timed = []
    fake_times = itertools.cycle([1.0, 0.0])  # calls come grouped_mm, triton
    real_time_ms = gg._time_ms
    monkeypatch.setattr(
        gg, "_time_ms", lambda fn: timed.append(fn) or (real_time_ms(fn) if timing == "measured" else next(fake_times))
    )
    # F = 192, D = 256, I = 96: the six (product, C or N) keys differ; expert 3 gets no tokens
    case = Case(tokens=512, hidden=256, intermediate=96, experts=6, top_k=2, rank=16, empty=(3,))
    topk_idx, tensors = _make(case, "cuda")
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1)).to("cuda")
    ref_out, ref_grads = _reference_run(case, topk_idx, tensors, grad_out)
    for _ in range(2):
        out, grads = _run("grouped_mm", case, topk_idx, tensors, torch.bfloat16, grad_out)
        _assert_close(out, ref_out, torch.bfloat16, "output")
        for name, ref_grad in ref_grads.items():
            _assert_close(grads[name], ref_grad, torch.bfloat16, f"grad of {name}")
        assert len(gg._THIN_CHOICES) == 6 and len(timed) == 12  # timed on the first pass only
    assert {key[0] for key in gg._THIN_CHOICES} == {"xa", "dyb", "dA", "dB"}
    if timing == "triton_faster":
        assert set(gg._THIN_CHOICES.values()) == {"triton"}
