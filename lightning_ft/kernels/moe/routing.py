"""Top-k routing and the expert-sorted order of (token, expert) pairs, built once per MoE layer.

Shape suffixes: T tokens, K top_k, E num_experts, D hidden size, S = T*K routed (token, expert)
pairs. A tensor ending in ``_S`` is in expert-sorted order: the pairs of expert 0 first, then those
of expert 1, ..., each expert's pairs in (token, k) order because the sort is stable.

Router kinds (`ROUTER_KINDS`; a patch table names its architecture's, `MoEClasses.router_kind`):

    softmax_topk     `topk_routing` (Qwen3-MoE, Mixtral): ``probs = softmax(router_logits)`` in fp32,
                     ``topk_weight, topk_idx = topk(probs, K)``, divided by their sum when
                     ``norm_topk_prob`` (Mixtral always), cast back to the logits' dtype.
    sigmoid_grouped  `grouped_topk_routing` (DeepSeek-V3, GLM-4.5): ``scores = sigmoid(logits)``;
                     the choice ranks ``scores + bias`` (``e_score_correction_bias``) within the
                     ``topk_group`` best of ``n_group`` expert groups (a group's rank: the sum of
                     its two best); the weights are the chosen experts' unbiased scores,
                     divided by their sum (+1e-20) when ``norm_topk_prob``, times
                     ``routed_scaling_factor``.
    topk_softmax     `topk_softmax_routing` (gpt-oss): ``topk(router_logits, K)`` on the logits (the
                     router's linear has a bias), then a softmax over the K chosen logits, in the
                     logits' dtype.

Grouping, with no device-to-host sync and no per-expert loop:

    expert_of_pair  = topk_idx_TK.flatten()                  pair p = t*K + k
    sorted, pair_idx_S = sort(expert_of_pair, stable=True)   S pairs grouped by expert
    offsets_E       = searchsorted(sorted, [0..E-1], right)  int32 end of each expert's rows
    tokens_per_expert_E = diff(offsets_E, prepend=0)         == bincount(topk_idx_TK, minlength=E)

``offsets_E`` is what ``torch._grouped_mm`` calls ``offs``. Note: the counts come from
``searchsorted`` on the already sorted ids and not from ``torch.bincount``, because CUDA's bincount
reads the input's min and max back to the host (two syncs per call) and ``histc`` needs float input
on the CPU; searchsorted is sync-free on every device, deterministic, and yields the cumulative
offsets directly.

Sources: transformers ``modeling_qwen3_moe.py``, ``modeling_mixtral.py``, ``modeling_deepseek_v3.py``,
``modeling_glm4_moe.py`` and ``modeling_gpt_oss.py`` (routers) and ``integrations/moe.py`` (sort +
histc grouping of its ``grouped_mm`` experts path); the offsets convention of ``torch._grouped_mm``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import num_warps_for, row_padded, triton_can_run

__all__ = [
    "ROUTER_KINDS", "ExpertRouting", "expert_of_rows", "grouped_topk_routing", "permute_tokens", "sort_by_expert",
    "sum_pairs", "topk", "topk_routing", "topk_softmax_routing", "unpermute_tokens", "unread_output",
]  # fmt: skip

TOPK_MAX_K = 32  # `topk`'s kernel unrolls its K selections
TOPK_MAX_WIDTH = 1024  # ... over rows held in registers: a router's E experts


@triton.jit
def _topk_kernel(X, VALUES, INDICES, n_rows, n_cols, stride_x, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per row: K times the largest remaining value (NaN ranked as +inf), the lowest column among
    equal values; its value and column go to output column k."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < n_rows
    rows64 = rows.to(tl.int64)
    alive = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=alive, other=0.0)
    key = tl.where(x != x, float("inf"), x.to(tl.float32))  # NaN ranks first
    for k in tl.static_range(K):
        best = tl.max(tl.where(alive, key, float("-inf")), axis=1)
        hit = alive & (key == best[:, None])
        col = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
        chosen = cols[None, :] == col[:, None]
        value = tl.sum(tl.where(chosen, x, 0.0), axis=1)  # the input's own value (a NaN stays NaN)
        tl.store(VALUES + rows64 * K + k, value.to(VALUES.dtype.element_ty), mask=row_mask)
        tl.store(INDICES + rows64 * K + k, col.to(tl.int64), mask=row_mask)
        alive = alive & ~chosen


class _TopK(torch.autograd.Function):
    """`topk`'s kernel; the backward scatters the values' gradient into zeros, as torch.topk's does."""

    @staticmethod
    def forward(ctx, x_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        n_rows, n_cols = x_TE.shape
        x_TE = x_TE if x_TE.stride(-1) == 1 else x_TE.contiguous()
        values = x_TE.new_empty(n_rows, k)
        indices = torch.empty(n_rows, k, dtype=torch.int64, device=x_TE.device)
        if n_rows:
            block_e = triton.next_power_of_2(n_cols)
            block_t = max(1, min(64, 4096 // block_e))
            _topk_kernel[(triton.cdiv(n_rows, block_t),)](
                x_TE, values, indices, n_rows, n_cols, x_TE.stride(0),
                K=k, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps_for(block_t * block_e),
            )  # fmt: skip
        ctx.save_for_backward(indices)
        ctx.n_cols = n_cols
        ctx.mark_non_differentiable(indices)
        return values, indices

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_values: torch.Tensor, _grad_indices):
        (indices,) = ctx.saved_tensors
        grad = grad_values.new_zeros(grad_values.shape[0], ctx.n_cols)
        return grad.scatter_(1, indices, grad_values), None


def topk(x_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x_TE, k, dim=-1)`` (largest, sorted) for a router's [T, E] rows, in one kernel.

    Why: for a router's small rows (Qwen3-30B-A3B at 8K tokens: [8192, 128] fp32, K = 8)
    torch.topk runs a radix-select kernel and then a separate sort of the K results, twice per layer
    and step (forward and recompute). Here each program holds rows in registers and selects K times,
    in one launch.

    The same selection as torch.topk: every value above the K-th largest, then the lowest columns
    among those equal to it (torch's gather writes them in column order and takes the first); NaN
    ranks as +inf, above every finite value (torch ranks it above +inf too: a row holding both may
    differ, as may a selected -0.0, which comes out as +0.0; a router's probabilities hold
    neither). Values come out descending, equal values in column order: torch.topk
    leaves the order of equal values to its sort and promises none, so that order alone may differ
    from torch's (the same values in the same positions, only which of the equal columns is listed
    first). Gradient: zeros with the values' gradient at the selected columns (torch's backward).

    Args:
        x_TE: [T, E] floating point, E <= `TOPK_MAX_WIDTH`.
        k: 1 <= k <= min(E, `TOPK_MAX_K`).

    Returns:
        ``(values [T, k] in x's dtype, indices [T, k] int64)``; torch.topk itself where Triton
        cannot run (the CPU without ``TRITON_INTERPRET=1``) or the sizes are out of these bounds.
    """
    if (
        x_TE.dim() != 2 or not x_TE.is_floating_point() or not triton_can_run(x_TE) or x_TE.dtype == torch.float64
        or not 1 <= k <= min(x_TE.shape[1], TOPK_MAX_K) or x_TE.shape[1] > TOPK_MAX_WIDTH
    ):
        return torch.topk(x_TE, k, dim=-1)
    return _TopK.apply(x_TE, k)


def _check_topk_args(router_logits_TE: torch.Tensor, top_k: int) -> None:
    """Raise ValueError unless the logits are [T, E] and 1 <= top_k <= E."""
    if router_logits_TE.dim() != 2:
        raise ValueError(f"router_logits_TE must be [T, E], got shape {tuple(router_logits_TE.shape)}")
    if not 1 <= top_k <= router_logits_TE.shape[1]:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={router_logits_TE.shape[1]}]")


def topk_routing(
    router_logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, then the top-k experts of each token and their weights.

    The math of transformers' ``Qwen3MoeTopKRouter`` (the same values, tested; the top-k by `topk`,
    whose order among equal weights may differ), for callers that own their router: the benchmark's
    routing rows and model-free use of these kernels. The MoE patch keeps HF's router module
    so that ``router_logits`` stay what transformers records (its top-k runs `topk` too).

    Args:
        router_logits_TE: [T, E] router logits, any float dtype.
        top_k: experts per token, 1 <= top_k <= E.
        norm_topk_prob: divide the k weights of a token by their sum (Qwen3-MoE's flag).

    Returns:
        ``topk_weight_TK`` [T, K] in the logits' dtype (computed in fp32) and ``topk_idx_TK``
        [T, K] int64 expert ids, in descending weight order.

    Raises:
        ValueError: if the logits are not 2-D or ``top_k`` is out of range.
    """
    _check_topk_args(router_logits_TE, top_k)
    probs_TE = torch.softmax(router_logits_TE, dim=-1, dtype=torch.float32)
    topk_weight_TK, topk_idx_TK = topk(probs_TE, top_k)
    if norm_topk_prob:
        topk_weight_TK = topk_weight_TK / topk_weight_TK.sum(dim=-1, keepdim=True)
    return topk_weight_TK.to(router_logits_TE.dtype), topk_idx_TK


def grouped_topk_routing(
    router_logits_TE: torch.Tensor,
    top_k: int,
    bias_E: torch.Tensor,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores, a selection bias and group-limited top-k: DeepSeek-V3's routing.

    The math of transformers' ``DeepseekV3TopkRouter`` and ``Glm4MoeTopkRouter`` (the same values
    and experts, tested, ties and groups included): ``scores = sigmoid(logits)`` in fp32; each of
    the ``n_group`` groups of E / n_group consecutive experts is ranked by the sum of its two best
    ``scores + bias``; the experts of all but the ``topk_group`` best groups are masked out; the K
    best remaining ``scores + bias`` choose the experts (`topk`: torch.topk's choice among equal
    values on the GPU, torch.topk itself on the CPU); their weights are their unbiased scores,
    divided by their sum (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``. With one
    group (GLM-4.5-Air) the group stage is skipped: it masks nothing. Every step is a tensor op on
    the device: no host sync.

    Args:
        router_logits_TE: [T, E] router logits, any float dtype (transformers computes them in fp32).
        top_k: experts per token, 1 <= top_k <= topk_group * E / n_group.
        bias_E: [E] ``e_score_correction_bias``: shifts which experts are chosen, not their weights.
        n_group: expert groups, dividing E.
        topk_group: groups a token may route to, 1 <= topk_group <= n_group.
        norm_topk_prob: divide the k weights of a token by their sum.
        routed_scaling_factor: multiplies every weight.

    Returns:
        ``topk_weight_TK`` [T, K] in the logits' dtype (computed in fp32) and ``topk_idx_TK`` [T, K]
        int64 expert ids, in descending order of ``scores + bias``.

    Raises:
        ValueError: logits not 2-D, a bias of another length, or group sizes / ``top_k`` out of range.
    """
    if router_logits_TE.dim() != 2:
        raise ValueError(f"router_logits_TE must be [T, E], got shape {tuple(router_logits_TE.shape)}")
    num_experts = router_logits_TE.shape[1]
    if bias_E.shape != (num_experts,):
        raise ValueError(f"bias_E must be [E={num_experts}], got shape {tuple(bias_E.shape)}")
    if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group={n_group} must divide num_experts={num_experts} and 1 <= topk_group={topk_group} <= n_group")
    if not 1 <= top_k <= topk_group * (num_experts // n_group):
        raise ValueError(
            f"top_k={top_k} must be in [1, topk_group * num_experts / n_group = {topk_group * (num_experts // n_group)}]"
        )
    scores_TE = router_logits_TE.float().sigmoid()
    choice_TE = scores_TE + bias_E.float()
    if n_group > 1:
        group_size = num_experts // n_group
        group_scores_TG = choice_TE.view(-1, n_group, group_size).topk(min(2, group_size), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores_TG, topk_group, dim=-1, sorted=False)[1]
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, group_idx, True)
        keep_TE = keep_TG.unsqueeze(-1).expand(-1, n_group, group_size).reshape(-1, num_experts)
        choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
    topk_idx_TK = topk(choice_TE, top_k)[1]
    topk_weight_TK = scores_TE.gather(1, topk_idx_TK)
    if norm_topk_prob:
        topk_weight_TK = topk_weight_TK / (topk_weight_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return (topk_weight_TK * routed_scaling_factor).to(router_logits_TE.dtype), topk_idx_TK


def topk_softmax_routing(router_logits_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k logits of each token, then a softmax over those k: gpt-oss's routing.

    The math of transformers' ``GptOssTopKRouter`` after its linear (weight and bias): the same
    experts and weights (tested); the top-k by `topk`. Unlike `topk_routing` the softmax runs over
    the K chosen logits only (so the weights sum to 1), in the logits' dtype, as transformers does.

    Args:
        router_logits_TE: [T, E] router logits, any float dtype.
        top_k: experts per token, 1 <= top_k <= E.

    Returns:
        ``topk_weight_TK`` [T, K] in the logits' dtype and ``topk_idx_TK`` [T, K] int64 expert ids,
        in descending logit order.

    Raises:
        ValueError: if the logits are not 2-D or ``top_k`` is out of range.
    """
    _check_topk_args(router_logits_TE, top_k)
    top_logits_TK, topk_idx_TK = topk(router_logits_TE, top_k)
    return torch.softmax(top_logits_TK, dim=-1, dtype=top_logits_TK.dtype), topk_idx_TK


#: router kind (`lightning_ft.model.patching.MoEClasses.router_kind`) -> its routing math
ROUTER_KINDS = {"softmax_topk": topk_routing, "sigmoid_grouped": grouped_topk_routing, "topk_softmax": topk_softmax_routing}


class ExpertRouting(NamedTuple):
    """The expert-sorted order of one layer's (token, expert) pairs; built by `sort_by_expert`.

    Attributes:
        token_idx_S: [S] int64, the token each sorted pair reads (``pair_idx_S // top_k``).
        pair_idx_S: [S] int64, the flat pair index ``t*K + k`` of each sorted pair.
        inv_pair_S: [S] int64, inverse permutation: sorted position of flat pair ``t*K + k``.
        tokens_per_expert_E: [E] int32, pairs routed to each expert (zero allowed).
        offsets_E: [E] int32, cumulative ends of each expert's rows (``offs`` of grouped_mm).
        num_tokens: T.
        top_k: K.
    """

    token_idx_S: torch.Tensor
    pair_idx_S: torch.Tensor
    inv_pair_S: torch.Tensor
    tokens_per_expert_E: torch.Tensor
    offsets_E: torch.Tensor
    num_tokens: int
    top_k: int


@torch.no_grad()
def sort_by_expert(topk_idx_TK: torch.Tensor, num_experts: int) -> ExpertRouting:
    """Group the T*K (token, expert) pairs by expert with a stable sort; no host sync.

    Args:
        topk_idx_TK: [T, K] integer expert ids in ``[0, num_experts)``.
        num_experts: E.

    Returns:
        `ExpertRouting` on the same device as ``topk_idx_TK``.

    Raises:
        ValueError: if ``topk_idx_TK`` is not 2-D or not an integer tensor.
    """
    if topk_idx_TK.dim() != 2 or topk_idx_TK.is_floating_point():
        raise ValueError(
            f"topk_idx_TK must be a 2-D integer tensor, got {topk_idx_TK.dtype} {tuple(topk_idx_TK.shape)}"
        )
    num_tokens, top_k = topk_idx_TK.shape
    device = topk_idx_TK.device
    # the narrowest key type that holds every id: the radix sort makes one pass per key byte (uint8:
    # 1 pass where int64 needs 8); same order, stable
    key_dtype = torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 2**15 else torch.int64
    expert_of_pair = topk_idx_TK.reshape(-1).to(key_dtype)
    sorted_expert_S, pair_idx_S = torch.sort(expert_of_pair, stable=True)
    experts_E = torch.arange(num_experts, device=device, dtype=sorted_expert_S.dtype)
    offsets_E = torch.searchsorted(sorted_expert_S, experts_E, right=True, out_int32=True)
    tokens_per_expert_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    arange_S = torch.arange(pair_idx_S.numel(), device=device)
    inv_pair_S = torch.empty_like(pair_idx_S).scatter_(0, pair_idx_S, arange_S)
    return ExpertRouting(
        token_idx_S=pair_idx_S // top_k,
        pair_idx_S=pair_idx_S,
        inv_pair_S=inv_pair_S,
        tokens_per_expert_E=tokens_per_expert_E,
        offsets_E=offsets_E,
        num_tokens=num_tokens,
        top_k=top_k,
    )


def expert_of_rows(offsets_E: torch.Tensor, num_rows: int) -> torch.Tensor:
    """[S] int64: the expert owning each expert-sorted row, from the cumulative row ends ``offsets_E``
    (`ExpertRouting.offsets_E`); one ``searchsorted`` on the device, no host sync. For per-expert
    biases (gpt-oss) added to, or summed from, sorted rows."""
    rows_S = torch.arange(num_rows, device=offsets_E.device, dtype=offsets_E.dtype)
    return torch.searchsorted(offsets_E, rows_S, right=True)


@triton.jit
def _sum_pairs_kernel(Y, INV, OUT, n_cols, stride_y, stride_out, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, cols] = sum over k of Y[INV[t*K + k], cols], in fp32, k in order."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        row = tl.load(INV + token * TOP_K + k).to(tl.int64)
        acc += tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + token * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def sum_pairs(y_SD: torch.Tensor, inv_pair_S: torch.Tensor, top_k: int) -> torch.Tensor:
    """[S, D] expert-sorted rows -> [T, D]: row t is the sum of its K pairs' rows, fp32 accumulation.

    One fused gather + sum where Triton runs: it reads the S rows once and writes the T rows. The
    plain-torch way (the CPU fallback), ``index_select`` then ``sum`` over K, also writes and re-reads
    the gathered [S, D] copy (S = 65536, D = 2048 for Qwen3-30B-A3B at 8K tokens), once per layer
    forward (and recompute) and once in backward.
    """
    if not triton_can_run(y_SD) or y_SD.dtype == torch.float64:  # the kernel adds in fp32
        return y_SD.index_select(0, inv_pair_S).view(-1, top_k, y_SD.shape[-1]).sum(dim=1)
    y_SD = y_SD if y_SD.stride(-1) == 1 else y_SD.contiguous()
    num_tokens, n_cols = inv_pair_S.numel() // top_k, y_SD.shape[-1]
    out_TD = y_SD.new_empty(num_tokens, n_cols)
    if out_TD.numel():
        block = min(2048, triton.next_power_of_2(n_cols))
        _sum_pairs_kernel[(num_tokens, triton.cdiv(n_cols, block))](
            y_SD, inv_pair_S, out_TD, n_cols, y_SD.stride(0), out_TD.stride(0),
            TOP_K=top_k, BLOCK=block, num_warps=num_warps_for(block),
        )  # fmt: skip
    return out_TD


def unread_output(like: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] output of an expert block whose value nobody reads (``output_needed=False``):
    zeros in ``like``'s dtype and device, one element expanded (no [rows, cols] fill kernel per
    layer). Read-only: in-place ops on it raise."""
    return like.new_zeros(()).expand(rows, cols)


class _PermuteTokens(torch.autograd.Function):
    """x_SD = x_TD[token_idx_S]; the backward sums each token's K rows without atomics."""

    @staticmethod
    def forward(ctx, x_TD, token_idx_S, inv_pair_S, top_k, pad):
        ctx.save_for_backward(inv_pair_S)
        ctx.top_k = top_k
        out_SD = row_padded(token_idx_S.numel(), x_TD.shape[1], pad, x_TD)
        return torch.index_select(x_TD, 0, token_idx_S, out=out_SD)

    @staticmethod
    def backward(ctx, grad_SD):
        (inv_pair_S,) = ctx.saved_tensors
        return sum_pairs(grad_SD, inv_pair_S, ctx.top_k), None, None, None, None


class _UnpermuteTokens(torch.autograd.Function):
    """out_TD[t] = sum_k y_SD[sorted position of (t, k)]; the backward is a gather, no atomics."""

    @staticmethod
    def forward(ctx, y_SD, token_idx_S, inv_pair_S, top_k, output_needed, grad_pad):
        ctx.save_for_backward(token_idx_S)
        ctx.grad_pad = grad_pad
        if not output_needed:
            return unread_output(y_SD, inv_pair_S.numel() // top_k, y_SD.shape[-1])
        return sum_pairs(y_SD, inv_pair_S, top_k)

    @staticmethod
    def backward(ctx, grad_TD):
        (token_idx_S,) = ctx.saved_tensors
        grad_SD = row_padded(token_idx_S.numel(), grad_TD.shape[1], ctx.grad_pad, grad_TD)
        return torch.index_select(grad_TD, 0, token_idx_S, out=grad_SD), None, None, None, None, None


def permute_tokens(x_TD: torch.Tensor, routing: ExpertRouting, *, pad: int = 0) -> torch.Tensor:
    """Gather token rows into expert-sorted pair order: [T, D] -> [S, D], differentiable.

    The backward adds each token's K pair gradients with one fused gather + sum (fp32 accumulation,
    fp64 for fp64 tensors), so it is deterministic and needs no atomics or host sync. ``pad``: the
    result is a view of [S, D + pad] rows (`row_padded`).
    """
    return _PermuteTokens.apply(x_TD, routing.token_idx_S, routing.inv_pair_S, routing.top_k, pad)


def unpermute_tokens(
    y_SD: torch.Tensor, routing: ExpertRouting, *, output_needed: bool = True, grad_pad: int = 0
) -> torch.Tensor:
    """Sum each token's K expert outputs: [S, D] (expert-sorted) -> [T, D], differentiable.

    The K rows of a token are summed in (t, k) order with fp32 accumulation (fp64 for fp64 tensors;
    as transformers' grouped_mm experts path does), so the result is deterministic. With
    ``output_needed=False`` y_SD is not read and the result is zeros (its gradient is the same
    gather): for a recompute that only differentiates through the output. ``grad_pad``: y_SD's
    gradient is a view of [S, D + grad_pad] rows (`row_padded`).
    """
    return _UnpermuteTokens.apply(
        y_SD, routing.token_idx_S, routing.inv_pair_S, routing.top_k, output_needed, grad_pad
    )
