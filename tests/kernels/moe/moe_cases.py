"""Cases and helpers of the MoE expert backend tests: random inputs, a dense reference with materialised
LoRA (W + s·B·A), and a runner of `moe_experts` forward and backward.

The reference is the stock PEFT math (delta weight per expert, then one linear per routed pair) in
float64; each backend runs at fp32 (tight) and bf16 (against the same float64 reference). A
``gpt_oss`` case holds gpt-oss's experts: weights stored transposed ([E, D, F], [E, I, D], passed as
views), gate and up interleaved, the clamped SwiGLU (`gpt_oss_act`) and per-expert biases, which
train (their gradients checked too).
"""

import contextlib
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from lightning_ft.kernels.moe import ClampedSwiGLU, ExpertBiases, ExpertLoRA, moe_experts, sort_by_expert
from lightning_ft.strategies import kept

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2}}


def gpt_oss_act(dtype: torch.dtype) -> ClampedSwiGLU:
    """gpt-oss's alpha; in fp32 limit 1.5, which h ~ N(0, 1) crosses (both clamps cut), in bf16 the
    published 7.0, which it never reaches: a bf16 h rounded across a cut flips that element's
    gradient (the clamp passes none), a difference no tolerance covers."""
    return ClampedSwiGLU(alpha=1.702, limit=1.5 if dtype == torch.float32 else 7.0)


@dataclass(frozen=True)
class Case:
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    rank: int | None  # None: no LoRA, the expert weights are trained instead (full fine-tuning)
    empty: tuple[int, ...] = ()  # experts that receive no tokens
    gpt_oss: bool = False  # gpt-oss's experts: transposed weights, interleaved gate/up, clamped SwiGLU, biases


CASES = {
    "base": Case(tokens=16, hidden=32, intermediate=16, experts=4, top_k=2, rank=4),
    "e6_top1_empty": Case(tokens=11, hidden=40, intermediate=24, experts=6, top_k=1, rank=8, empty=(2, 5)),
    "odd_sizes": Case(tokens=9, hidden=33, intermediate=10, experts=6, top_k=3, rank=3, empty=(0,)),
    "full_finetune": Case(tokens=12, hidden=32, intermediate=16, experts=5, top_k=2, rank=None, empty=(4,)),
    "gpt_oss": Case(tokens=13, hidden=32, intermediate=16, experts=5, top_k=3, rank=4, empty=(1,), gpt_oss=True),
    "gpt_oss_odd_full": Case(tokens=7, hidden=20, intermediate=6, experts=4, top_k=2, rank=None, empty=(3,), gpt_oss=True),
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
    if case.gpt_oss:  # stored as gpt-oss stores them: [E, D, F] and [E, I, D]
        tensors["w_gate_up"] = tensors["w_gate_up"].transpose(1, 2).contiguous()
        tensors["w_down"] = tensors["w_down"].transpose(1, 2).contiguous()
        tensors |= {"b_gate_up": rand(case.experts, 2 * case.intermediate), "b_down": rand(case.experts, case.hidden)}
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
    biases = ["b_gate_up", "b_down"] if case.gpt_oss else []
    if case.rank is None:
        return ["x", "topk_weight", "w_gate_up", "w_down", *biases]
    return ["x", "topk_weight", "gate_up_A", "gate_up_B", "down_A", "down_B", *biases]


def _weights(case: Case, t: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate_up_EFD, w_down_EDI): gpt-oss's stored [E, D, F] / [E, I, D] as transposed views."""
    if case.gpt_oss:
        return t["w_gate_up"].transpose(1, 2), t["w_down"].transpose(1, 2)
    return t["w_gate_up"], t["w_down"]


def _loras(case: Case, t: dict) -> tuple[ExpertLoRA | None, ExpertLoRA | None]:
    if case.rank is None:
        return None, None
    scaling = 2.0
    return (
        ExpertLoRA(t["gate_up_A"], t["gate_up_B"], scaling, case.experts),
        ExpertLoRA(t["down_A"], t["down_B"], scaling, case.experts),
    )


def _reference(case: Case, topk_idx: torch.Tensor, t: dict, act: ClampedSwiGLU) -> torch.Tensor:
    """Stock math: per-expert W + s·B_e·A_e (PEFT's delta, PEFT's layout), one linear per pair; for
    gpt-oss, transformers' ``GptOssExperts`` math written out (biases, interleaved clamped SwiGLU)."""
    w_gate_up, w_down = _weights(case, t)
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
    if case.gpt_oss:
        h = h + t["b_gate_up"][topk_idx]
        gate, up = h[..., ::2].clamp(max=act.limit), h[..., 1::2].clamp(-act.limit, act.limit)
        a = (up + 1) * gate * torch.sigmoid(act.alpha * gate)
    else:
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up
    y = torch.einsum("tki,tkdi->tkd", a, w_down[topk_idx])
    if case.gpt_oss:
        y = y + t["b_down"][topk_idx]
    return (y * t["topk_weight"][..., None]).sum(dim=1)


def _run(
    backend, case, topk_idx, tensors, dtype, grad_out, act_fn=torch.nn.SiLU(), trainable=None, output_needed=True, keep=None
):  # fmt: skip
    """Forward + backward of one backend; returns the output and the grads of the trainable tensors.

    ``nn.SiLU`` (what transformers' experts hold) takes the fused SwiGLU kernel with the routing
    weight folded in; any other callable takes the plain-torch activation path (a ``gpt_oss`` case
    always runs `gpt_oss_act`, with its biases). ``trainable``: the
    tensors that require grad (default: `_trainable`). ``keep``: kept activations inside
    `kept.keeping` (a recompute when ``grad_out`` is given, else a forward only, without grad).
    """
    trainable = _trainable(case) if trainable is None else trainable
    t = {name: v.detach().to(dtype).requires_grad_(name in trainable) for name, v in tensors.items()}
    gate_up_lora, down_lora = _loras(case, t)
    routing = sort_by_expert(topk_idx, case.experts)
    keeping = kept.keeping(keep, recompute=grad_out is not None) if keep is not None else contextlib.nullcontext()
    with keeping, torch.set_grad_enabled(grad_out is not None):
        biases = ExpertBiases(t["b_gate_up"], t["b_down"]) if case.gpt_oss else ExpertBiases()
        out = moe_experts(
            t["x"], t["topk_weight"], routing, *_weights(case, t), gpt_oss_act(dtype) if case.gpt_oss else act_fn,
            gate_up_lora=gate_up_lora, down_lora=down_lora, biases=biases, backend=backend, output_needed=output_needed,
            keep=keep,
        )
    if grad_out is None:
        return out, {}
    out.backward(grad_out.to(dtype))
    return out, {name: t[name].grad for name in trainable}


def _reference_run(case, topk_idx, tensors, grad_out, dtype=torch.float32):
    """The float64 reference's output and gradients (``dtype``: the run it is compared with, `gpt_oss_act`)."""
    t = {name: v.detach().double().requires_grad_(name in _trainable(case)) for name, v in tensors.items()}
    out = _reference(case, topk_idx, t, gpt_oss_act(dtype))
    out.backward(grad_out.double())
    return out, {name: t[name].grad for name in _trainable(case)}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    scale = expected.abs().max().clamp_min(1e-6)  # bf16 tolerances relative to the tensor's range
    tol = TOL[dtype]
    torch.testing.assert_close(
        actual.double() / scale, expected / scale, rtol=tol["rtol"], atol=tol["atol"], msg=lambda m: f"{what}: {m}"
    )
