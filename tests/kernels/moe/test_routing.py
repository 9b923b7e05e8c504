"""Routing: top-k weights against transformers' router, the expert-sorted order, permute/unpermute."""

import pytest
import torch

from lightning_ft.kernels._utils import triton_can_run
from lightning_ft.kernels.moe import routing as routing_module
from lightning_ft.kernels.moe.routing import (
    ROUTER_KINDS,
    expert_of_rows,
    grouped_topk_routing,
    permute_tokens,
    sort_by_expert,
    topk,
    topk_routing,
    topk_softmax_routing,
    unpermute_tokens,
)
from lightning_ft.model.patching import PATCH_TABLES

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _distinct_topk(num_tokens: int, top_k: int, num_experts: int, empty: tuple[int, ...] = ()) -> torch.Tensor:
    """[T, K] expert ids, distinct within each row (as top-k gives), never choosing ``empty``."""
    scores = torch.rand(num_tokens, num_experts, generator=torch.Generator().manual_seed(0))
    scores[:, list(empty)] = -1.0
    return scores.argsort(dim=-1, descending=True)[:, :top_k]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "num_experts,top_k,norm_topk_prob", [(8, 2, True), (6, 1, False), (6, 3, False), (5, 5, True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_routing_matches_transformers_router(device, num_experts, top_k, norm_topk_prob, dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=24, num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob
    )
    torch.manual_seed(0)
    router = Qwen3MoeTopKRouter(config).to(device, dtype)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(19, 24, device=device, dtype=dtype)
    logits, hf_weight, hf_idx = router(x)
    weight, idx = topk_routing(torch.nn.functional.linear(x, router.weight), top_k, norm_topk_prob)
    assert weight.dtype == hf_weight.dtype and idx.dtype == torch.int64
    torch.testing.assert_close(weight, hf_weight, rtol=0, atol=0)
    # the same experts' probabilities in each position; equal probabilities (bf16 logits tie) may
    # list their experts in another order (`topk`), and torch's CPU top-k breaks a tie at the K-th
    # value by another rule than its GPU one (the lowest experts, as `topk`)
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, idx), probs.gather(1, hf_idx))
    distinct = torch.tensor([len(set(row.tolist())) == num_experts for row in probs.cpu()])
    assert torch.equal(idx[distinct.to(device)], hf_idx[distinct.to(device)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens,num_experts,k", [(37, 128, 8), (5, 60, 1), (9, 5, 5), (300, 128, 8), (0, 16, 2), (70, 33, 32)])
def test_topk_selects_as_torch_topk(device, num_tokens, num_experts, k):
    """Values descending, equal values in column order: a stable descending sort's first k, exactly
    (ties are frequent: bf16-rounded probabilities); on the GPU the same values and the same set of
    columns per row as torch.topk (whose selection takes the lowest columns equal to the k-th
    value there). The gradient is torch.topk's: the values' gradient scattered into zeros."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(num_tokens, num_experts)).bfloat16().float()
    x = torch.softmax(logits, dim=-1).bfloat16().float().to(device).requires_grad_()
    values, indices = topk(x, k)
    sorted_values, order = torch.sort(x.detach(), dim=-1, descending=True, stable=True)
    assert torch.equal(values, sorted_values[:, :k])
    if triton_can_run(x):  # else torch.topk itself
        assert torch.equal(indices, order[:, :k])
    if device == "cuda":
        ref_values, ref_indices = torch.topk(x.detach(), k, dim=-1)
        assert torch.equal(values, ref_values)
        assert torch.equal(indices.sort(dim=-1).values, ref_indices.sort(dim=-1).values)
    grad = torch.randn(num_tokens, k, device=device)
    values.backward(grad)
    assert torch.equal(x.grad, torch.zeros_like(x).scatter_(1, indices, grad))


@pytest.mark.parametrize("device", DEVICES)
def test_topk_ranks_nan_first_and_falls_back(device):
    x = torch.tensor([[0.1, float("nan"), 0.3, 0.3], [0.5, 0.2, 0.2, 0.1]], device=device)
    values, indices = topk(x, 2)
    assert values[0, 0].isnan() and values[0, 1] == 0.3 and indices[0, 0] == 1 and indices[1, 0] == 0
    if triton_can_run(x):
        assert indices.tolist() == [[1, 2], [0, 1]]
    wide = torch.rand(3, 2000, device=device)  # wider than the kernel's rows: torch.topk itself
    assert torch.equal(topk(wide, 4)[0], torch.topk(wide, 4, dim=-1)[0])


MOE_TABLES = sorted(name for name, table in PATCH_TABLES.items() if table.moe is not None)
# 8 experts, top-3; the grouped routers: 4 groups of 2, the best 2 groups, routed_scaling_factor 2.5
ROUTER_CONFIGS = {
    "qwen3_moe": dict(num_experts=8, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=8),  # always renormalises
    "gpt_oss": dict(num_local_experts=8),  # top-k of the logits, softmax over the k (its router's bias: zeros here)
    "glm4_moe": dict(n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
    "deepseek_v3": dict(n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
    "glm4_moe_lite": dict(n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
}
GROUP_ROWS = [  # sigmoid scores, groups {0,1} {2,3} {4,5} {6,7}
    [4.0, -4.0, 1.0, 1.0, 0.5, 0.5, -4.0, -4.0],  # the best expert's group loses on its two-best sum; 4/5 tie for 3rd
    [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0],  # three groups tie for the best two
    [0.0, 2.0, 2.0, 0.0, -1.0, 3.0, 3.0, -1.0],  # a tie across two groups
    [0.0] * 8,  # everything ties
]


def _router_case(case: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, 8], e_score_correction_bias [8]): random; quantised (ties within and across groups,
    at the top-k boundary too); or `GROUP_ROWS` (zero bias)."""
    if case == "random":
        return torch.randn(40, 8, generator=gen), torch.randn(8, generator=gen) * 0.1
    if case == "ties":
        logits = torch.randint(-2, 3, (200, 8), generator=gen).float() * 0.5
        return logits, torch.randint(0, 2, (8,), generator=gen).float() * 0.5
    return torch.tensor(GROUP_ROWS), torch.zeros(8)


def _routing_like(router, kind: str, logits: torch.Tensor):
    """Our routing of ``kind`` with the settings of transformers' ``router`` module."""
    if kind == "softmax_topk":
        return ROUTER_KINDS[kind](logits, router.top_k, getattr(router, "norm_topk_prob", True))
    if kind == "topk_softmax":
        return ROUTER_KINDS[kind](logits, router.top_k)
    return ROUTER_KINDS[kind](
        logits, router.top_k, router.e_score_correction_bias, router.num_group, router.topk_group,
        router.norm_topk_prob, router.routed_scaling_factor,
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["random", "ties", "groups"])
@pytest.mark.parametrize("model_type", MOE_TABLES)
def test_router_kind_selects_and_weighs_as_the_transformers_router(model_type, case, device, monkeypatch):
    """Each MoE table's ``router_kind`` (`ROUTER_KINDS`) against that architecture's own router module
    on logits it is fed exactly (identity router weight): the same experts (as sets: transformers'
    grouped routers return them unsorted) and the same weight per expert, ties and groups included.
    On the CPU our top-k is torch.topk, as without ``TRITON_INTERPRET`` (the kernel's choice among
    equal values is torch's CUDA one: `test_topk_selects_as_torch_topk` on the GPU)."""
    import importlib

    from transformers import AutoConfig

    if device == "cpu":
        monkeypatch.setattr(routing_module, "triton_can_run", lambda *tensors: False)
    moe = PATCH_TABLES[model_type].moe
    config = AutoConfig.for_model(model_type, hidden_size=8, num_experts_per_tok=3, **ROUTER_CONFIGS[model_type])
    router = getattr(importlib.import_module(PATCH_TABLES[model_type].modeling_module), moe.router)(config).to(device)
    logits, bias = (t.to(device) for t in _router_case(case, torch.Generator().manual_seed(0)))
    with torch.no_grad():
        router.weight.copy_(torch.eye(8))
        if moe.router_kind == "sigmoid_grouped":
            router.e_score_correction_bias.copy_(bias)
        hf_logits, hf_weight, hf_idx = router(logits)
        assert torch.equal(hf_logits, logits)
        weight, idx = _routing_like(router, moe.router_kind, logits)
    assert idx.dtype == torch.int64 and weight.dtype == torch.float32
    hf_order, order = hf_idx.sort(dim=-1), idx.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(weight.gather(1, order.indices), hf_weight.gather(1, hf_order.indices), rtol=1e-6, atol=0)
    if case == "groups" and moe.router_kind == "sigmoid_grouped":  # the group stage decided: expert 0 lost
        assert 0 not in idx[0].tolist() and {2, 3} <= set(idx[0].tolist())


def test_grouped_topk_routing_rejects_bad_arguments():
    logits, bias = torch.randn(3, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="n_group=3 must divide num_experts=8"):
        grouped_topk_routing(logits, 2, bias, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="topk_group=3"):
        grouped_topk_routing(logits, 2, bias, 2, 3, True, 1.0)
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, topk_group \* num_experts / n_group = 4\]"):
        grouped_topk_routing(logits, 5, bias, 4, 2, True, 1.0)
    with pytest.raises(ValueError, match=r"bias_E must be \[E=8\]"):
        grouped_topk_routing(logits, 2, torch.zeros(4), 1, 1, True, 1.0)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        grouped_topk_routing(torch.randn(8), 2, bias, 1, 1, True, 1.0)


def test_topk_routing_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        topk_routing(torch.randn(3, 4), 5, True)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        topk_routing(torch.randn(3), 1, True)
    with pytest.raises(ValueError, match=r"top_k=5 must be in \[1, num_experts=4\]"):
        topk_softmax_routing(torch.randn(3, 4), 5)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        topk_softmax_routing(torch.randn(3), 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(17, 2, 6), (9, 1, 8), (40, 4, 7), (0, 2, 4), (300, 2, 256), (200, 3, 300)])  # uint8 and int16 sort keys
def test_sort_by_expert_groups_pairs(device, num_tokens, top_k, num_experts):
    topk_idx = _distinct_topk(num_tokens, top_k, num_experts, empty=(1,)).to(device)
    routing = sort_by_expert(topk_idx, num_experts)
    flat = topk_idx.reshape(-1)
    num_pairs = flat.numel()

    assert routing.offsets_E.dtype == torch.int32 and routing.tokens_per_expert_E.dtype == torch.int32
    expected_counts = torch.bincount(flat, minlength=num_experts)
    assert routing.tokens_per_expert_E.tolist() == expected_counts.tolist()
    assert routing.tokens_per_expert_E[1] == 0
    assert routing.offsets_E.tolist() == torch.cumsum(expected_counts, 0).tolist()
    assert sorted(routing.pair_idx_S.tolist()) == list(range(num_pairs))
    experts_sorted = flat[routing.pair_idx_S]
    assert torch.all(experts_sorted[1:] >= experts_sorted[:-1])
    same_expert = experts_sorted[1:] == experts_sorted[:-1]
    assert torch.all(routing.pair_idx_S[1:][same_expert] > routing.pair_idx_S[:-1][same_expert])  # stable
    assert torch.equal(routing.token_idx_S, routing.pair_idx_S // top_k)
    assert torch.equal(routing.inv_pair_S[routing.pair_idx_S], torch.arange(num_pairs, device=device))
    assert (routing.num_tokens, routing.top_k) == (num_tokens, top_k)


@pytest.mark.parametrize("device", DEVICES)
def test_expert_of_rows_names_each_sorted_row_s_expert(device):
    """Empty experts (first, middle, last) included: the expert ids of the sorted pairs."""
    topk_idx = torch.tensor([[3, 1], [1, 4], [4, 3], [1, 3]], device=device)  # experts 0, 2 and 5 empty
    routing = sort_by_expert(topk_idx, 6)
    got = expert_of_rows(routing.offsets_E, routing.token_idx_S.numel())
    assert got.dtype == torch.int64 and torch.equal(got, topk_idx.flatten()[routing.pair_idx_S])


def test_sort_by_expert_rejects_float_ids():
    with pytest.raises(ValueError, match="integer"):
        sort_by_expert(torch.zeros(3, 2), 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [7, 2050])  # 2050: two column blocks of the fused gather-sum
def test_permute_unpermute_match_indexing(device, dtype, hidden):
    num_tokens, top_k, num_experts = 13, 3, 5
    routing = sort_by_expert(_distinct_topk(num_tokens, top_k, num_experts).to(device), num_experts)
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()

    x_sorted = permute_tokens(x, routing)
    expected = x_ref[routing.token_idx_S]
    torch.testing.assert_close(x_sorted, expected, rtol=0, atol=0)
    y = torch.randn_like(x_sorted)
    out = unpermute_tokens(x_sorted * y, routing)
    out_ref = torch.zeros_like(x_ref, dtype=torch.float32).index_add_(
        0, routing.token_idx_S, (expected * y).float()
    )
    torch.testing.assert_close(out.float(), out_ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2)

    grad = torch.randn_like(out)
    out.backward(grad)
    out_ref.to(dtype).backward(grad)
    torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_routing_has_no_host_sync():
    device = "cuda"
    logits = torch.randn(4096, 128, device=device)
    x = torch.randn(4096, 64, device=device, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        weight, idx = topk_routing(logits, 8, True)
        grouped_weight, grouped_idx = grouped_topk_routing(logits, 8, torch.zeros(128, device=device), 8, 4, True, 2.5)
        routing = sort_by_expert(idx, 128)
        weight_S = weight.reshape(-1).index_select(0, routing.pair_idx_S)
        out = unpermute_tokens(permute_tokens(x, routing) * weight_S[:, None], routing)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
