"""LM head + cross-entropy in chunks of tokens: the [N, V] logits are never materialised.

Shapes (legend for the suffixes): N tokens, H hidden size, V vocabulary, C tokens per chunk.

Math, per token i with hidden h_i, label y_i (already shifted; -100 = ignored), head W [V, H]:

    z_i    = h_i @ W.T                                   # rounded to the compute dtype, like HF's lm_head
    z_i    = softcap * tanh(z_i / softcap)               # only with softcap
    loss_i = logsumexp(z_i) - z_i[y_i]                   # fp32; 0 for ignored tokens
    returns  (sum_i loss_i  [fp32, 0-dim],  count of y_i != -100  [int64, 0-dim])

Gradients of the SUM (the caller divides by the token count of its whole optimizer step, which may
span micro-batches, so the normalisation stays exact):

    dz_i = softmax(z_i) - onehot(y_i)                    # times (1 - tanh^2) with softcap; 0 if ignored
    dh_i = dz_i @ W        dW = sum_i dz_i^T h_i

Chunking: tokens go through in chunks of C rows. Per chunk: z = h_c @ W.T into a reused [C, V]
buffer (torch.mm, cuBLAS), one Triton program per row computes the loss and overwrites its logits
row with dz in place (two passes over V: online max/sum-exp, then softmax - onehot), then
dh_c = dz @ W (and dW += dz^T @ h_c when the head is trainable). So the gradient is ready at the end
of the forward; backward only multiplies by grad_output (no sync, no recompute). Default C: the
chunk logits about as large as the hidden states, C = next_pow2(N / ceil(V / H)), at least 1024
rows and at most N. The floor comes from tuning on Hopper (bf16, frozen head, forward+backward
device time): with 256-row chunks the [C, H] output of dh_c = dz @ W is too few tiles to fill the
GPU (cuBLAS splits K), and 1024 rows were faster than 256 at every shape tried (Qwen3 head
V=151936, H=2048 at N = 4K, 8K, 16K; Llama-3 head V=128256, H=4096 at N = 2K, 8K) for a larger
buffer (a [1024, V] bf16 buffer is 297 MiB at V=151936); 2048 rows gained little more.

Accumulation dtypes: matmuls in the compute dtype (the autocast dtype when autocast is on, else
hidden's dtype) with fp32 accumulation inside cuBLAS; softmax, loss and dz in fp32 registers; dz
stored in the compute dtype (as HF's autograd rounds the logits gradient for the bf16 lm_head);
per-token losses in fp32, summed once; dW accumulated across chunks in the compute dtype
(addmm, as peers do), then cast to weight's dtype. No dW when the head is frozen; no gradient work
at all when grad is disabled or nothing requires it.

Memory: the [C, V] chunk, dh [N, H] (kept from forward to backward), fp32 per-token losses [N],
plus dW [V, H] only for a trainable head; no [N, V] tensor in any dtype.

Labels must lie in [0, V) or be -100 (not checked on the device). Label smoothing is not supported.

Source: the chunked "fused linear cross-entropy" of Liger Kernel and Unsloth (gradient in forward,
logits chunk overwritten by its gradient), written for this package with HF's rounding order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import num_warps_for, triton_can_run, warn_fallback
from lightning_ft.kernels.fp8 import (
    E4M3, e4m3_scale, e4m3_values, fp8_gemm_runs, fp8_linear_reference, fp8_mm_rowwise, fp8_rows_done, fp8_rows_like,
    quantize_rows, transpose_bytes,
)  # fmt: skip

IGNORE_INDEX = -100
_MAX_BLOCK_V = 16384
_MIN_CHUNK = 1024


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _cross_entropy_chunk_kernel(
    LOGITS, LABELS, LOSS, SW, DQ, DS,
    stride_logits, V, softcap,
    IGNORE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, COMPUTE_GRAD: tl.constexpr, FP8_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits = LOGITS + row * stride_logits
    label = tl.load(LABELS + row)
    offs = tl.arange(0, BLOCK_V)

    if label == IGNORE:
        tl.store(LOSS + row, 0.0)
        if COMPUTE_GRAD:
            if FP8_GRAD:  # dz = 0: zero e4m3 values, the scale of an all-zero row
                zeros = tl.zeros((BLOCK_V,), dtype=DQ.dtype.element_ty)
                for start in range(0, V, BLOCK_V):
                    cols = start + offs
                    tl.store(DQ + row * V + cols, zeros, mask=cols < V)
                tl.store(DS + row, e4m3_scale(0.0))
            else:
                zeros = tl.zeros((BLOCK_V,), dtype=LOGITS.dtype.element_ty)
                for start in range(0, V, BLOCK_V):
                    cols = start + offs
                    tl.store(logits + cols, zeros, mask=cols < V)
    else:
        # Pass 1: online max and sum of exp over the vocabulary.
        m = float("-inf")
        s = 0.0
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            mask = cols < V
            z = tl.load(logits + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                z = softcap * _tanh(z / softcap)
            z = tl.where(mask, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new

        z_label = tl.load(logits + label).to(tl.float32)
        if HAS_SOFTCAP:
            z_label = softcap * _tanh(z_label / softcap)
        lse = m + tl.log(s)
        tl.store(LOSS + row, lse - z_label)

        # Pass 2: overwrite the logits with d(loss)/d(logits) = softmax - onehot.
        if COMPUTE_GRAD:
            if FP8_GRAD:  # dz · sw per row in e4m3 for the input-gradient GEMM: its row maximum, then its values
                amax = tl.zeros((BLOCK_V,), dtype=tl.float32)
                for start in range(0, V, BLOCK_V):
                    cols = start + offs
                    g = _grad_times_scale(logits, SW, cols, cols < V, label, lse, softcap, HAS_SOFTCAP)
                    amax = tl.maximum(amax, tl.abs(g))
                scale = e4m3_scale(tl.max(amax, axis=0))
                tl.store(DS + row, scale)
                for start in range(0, V, BLOCK_V):
                    cols = start + offs
                    g = _grad_times_scale(logits, SW, cols, cols < V, label, lse, softcap, HAS_SOFTCAP)
                    tl.store(DQ + row * V + cols, e4m3_values(g, scale).to(DQ.dtype.element_ty), mask=cols < V)
            else:
                for start in range(0, V, BLOCK_V):
                    cols = start + offs
                    mask = cols < V
                    dz = _logits_grad(logits, cols, mask, label, lse, softcap, HAS_SOFTCAP)
                    tl.store(logits + cols, dz.to(LOGITS.dtype.element_ty), mask=mask)


@triton.jit
def _logits_grad(logits, cols, mask, label, lse, softcap, HAS_SOFTCAP: tl.constexpr):
    """d(loss)/d(logits) of a block of a row, fp32: softmax - onehot (times 1 - tanh² with softcap)."""
    x = tl.load(logits + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        t = _tanh(x / softcap)
        z = softcap * t
    else:
        z = x
    dz = tl.exp(z - lse) - tl.where(cols == label, 1.0, 0.0)
    if HAS_SOFTCAP:
        dz = dz * (1.0 - t * t)
    return dz


@triton.jit
def _grad_times_scale(logits, SW, cols, mask, label, lse, softcap, HAS_SOFTCAP: tl.constexpr):
    """`_logits_grad` rounded to the logits' dtype (as the bf16 path stores it), times the head's row scales sw
    (fp32; 0 on masked columns): what the fp8 input-gradient GEMM quantises per row."""
    dz = _logits_grad(logits, cols, mask, label, lse, softcap, HAS_SOFTCAP).to(logits.dtype.element_ty).to(tl.float32)
    return tl.where(mask, dz * tl.load(SW + cols, mask=mask, other=0.0), 0.0)


def _chunk_size(n_tokens: int, vocab: int, hidden: int) -> int:
    chunk = triton.next_power_of_2(triton.cdiv(n_tokens, triton.cdiv(vocab, hidden)))
    return max(1, min(max(chunk, _MIN_CHUNK), n_tokens))


def gradient_bytes(n_tokens: int, hidden: int, vocab: int, element_size: int, e4m3_head: bool = False,
                   chunk_size: int | None = None, hidden_element_size: int | None = None) -> int:
    """Bytes `fused_linear_cross_entropy` holds for the gradient beyond what it allocates without one: d hidden
    [N, H] (``element_size`` bytes each, the compute dtype's; and its copy in hidden's dtype where
    ``hidden_element_size`` differs); with an e4m3 head also the head's transposed copy [H, V] (1 byte each) and a
    chunk's dz rows [C, V] in e4m3 with their fp32 scales. For a memory plan's base
    (`lightning_ft.strategies.profiler`), whose measuring pass runs the loss without gradients."""
    total = n_tokens * hidden * element_size
    if hidden_element_size is not None and hidden_element_size != element_size:
        total += n_tokens * hidden * hidden_element_size
    if e4m3_head:
        chunk = min(chunk_size or _chunk_size(n_tokens, vocab, hidden), n_tokens)
        total += vocab * hidden + chunk * (vocab + 4)
    return total


def linear_cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    softcap: float | None,
    chunk_size: int | None,
    grad_hidden: bool,
    grad_weight: bool,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Run the chunked loop. Returns (loss_sum, n_targets, d loss_sum/d hidden or None, d/d weight or None).
    With ``weight_scale`` the head is e4m3 (`_Fp8Head`; frozen: no d/d weight)."""
    device_type = hidden.device.type
    compute_dtype = (
        torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    )
    n_tokens, n_hidden = hidden.shape
    vocab = weight.shape[0]
    chunk = chunk_size or _chunk_size(n_tokens, vocab, n_hidden)
    compute_grad = grad_hidden or grad_weight
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab))
    fp8 = _Fp8Head(hidden, weight, weight_scale, grad_hidden, compute_dtype) if weight_scale is not None else None

    with torch.autocast(device_type, enabled=False):
        h_NH = hidden.to(compute_dtype)
        w_VH = weight.to(compute_dtype) if fp8 is None else weight
        labels_N = labels.to(torch.int64).contiguous()
        losses_N = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        dh_NH = torch.empty(h_NH.shape, dtype=compute_dtype, device=hidden.device) if grad_hidden else None
        dw_VH = torch.zeros_like(w_VH) if grad_weight else None
        # Note: one [C, V] buffer serves every chunk, first as logits, then (in place) as their gradient.
        buffer_CV = torch.empty((min(chunk, n_tokens), vocab), dtype=compute_dtype, device=hidden.device)
        grad_rows = fp8_rows_like(buffer_CV) if fp8 is not None and grad_hidden else None  # dz · sw in e4m3
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            h_CH = h_NH[start:end]
            logits_CV = buffer_CV[: end - start]
            if fp8 is None:
                torch.mm(h_CH, w_VH.t(), out=logits_CV)
            else:
                fp8.logits(start, end, logits_CV)
            dq_CV, ds_C = (t[: end - start] for t in grad_rows) if grad_rows is not None else (logits_CV, losses_N)
            _cross_entropy_chunk_kernel[(end - start,)](
                logits_CV, labels_N[start:end], losses_N[start:end],
                weight_scale if fp8 is not None else losses_N, dq_CV, ds_C,
                logits_CV.stride(0), vocab, softcap or 1.0,
                IGNORE=IGNORE_INDEX, HAS_SOFTCAP=softcap is not None, COMPUTE_GRAD=compute_grad,
                FP8_GRAD=grad_rows is not None, BLOCK_V=block_v, num_warps=num_warps_for(block_v),
            )  # fmt: skip
            dlogits_CV = logits_CV
            if grad_hidden and fp8 is not None:
                fp8.input_grad(fp8_rows_done((dq_CV, ds_C)), dh_NH[start:end])
            elif grad_hidden:
                torch.mm(dlogits_CV, w_VH, out=dh_NH[start:end])
            if grad_weight:
                dw_VH.addmm_(dlogits_CV.t(), h_CH)
        loss = losses_N.sum()
        n_targets = (labels_N != IGNORE_INDEX).sum()
    dh = dh_NH.to(hidden.dtype) if grad_hidden else None
    dw = dw_VH.to(weight.dtype) if grad_weight else None
    return loss, n_targets, dh, dw


class _Fp8Head:
    """The products of an e4m3 head W ≈ Wq · sw[:, None] (Wq [V, H] e4m3, sw [V] fp32) for the chunked loop:
    the logits of a chunk from the hidden rows quantised once per call, and the input gradient of a chunk from
    its dz · sw rows (quantised by the cross-entropy kernel) against Wqᵀ, transposed once per call. The math of
    `lightning_ft.kernels.fp8.fp8_linear` (``_scaled_mm`` where it runs, else its fp32 reference)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, grad_hidden: bool,
                 compute_dtype: torch.dtype):
        self.weight, self.weight_scale = weight, weight_scale
        # _scaled_mm writes bf16: other compute dtypes take the reference's fp32 products
        self.use_scaled_mm = fp8_gemm_runs(hidden.device, weight) and compute_dtype == torch.bfloat16
        self.h_rows = quantize_rows(hidden)
        # the input gradient's second operand is Wqᵀ in row-major memory (_scaled_mm's column-major [V, H])
        self.w_t = (transpose_bytes(weight) if self.use_scaled_mm else weight.t()) if grad_hidden else None

    def logits(self, start: int, end: int, out: torch.Tensor) -> None:
        """out [end - start, V] (bf16 on ``_scaled_mm``) = the chunk's logits."""
        h_q, h_scale = self.h_rows
        fp8_mm_rowwise(h_q[start:end], h_scale[start:end], self.weight, self.weight_scale, self.use_scaled_mm, out=out)

    def input_grad(self, rows: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
        """out [C, H] = (dz · sw) Wq of a chunk, from its e4m3 rows (q [C, V], scale [C])."""
        fp8_mm_rowwise(rows[0], rows[1], self.w_t, None, self.use_scaled_mm, out=out)


def _fp8_head_check(weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    if weight.dtype != E4M3 or weight_scale.shape != weight.shape[:1] or weight_scale.dtype != torch.float32:
        raise ValueError(
            f"fused_linear_cross_entropy: an e4m3 head needs weight [V, H] e4m3 and weight_scale [V] fp32, got "
            f"{weight.dtype} {tuple(weight.shape)} and {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Chunked LM head + cross-entropy; the gradients are made in forward and only scaled in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, softcap, chunk_size, weight_scale):
        loss, n_targets, dh, dw = linear_cross_entropy_forward(
            hidden, weight, labels, softcap, chunk_size,
            grad_hidden=ctx.needs_input_grad[0], grad_weight=ctx.needs_input_grad[1], weight_scale=weight_scale,
        )  # fmt: skip
        ctx.mark_non_differentiable(n_targets)
        ctx.grads = (dh, dw)
        return loss, n_targets

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_n_targets):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_cross_entropy: backward ran twice; its gradients were scaled in place")
        dh, dw = ctx.grads
        ctx.grads = None
        if dh is not None:
            dh.mul_(grad_loss)
        if dw is not None:
            dw.mul_(grad_loss)
        return dh, dw, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    softcap: float | None = None,
    chunk_size: int | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies of `hidden @ weight.T` against `labels`, and the target count.

    hidden [N, H] (bf16/fp16/fp32), weight [V, H], labels [N] int64 (shifted, -100 ignored).
    Returns (loss_sum fp32 0-dim, n_targets int64 0-dim); divide by the step's token count yourself.

    With ``weight_scale`` ([V] fp32) the head is frozen in e4m3, W ≈ weight · weight_scale[:, None]
    (`lightning_ft.kernels.fp8.quantize_weight`; ``strategy.fp8_lm_head``): the logits and the input
    gradient are fp8 products (`lightning_ft.kernels.fp8.fp8_linear`'s math: the hidden rows quantised once,
    dz · sw quantised per row inside the cross-entropy kernel, no pass of its own; ``torch._scaled_mm`` on
    sm90+ where V and H are multiples of 16, else its fp32 reference). The weight gets no gradient.

    Raises:
        ValueError: shapes that do not match, a non-positive softcap or chunk size, or an e4m3 head whose
            weight is not e4m3 [V, H] or whose scale is not fp32 [V].
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
            "must be [N, H] and [V, H]"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy: labels {tuple(labels.shape)} must be [{hidden.shape[0]}]")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"fused_linear_cross_entropy: softcap must be positive, got {softcap}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size must be positive, got {chunk_size}")
    if weight_scale is not None:
        _fp8_head_check(weight, weight_scale)
    if not triton_can_run(hidden):
        warn_fallback("fused_linear_cross_entropy", hidden.device)
        return linear_cross_entropy_reference(hidden, weight, labels, softcap=softcap, weight_scale=weight_scale)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return LinearCrossEntropyFunction.apply(hidden, weight, labels, softcap, chunk_size, weight_scale)
    loss, n_targets, _, _ = linear_cross_entropy_forward(
        hidden, weight, labels, softcap, chunk_size, grad_hidden=False, grad_weight=False, weight_scale=weight_scale
    )
    return loss, n_targets


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: float | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch version: materialised logits in hidden's dtype, upcast to fp32 like HF, summed CE. With
    ``weight_scale`` the e4m3 head's logits come from `lightning_ft.kernels.fp8.fp8_linear_reference`."""
    if weight_scale is not None:
        logits = fp8_linear_reference(hidden, weight, weight_scale).float()
    else:
        logits = torch.nn.functional.linear(hidden, weight).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (labels != IGNORE_INDEX).sum()
