"""The routed experts over the tokens in chunks: long rows whose experts' working set would not fit at once.

An MoE block's experts hold several [S, ·] tensors at a time, S = T*K routed rows: the gate/up output h [S, F],
the SwiGLU output [S, I], the gradients of both in backward. At gpt-oss-20b's 32 experts top-4 (F = 5760, I = 2880)
and T = 262,144 tokens that is 11.25 GiB for h alone and ~34 GiB for the backward's working set of one layer, more
than an 80 GB GPU has left beside the weights. The experts' math is per token (each token's output reads only its own
row and its experts' weights), so the tokens split into chunks of at most ``chunk_tokens`` computed one after the
other give the same output; the weights' and LoRA factors' gradients are sums over tokens, so they are the sums of the
chunks' gradients.

`moe_experts_in_chunks` runs the experts of one block this way, with a working set of one chunk's:

* without grad (a checkpointed layer's forward), one chunk after the other into the [T, D] output;
* with grad, one autograd node (`_TokenChunkedExperts`) that saves only its inputs (x [T, D], the routing weights
  [T, K] and ids [T, K]); its backward computes each chunk's forward again under grad and differentiates it at once,
  so one chunk's graph is alive at a time. Where the output is needed (``output_needed``) its forward computes it,
  chunk by chunk, and the backward's recompute is an extra forward of the experts; where it is not (the recompute
  of a checkpointed layer, `lightning_ft.strategies.recompute`) the forward computes nothing and the experts run
  once, in the backward, as they would unchunked. Either way the node saves the same tensors, as
  ``torch.utils.checkpoint`` requires of a recompute.

The chunks' LoRA-factor, bias and (full fine-tuning) weight gradients are summed in fp32 (or the parameter's dtype
where wider) and cast to the parameter's dtype once. Unchunked, the grouped GEMM sums over all rows in fp32 and rounds
once; chunked, each chunk's gradient is rounded to the compute dtype before the sum, so a bf16 run differs from the
unchunked one by up to one bf16 rounding per chunk (the tests' bf16 tolerance covers it). Each chunk is routed on its
own (`sort_by_expert` on its [t, K] ids: the same experts and weights), and every backend runs a chunk as it would a
whole layer. The backward is once differentiable (no double backward through the experts).

Source: the per-token independence of the expert MLPs (sequence-tiled MLPs, e.g. Arctic Long Sequence Training's
TiledMLP, do the same for dense MLPs); the chunk size default, `auto_chunk_tokens`.
"""

from __future__ import annotations

from typing import Callable

import torch

from lightning_ft.kernels.moe._common import ExpertBiases, ExpertLoRA
from lightning_ft.kernels.moe.experts import moe_experts
from lightning_ft.kernels.moe.routing import sort_by_expert, unread_output

__all__ = ["CHUNK_BYTES", "CHUNK_MULTIPLE", "auto_chunk_tokens", "moe_experts_in_chunks"]

#: the largest gate/up output h [S_chunk, F] of one chunk under ``moe.chunk_tokens=auto``, in bytes. 2 GiB holds
#: gpt-oss-20b's at 32K tokens (1.41 GiB) and Qwen3-30B-A3B's at 64K (1.5 GiB): the measured rows up to there run
#: unchunked, and a chunk's grouped GEMMs still have ~2^17 routed rows or more.
CHUNK_BYTES = 2 * 1024**3
#: ``auto`` chunks are a multiple of this many tokens (aligned slices of the [T, ·] inputs; even GEMM row counts)
CHUNK_MULTIPLE = 128


def auto_chunk_tokens(top_k: int, gate_up_size: int, itemsize: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The tokens per chunk of ``moe.chunk_tokens=auto``: the most whose gate/up output fits ``chunk_bytes``.

    Args:
        top_k: K, experts per token.
        gate_up_size: F, the gate/up output's columns (2 × the expert intermediate size).
        itemsize: bytes per element of the compute dtype.
        chunk_bytes: the budget of one chunk's [T_chunk * K, F] gate/up output.

    Returns:
        A positive token count: a multiple of `CHUNK_MULTIPLE` where the budget holds one, else at least 1.
    """
    tokens = chunk_bytes // (top_k * gate_up_size * itemsize)
    return tokens // CHUNK_MULTIPLE * CHUNK_MULTIPLE if tokens >= CHUNK_MULTIPLE else max(1, tokens)


def moe_experts_in_chunks(
    x_TD: torch.Tensor,
    topk_weight_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    num_experts: int,
    w_gate_up_EFD,
    w_down_EDI,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    chunk_tokens: int,
    gate_up_lora: ExpertLoRA | None = None,
    down_lora: ExpertLoRA | None = None,
    biases: ExpertBiases = ExpertBiases(),
    backend: str = "grouped_mm",
    output_needed: bool = True,
) -> torch.Tensor:
    """`lightning_ft.kernels.moe.moe_experts` over chunks of at most ``chunk_tokens`` tokens (see the module docstring).

    Args:
        x_TD: [T, D] hidden states.
        topk_weight_TK: [T, K] routing weights (differentiable).
        topk_idx_TK: [T, K] integer expert ids in ``[0, num_experts)``; each chunk is routed from its rows.
        num_experts: E.
        w_gate_up_EFD, w_down_EDI, act_fn, gate_up_lora, down_lora, biases, backend: as `moe_experts` takes them.
            Weights that require grad (full fine-tuning of the experts) get their gradients summed over the chunks too.
        chunk_tokens: tokens per chunk (a positive int); T ≤ ``chunk_tokens`` runs `moe_experts` once, unchunked.
        output_needed: False where nothing reads the output's value (see `moe_experts`): the forward computes
            nothing and returns zeros attached to the graph.

    Returns:
        [T, D] in ``x_TD``'s dtype.

    Raises:
        ValueError: ``chunk_tokens`` below 1, or what `moe_experts` raises.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive number of tokens, got {chunk_tokens}")
    num_tokens = x_TD.shape[0]
    run = _ChunkRun(num_experts, w_gate_up_EFD, w_down_EDI, act_fn, gate_up_lora, down_lora, biases, backend)
    trainable = run.trainable()
    if num_tokens <= chunk_tokens:
        return run(x_TD, topk_weight_TK, topk_idx_TK, trainable, output_needed)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x_TD, topk_weight_TK, *trainable))
    if not grad:
        return _chunked_output(run, chunk_tokens, x_TD, topk_weight_TK, topk_idx_TK, trainable) if output_needed \
            else unread_output(x_TD, *x_TD.shape)
    return _TokenChunkedExperts.apply(run, chunk_tokens, output_needed, x_TD, topk_weight_TK, topk_idx_TK, *trainable)


def _chunked_output(run, chunk_tokens, x_TD, topk_weight_TK, topk_idx_TK, trainable) -> torch.Tensor:
    """[T, D]: the experts' output computed chunk by chunk (no autograd graph)."""
    out_TD = x_TD.new_empty(x_TD.shape)
    for start in range(0, x_TD.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        out_TD[rows] = run(x_TD[rows], topk_weight_TK[rows], topk_idx_TK[rows], trainable, True)
    return out_TD


class _ChunkRun:
    """One block's experts on one chunk of tokens: `moe_experts` with the chunk's own routing.

    ``trainable`` are the tensors gradients may flow to, in a fixed order: the two LoRA factors of each
    projection (PEFT's ``lora_A`` and ``lora_B``, None without LoRA), the two biases, the two weights (None for a
    frozen or quantised one, which the run reads from here).
    """

    def __init__(self, num_experts, w_gate_up_EFD, w_down_EDI, act_fn, gate_up_lora, down_lora, biases, backend):
        self.num_experts, self.act_fn, self.backend = num_experts, act_fn, backend
        self.weights = (w_gate_up_EFD, w_down_EDI)
        self.loras = (gate_up_lora, down_lora)
        self.biases = biases

    def trainable(self) -> list[torch.Tensor | None]:
        factors = [t for lora in self.loras for t in ((lora.lora_A, lora.lora_B) if lora is not None else (None, None))]
        weights = [w if isinstance(w, torch.Tensor) and w.requires_grad else None for w in self.weights]
        return [*factors, *self.biases, *weights]

    def __call__(self, x_TD, topk_weight_TK, topk_idx_TK, trainable, output_needed) -> torch.Tensor:
        a_gu, b_gu, a_dn, b_dn, bias_gu, bias_dn, w_gu, w_dn = trainable
        loras = [
            None if lora is None else lora._replace(lora_A=a, lora_B=b)
            for lora, a, b in zip(self.loras, (a_gu, a_dn), (b_gu, b_dn))
        ]
        w_gate_up = w_gu if w_gu is not None else self.weights[0]
        w_down = w_dn if w_dn is not None else self.weights[1]
        return moe_experts(
            x_TD, topk_weight_TK, sort_by_expert(topk_idx_TK, self.num_experts), w_gate_up, w_down, self.act_fn,
            gate_up_lora=loras[0], down_lora=loras[1], biases=ExpertBiases(bias_gu, bias_dn), backend=self.backend,
            output_needed=output_needed,
        )  # fmt: skip


class _TokenChunkedExperts(torch.autograd.Function):
    """out_TD of the experts, chunk by chunk; the backward recomputes and differentiates one chunk at a time.

    Saves x_TD, topk_weight_TK, topk_idx_TK and the trainable tensors (references to parameters, no copies); the
    gradients of x and of the routing weights are written chunk by chunk into [T, D] and [T, K] tensors, those of
    the trainable tensors summed in fp32 (None for one no chunk reached, as unchunked).
    """

    @staticmethod
    def forward(ctx, run, chunk_tokens, output_needed, x_TD, topk_weight_TK, topk_idx_TK, *trainable):
        ctx.run, ctx.chunk_tokens = run, chunk_tokens
        ctx.save_for_backward(x_TD, topk_weight_TK, topk_idx_TK, *trainable)
        if not output_needed:
            return unread_output(x_TD, *x_TD.shape)
        return _chunked_output(run, chunk_tokens, x_TD, topk_weight_TK, topk_idx_TK, trainable)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_TD):
        x_TD, topk_weight_TK, topk_idx_TK, *trainable = ctx.saved_tensors
        need_x, need_weight = ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        need_trainable = ctx.needs_input_grad[6:]
        # Note: the trainable tensors are detached once and shared by every chunk's graph; each chunk's gradient
        # w.r.t. them is added into a sum right after that chunk's backward, and its graph and gradients are let go
        # before the next chunk runs (one chunk's alive at a time).
        leaves = [t.detach().requires_grad_() if need else None for t, need in zip(trainable, need_trainable)]
        run_with = [leaf if leaf is not None else t for leaf, t in zip(leaves, trainable)]
        wanted_leaves = [leaf for leaf in leaves if leaf is not None]
        sums: list[torch.Tensor | None] = [None] * len(wanted_leaves)
        grad_x = torch.empty_like(x_TD) if need_x else None
        grad_weight = torch.empty_like(topk_weight_TK) if need_weight else None
        for start in range(0, x_TD.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            x = x_TD[rows].detach().requires_grad_(need_x)
            weight = topk_weight_TK[rows].detach().requires_grad_(need_weight)
            with torch.enable_grad():
                out = ctx.run(x, weight, topk_idx_TK[rows], run_with, False)
            wanted = [t for t, need in ((x, need_x), (weight, need_weight)) if need] + wanted_leaves
            grads = list(torch.autograd.grad(out, wanted, grad_TD[rows], allow_unused=True))
            del out
            if need_x:
                _write(grad_x[rows], grads.pop(0))
            if need_weight:
                _write(grad_weight[rows], grads.pop(0))
            for i, grad in enumerate(grads):
                if grad is not None and sums[i] is None:
                    sums[i] = grad.to(torch.promote_types(grad.dtype, torch.float32), copy=True)
                elif grad is not None:
                    sums[i] += grad
            del grads
        totals = iter(sums)
        grad_trainable = [
            None if leaf is None or (total := next(totals)) is None else total.to(t.dtype)
            for leaf, t in zip(leaves, trainable)
        ]
        return None, None, None, grad_x, grad_weight, None, *grad_trainable


def _write(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """A chunk's gradient into its rows of the whole input's (zeros where the chunk's output did not depend on it)."""
    if grad is None:
        out.zero_()
    else:
        out.copy_(grad)
