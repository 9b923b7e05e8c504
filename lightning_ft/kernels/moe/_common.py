"""What the MoE expert backends share: the math, PEFT's split LoRA factors, the SwiGLU step.

Shape suffixes: T tokens, K top_k, E experts, S = T*K routed (token, expert) pairs in expert-sorted
order (see `routing.py`), D hidden size, I expert intermediate size, F = 2*I (gate and up rows
stacked, transformers' ``is_concatenated`` layout), R LoRA rank; for a single projection C is the
contracted (input) size and N the output size. Weights follow transformers v5: ``gate_up_proj``
w_gate_up_EFD [E, F, D] and ``down_proj`` w_down_EDI [E, D, I], i.e. [E, N, C] (``nn.Linear``-like).

Math of one expert e on its rows x_e (all backends; act is the experts' ``act_fn``, SiLU here):

    h_e   = x_e W1_e^T + s1 (x_e A1_e^T) B1_e^T (+ b1_e)  [n_e, F]   (gate_up, + split LoRA)
    a_e   = act(h_e[:, :I]) * h_e[:, I:]                  [n_e, I]
    y_e   = a_e W2_e^T + s2 (a_e A2_e^T) B2_e^T (+ b2_e)  [n_e, D]   (down, + split LoRA)
    out_t = sum_k topk_weight[t, k] * y[(t, k)]           [T, D]

gpt-oss's experts (``act_fn`` a `ClampedSwiGLU`): gate and up interleaved in h's columns (gate the
even ones, transformers' ``is_concatenated=False``), the clamped SwiGLU of `ClampedSwiGLU`, and the
per-expert biases b1_e [F], b2_e [D] (``gate_up_proj_bias``, ``down_proj_bias``). Its weights are
stored transposed ([E, D, F] and [E, I, D]); the caller passes their transposed views, the [E, N, C]
layout here (no copy: every backend reads any strides). The backends add the biases per sorted row
(`routing.expert_of_rows`); the Triton grouped GEMM in its epilogue.

The down projection and its LoRA are linear, so ``native_torch`` and ``grouped_mm`` scale a_e by
the routing weight inside the SwiGLU kernel (one pass over [S, I]) instead of y by it (two passes
over the larger [S, D] forward, more backward), and then add the down bias times that weight; the
``triton`` backend scales in its epilogue.

Split LoRA never forms B·A: the two thin GEMMs per projection reuse the base GEMM's grouping
(offsets). A_e [R, C] and B_e [N, R] are read straight from PEFT's ``target_parameters`` tensors
(`ExpertLoRA`), so gradients land in PEFT's parameters and the adapter file stays PEFT's.

Gradients (every backend; the triton backend computes them in its own kernels), per projection
with input X and output gradient dH; the routing weights are folded into the down projection's dH
(``triton``) or, equivalently, into its input X (``native_torch``, ``grouped_mm``):

    dX_e = dH_e W_e + s (dH_e B_e) A_e          dW_e = dH_e^T X_e       (full fine-tuning only)
    dA_e = s (dH_e B_e)^T X_e                   dB_e = s dH_e^T (X_e A_e^T)
    d topk_weight[(t, k)] = <dOut_t, y_(t,k)> = <dOut_t (W2_e + s B2_e A2_e), a_(t,k)>   (router input)

Every backend runs with autocast off, in the expert weights' dtype (inputs and LoRA factors are cast
to it): train with bf16 weights (``bf16-true``) to avoid casting the [E, ...] weights each step.

Sources: transformers ``integrations/moe.py`` (``grouped_mm_experts_forward``, the eager experts
loop), ``models/qwen3_moe`` and ``models/gpt_oss`` (``GptOssExperts``); PEFT 0.21 ``tuners/lora/layer.py`` (``ParamWrapper`` layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from lightning_ft.kernels._utils import INTERPRETER, triton_can_run
from lightning_ft.kernels.clamped_swiglu import clamped_swiglu, clamped_swiglu_reference
from lightning_ft.kernels.moe.lora_layout import expert_major_lora_b
from lightning_ft.kernels.moe.routing import ExpertRouting
from lightning_ft.kernels.swiglu import swiglu_concat

__all__ = ["ClampedSwiGLU", "ExpertBiases", "ExpertLoRA"]

_INTERPRET = INTERPRETER  # the MoE modules' name for it (tests patch it per module)


class ExpertLoRA(NamedTuple):
    """PEFT's LoRA on one 3-D expert weight [E, N, C] (``LoraConfig(target_parameters=...)``).

    PEFT 0.21's ``ParamWrapper`` keeps two ``nn.Linear`` layers for all experts at once; expert e's
    factors are A_e [R, C] and B_e [N, R], and its weight delta is ``scaling * B_e @ A_e``:

    Attributes:
        lora_A: [E*R, C] (``lora_A[adapter].weight``); row ``e*R + j`` is row j of A_e.
        lora_B: [N, R*E] (``lora_B[adapter].weight``); column ``j*E + e`` is column j of B_e.
        scaling: ``alpha / R`` (``alpha / sqrt(R)`` with rsLoRA), PEFT's ``scaling[adapter]``.
        num_experts: E.
    """

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float
    num_experts: int

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(a_ERC, b_ENR, scaling)`` in ``dtype``, both contiguous, differentiable w.r.t. PEFT's tensors.

        a_ERC is a view of ``lora_A`` (a cast copy when dtype differs). PEFT's B interleaves the
        experts (column ``j*E + e``), so b_ENR is always one copy that casts and lays each expert's
        [N, R] out contiguously (`expert_major_lora_b`, one Triton pass): the grouped GEMMs then
        read it, or its transposed view, coalesced, with no further copy.
        """
        num_experts = self.num_experts
        a_ERC = self.lora_A.view(num_experts, -1, self.lora_A.shape[-1])
        return a_ERC.to(dtype), expert_major_lora_b(self.lora_B, num_experts, dtype), self.scaling


_LoRAFactors = tuple[torch.Tensor, torch.Tensor, float]


class ExpertBiases(NamedTuple):
    """The experts' biases (gpt-oss's ``gate_up_proj_bias`` [E, F] and ``down_proj_bias`` [E, D]); either may be None."""

    gate_up_EF: torch.Tensor | None = None
    down_ED: torch.Tensor | None = None

    def cast(self, dtype: torch.dtype) -> ExpertBiases:
        """Both in ``dtype`` (differentiable casts)."""
        return ExpertBiases(*(None if b is None else b.to(dtype) for b in self))


def _add_routed_bias(
    out_TD: torch.Tensor, bias_ED: torch.Tensor, weight_S: torch.Tensor, routing: ExpertRouting, expert_S: torch.Tensor,
    output_needed: bool = True,
) -> torch.Tensor:
    """out_TD [T, D] plus each token's sum over its experts of routing weight × the expert's down-projection bias
    (gpt-oss's ``down_proj_bias``). One [T, E] × [E, D] GEMM over the routing weights scattered into a dense
    [T, E] matrix (``expert_S`` [S]: each sorted row's expert), accumulating into out_TD (``addmm``: no separate
    [T, D] add), instead of an [S, D] tensor of gathered biases scaled and summed; differentiable w.r.t. all three.
    With ``output_needed=False`` (out_TD is an unread output, `routing.unread_output`) the GEMM is skipped (the
    scatter into [T, E] still runs, for the backward): the result is unread too, and the backward gives the same
    gradients (the routing weights' reaches the router)."""
    num_tokens, num_experts = routing.num_tokens, bias_ED.shape[0]
    dense = weight_S.new_zeros(num_tokens * num_experts).index_copy(0, routing.token_idx_S * num_experts + expert_S, weight_S)
    dense_TE = dense.view(num_tokens, num_experts).to(bias_ED.dtype)
    if not output_needed:
        return _UnreadAddmm.apply(out_TD, dense_TE, bias_ED)
    if out_TD.dtype != bias_ED.dtype:
        return out_TD + dense_TE @ bias_ED
    return torch.addmm(out_TD, dense_TE, bias_ED)


class _UnreadAddmm(torch.autograd.Function):
    """``c + a @ b`` whose value nobody reads (c unread, `routing.unread_output`): an unread result, addmm's gradients."""

    @staticmethod
    def forward(ctx, c, a, b):
        ctx.save_for_backward(a, b)
        ctx.c_dtype = c.dtype
        return c.new_zeros((), dtype=torch.promote_types(c.dtype, b.dtype)).expand(c.shape)  # ``c + a @ b``'s dtype

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = grad.to(b.dtype) @ b.t() if ctx.needs_input_grad[1] else None
        grad_b = a.t() @ grad.to(a.dtype) if ctx.needs_input_grad[2] else None
        return grad.to(ctx.c_dtype), grad_a, grad_b


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation on h [S, F] whose columns interleave gate (even) and up (odd):

        gate = min(h[:, 0::2], limit)        up = clamp(h[:, 1::2], -limit, limit)
        a    = (up + 1) * gate * sigmoid(alpha * gate)                         [S, F / 2]

    op for op as transformers' ``GptOssExperts._apply_gate`` (alpha 1.702, limit 7.0 in the
    published configs), so also its gradient (a clamped value passes none). Plain torch
    (`lightning_ft.kernels.clamped_swiglu.clamped_swiglu_reference`); the backends run the fused kernel
    `lightning_ft.kernels.clamped_swiglu.clamped_swiglu` in place of ``act(gate) * up`` where Triton runs (`_swiglu`).
    """

    alpha: float
    limit: float

    def __call__(self, h_SF: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu_reference(h_SF, self.alpha, self.limit)


def _lora_args(lora: _LoRAFactors | None) -> tuple:
    return (None, None, 1.0) if lora is None else lora


# torch's SiLU module and transformers' ``SiLUActivation`` (its ACT2FN["silu"] in v5.2x; nn.SiLU before)
_SILU_NAMES = {"SiLU", "SiLUActivation"}


def _swiglu(
    h_SF: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    weight_S: torch.Tensor | None = None,
    pad_out: int = 0,
    pad_grad: int = 0,
    h_copy: torch.Tensor | None = None,
    bias_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """act(gate) * up (* routing weight per row) of h = [gate | up]; SiLU (every Qwen3-MoE) takes the
    fused `swiglu_concat` kernel, which folds the weight in (see its docstring for why), pads the
    output's and the gradient's rows as asked (other activations: contiguous) and writes h into
    ``h_copy`` as it reads it (other activations: a copy). A `ClampedSwiGLU` (gpt-oss) reads its
    interleaved h itself, in the fused `clamped_swiglu` kernel where Triton runs (weight, padding and
    ``bias_rows`` too). ``bias_rows``: (bias_EF [E, F], expert_S [S]), the experts' gate/up bias added to
    each row by its expert (gpt-oss; only with a `ClampedSwiGLU`)."""
    if type(act_fn).__name__ in _SILU_NAMES and triton_can_run(h_SF):
        return swiglu_concat(h_SF, weight_S, pad_out=pad_out, pad_grad=pad_grad, h_copy=h_copy)
    if h_copy is not None:
        h_copy.copy_(h_SF)
    if isinstance(act_fn, ClampedSwiGLU):  # the fused kernel where Triton runs, else its plain-torch reference
        args = (h_SF, act_fn.alpha, act_fn.limit, weight_S, *(bias_rows or (None, None)))
        if triton_can_run(h_SF):
            return clamped_swiglu(*args, pad_out=pad_out, pad_grad=pad_grad)
        return clamped_swiglu_reference(*args)
    gate_SI, up_SI = h_SF.chunk(2, dim=-1)
    y_SI = act_fn(gate_SI) * up_SI
    return y_SI if weight_S is None else y_SI * weight_S[:, None]


def _refuse_host_sync_in_capture(x: torch.Tensor, why: str) -> None:
    """Raise a clear error where a CUDA graph is being recorded and the path about to run syncs."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the MoE experts cannot be recorded in a CUDA graph: {why}; "
            "set moe.backend=triton (sync-free for every dtype and size) or strategy.cuda_graphs=false"
        )
