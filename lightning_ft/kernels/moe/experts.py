"""The routed experts of one MoE layer behind one function, `moe_experts`, on one of three backends.

Backends (what they do on each device):

* ``native_torch`` (`lightning_ft.kernels.moe.native_torch`): a Python loop over the experts, the
  plain-torch reference of the math and the fallback on any device.
* ``grouped_mm`` (`lightning_ft.kernels.moe.grouped_mm`): ``torch.nn.functional.grouped_mm`` on the
  expert-sorted rows, split LoRA added into its outputs by our Triton kernels or joined along K.
* ``triton`` (`lightning_ft.kernels.moe.grouped_gemm`): our grouped GEMM kernels, gather, LoRA,
  routing weight and un-permute fused into them.

`select_backend` resolves ``moe.backend`` (``auto`` included) to one of them. Math, shapes and split
LoRA: `lightning_ft.kernels.moe._common`.
"""

from __future__ import annotations

from typing import Callable

import torch

from lightning_ft.kernels.moe._common import _INTERPRET, ExpertBiases, ExpertLoRA
from lightning_ft.kernels.moe.grouped_gemm import _QUANTISED_WEIGHTS, experts_triton
from lightning_ft.kernels.moe.grouped_mm import _GROUPED_MM, experts_grouped_mm, grouped_mm_mode
from lightning_ft.kernels.moe.native_torch import experts_native_torch
from lightning_ft.kernels.moe.routing import ExpertRouting, permute_tokens, unpermute_tokens
from lightning_ft.kernels.fp8 import Fp8ExpertWeight
from lightning_ft.kernels.mxfp4 import Mxfp4Weight
from lightning_ft.kernels.nf4 import Nf4ExpertWeight

__all__ = ["BACKENDS", "QUANTISED_EXPERT_BACKENDS", "moe_experts", "select_backend"]

BACKENDS = ("native_torch", "grouped_mm", "triton")
#: the backends that read expert weights held quantised (fp8, NF4, MXFP4); the others read dense weights
QUANTISED_EXPERT_BACKENDS = ("triton", "grouped_mm")


def select_backend(requested: str) -> str:
    """Resolve ``moe.backend`` to a backend name, checking it can run here.

    ``auto`` is ``grouped_mm`` when CUDA is present with a native grouped kernel (sm90/sm100) and the
    bf16 probe passes, else ``native_torch``.

    Raises:
        ValueError: for an unknown name.
        RuntimeError: ``grouped_mm`` on a torch without it; ``triton`` without CUDA or
            ``TRITON_INTERPRET=1``.
    """
    if requested == "auto":
        if (
            _GROUPED_MM is not None
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] in (9, 10)
            and grouped_mm_mode(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16) != "unsupported"
        ):
            return "grouped_mm"
        return "native_torch"
    if requested not in BACKENDS:
        raise ValueError(f"unknown MoE backend {requested!r}; choose one of {('auto', *BACKENDS)}")
    if requested == "grouped_mm" and _GROUPED_MM is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm; set moe.backend=triton or native_torch")
    if requested == "triton" and not (torch.cuda.is_available() or _INTERPRET):
        raise RuntimeError("moe.backend=triton needs CUDA (or TRITON_INTERPRET=1 on the CPU); use native_torch")
    return requested


def moe_experts(
    x_TD: torch.Tensor,
    topk_weight_TK: torch.Tensor,
    routing: ExpertRouting,
    w_gate_up_EFD: torch.Tensor,
    w_down_EDI: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    gate_up_lora: ExpertLoRA | None = None,
    down_lora: ExpertLoRA | None = None,
    biases: ExpertBiases = ExpertBiases(),
    backend: str = "grouped_mm",
    output_needed: bool = True,
    keep=None,
) -> torch.Tensor:
    """The routed experts of one MoE layer: gated MLP per (token, expert) pair, weighted sum over k.

    Args:
        x_TD: [T, D] hidden states.
        topk_weight_TK: [T, K] routing weights (differentiable: the router-input gradient flows).
        routing: `ExpertRouting` from ``sort_by_expert(topk_idx_TK, E)``.
        w_gate_up_EFD: [E, 2I, D] gate and up weights (frozen or not; any strides: gpt-oss's
            transposed ``gate_up_proj`` as its ``transpose(1, 2)`` view).
        w_down_EDI: [E, D, I] down weights (likewise). Either weight may be a frozen
            `lightning_ft.kernels.mxfp4.Mxfp4Weight` or `lightning_ft.kernels.nf4.Nf4ExpertWeight` (``triton`` or
            ``grouped_mm``: dequantised whole into a shared buffer before each GEMM; its ``dtype`` is the compute
            dtype), or a frozen
            `lightning_ft.kernels.fp8.Fp8ExpertWeight` (``triton`` or ``grouped_mm``: our grouped GEMM's fp8 path).
        act_fn: the gate activation (transformers' ``experts.act_fn``), or a `ClampedSwiGLU`
            (gpt-oss: gate and up interleaved in the gate/up output).
        gate_up_lora / down_lora: PEFT's split LoRA of each projection, or None.
        biases: the experts' per-expert biases (gpt-oss), or none; they get gradients where they
            require them.
        backend: ``native_torch``, ``grouped_mm`` or ``triton`` (see the module docstring).
        output_needed: False when the caller discards the output's value and only differentiates
            through it (a checkpointed layer's recompute, where the MoE output only feeds the
            layer's residual sum): ``grouped_mm`` and ``triton`` then skip the down projection and
            the un-permute, whose backward needs neither, and return zeros attached to the graph.
        keep: kept activations (`lightning_ft.strategies.kept.KeptActivations`, or anything with its
            ``recompute``, ``store``, ``buffers`` and ``take``), ``grouped_mm`` only: a forward
            computes into the ``buffers`` of the call, if any (with LoRA slots the SwiGLU kernel
            writes h there as it reads it: the slotted GEMM has no ``out=``), and offers the gate/up
            output h [S, 2I] (split LoRA added) and the thin LoRA product s·x Aᵀ [S, R] (None
            without LoRA) to ``store``; the recompute of that forward, on the same inputs, takes
            them back and skips the gate/up GEMM, its LoRA and the [S, D] gather of x,
            differentiating through them as if it had run them (the values are the forward's
            exactly: the same kernels on the same inputs; `_KeptGroupedMMLinear`). Other backends
            neither store nor take.

    Returns:
        [T, D] in ``x_TD``'s dtype; computed in the weights' dtype with autocast off.

    Raises:
        ValueError: for an unknown backend, or MXFP4, NF4 or fp8 weights with ``native_torch`` (or with ``grouped_mm``
            where it cannot run the shapes).
        RuntimeError: ``triton`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; choose one of {BACKENDS}")
    for w in (w_gate_up_EFD, w_down_EDI):
        if isinstance(w, _QUANTISED_WEIGHTS) and backend not in QUANTISED_EXPERT_BACKENDS:
            kind = {Fp8ExpertWeight: "fp8", Nf4ExpertWeight: "NF4", Mxfp4Weight: "MXFP4"}[type(w)]
            raise ValueError(f"{kind} expert weights run on the triton and grouped_mm MoE backends, not native_torch: "
                             "set moe.backend=triton")
    if backend == "triton" and x_TD.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError(
            f"the triton MoE backend got {x_TD.device.type} tensors; it runs on CUDA (or the CPU under "
            "TRITON_INTERPRET=1): move the model to the GPU or use native_torch"
        )
    dtype = w_gate_up_EFD.dtype
    with torch.autocast(x_TD.device.type, enabled=False):
        x = x_TD.to(dtype)
        weight_S = topk_weight_TK.to(dtype).reshape(-1).index_select(0, routing.pair_idx_S)
        lora_gate_up = gate_up_lora.factors(dtype) if gate_up_lora is not None else None
        lora_down = down_lora.factors(dtype) if down_lora is not None else None
        weights = (w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down)
        biases = biases.cast(dtype)
        # grouped_mm and native_torch: the routing weight scales each pair's down-projection input
        # (inside the SwiGLU kernel)
        if backend == "triton":
            out_TD = experts_triton(x, weight_S, routing, *weights, output_needed, biases)
        elif backend == "grouped_mm":
            out_TD = experts_grouped_mm(x, routing, weight_S, *weights, output_needed, keep, biases)
        else:
            y_SD = experts_native_torch(permute_tokens(x, routing), routing, weight_S, *weights, biases)
            out_TD = unpermute_tokens(y_SD, routing)
    return out_TD.to(x_TD.dtype)
