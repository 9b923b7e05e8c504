"""Packed attention: same loss as running each document alone; metadata built once per batch.

The backends that run on the CPU (sdpa: forward and backward; flex: forward, torch's unfused
reference) are checked here; varlen and the compiled flex kernel in tests/model/test_attention_gpu.py.
"""

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F

from lightning_ft.data.packing import collate_packed
from lightning_ft.model import attention, attention_plan
from lightning_ft.model.attention_kernels import AttentionKernel, check_varlen_size, cudnn_head_dim_limit
from lightning_ft.strategies import kept
from lightning_ft.model.build import load_causal_lm

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

TINY = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=48, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=5, num_experts_per_tok=2,
        norm_topk_prob=True, vocab_size=97,
    ),
    "llama": dict(
        model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97,
    ),
    "mixtral": dict(
        model_type="mixtral", hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=97,
    ),
    "glm4_moe": dict(
        model_type="glm4_moe", hidden_size=48, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, attention_bias=True, vocab_size=97,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", hidden_size=48, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, vocab_size=97,
    ),
    "glm4_moe_lite": dict(  # MLA with a q low-rank projection; value heads (12) narrower than q/k's (8 + 8)
        model_type="glm4_moe_lite", hidden_size=48, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        mlp_layer_types=["dense", "sparse"], vocab_size=97,
    ),
}
MOE_KINDS = ["qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "glm4_moe_lite"]
CPU_BACKENDS = ["sdpa", "flex"]
BUILDERS = {"sdpa": "block_causal_mask", "flex": "build_block_mask"}
ATTEND = {"sdpa": attention.sdpa_attention, "flex": attention.flex_attention}


def _model(kind, backend="sdpa"):
    torch.manual_seed(0)
    name = attention.register_packed_attention(backend)
    return load_causal_lm(None, "random", dict(TINY[kind]), attn_implementation=name).eval()


def _docs(lengths, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        labels = [-100 if i < n // 3 else t for i, t in enumerate(ids)]  # a masked "prompt"
        docs.append((ids, labels))
    return docs


def _loss_sum(model, batch):
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch).logits.float()
    return F.cross_entropy(logits[0, :-1], batch.labels[0, 1:], ignore_index=-100, reduction="sum")


def _cu_seqlens(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


# one-token documents among others, a single document of exactly T tokens, tile edges of the flex BlockMask
LENGTHS = {
    "mixed": [1, 37, 1, 150, 1, 129, 64, 1],
    "one_document": [256],
    "tile_edges": [128, 127, 1, 128],
}


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("sliding_window", [None, 40])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("value_dim", [16, 12], ids=["v16", "v12"])  # 12: MLA's narrower value heads
def test_backend_equals_per_document_sdpa_fp32(backend, lengths, sliding_window, value_dim):
    batch = collate_packed(_docs(lengths))
    g = torch.Generator().manual_seed(1)
    T, D = sum(lengths), 16
    q, k, v = (torch.randn(1, h, T, d, generator=g) for h, d in ((4, D), (2, D), (2, value_dim)))
    grads = backend == "sdpa"  # torch has no FlexAttention backward on the CPU
    for t in (q, k, v):
        t.requires_grad_(grads)
    out = ATTEND[backend](q, k, v, batch, 0.3, sliding_window)
    ref = attention.packed_attention_reference(q, k, v, batch.cu_seqlens, 0.3, sliding_window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if grads:
        dout = torch.randn(ref.shape, generator=g)
        got = torch.autograd.grad(out, (q, k, v), dout)
        expected = torch.autograd.grad(ref, (q, k, v), dout)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


MIXED = [1, 37, 1, 150, 1, 129, 64, 1]


@pytest.mark.parametrize(
    "device, lengths, dtype, value_dim",
    [
        ("cpu", MIXED, torch.float32, 64),
        ("cpu", [211], torch.float32, 64),
        ("cpu", [211], torch.bfloat16, 64),
        ("cpu", MIXED, torch.float32, 48),  # MLA's narrower value heads: v zero-padded for the flash kernel
        pytest.param("cuda", MIXED, torch.bfloat16, 64, marks=pytest.mark.gpu),  # flash-attention varlen
        pytest.param("cuda", [1001], torch.bfloat16, 64, marks=pytest.mark.gpu),  # one document: cuDNN on Hopper
        pytest.param("cuda", MIXED, torch.bfloat16, 48, marks=pytest.mark.gpu),
        pytest.param("cuda", [1001], torch.bfloat16, 48, marks=pytest.mark.gpu),
    ],
    ids=["cpu-mixed-fp32", "cpu-one-fp32", "cpu-one-bf16", "cpu-mixed-fp32-v48", "cuda-mixed-bf16", "cuda-one-bf16",
         "cuda-mixed-bf16-v48", "cuda-one-bf16-v48"],
)
def test_kept_attention_reuses_the_forward_output_and_gives_the_same_gradients(device, lengths, dtype, value_dim):
    """What the CUDA graphs do with kept ``attention`` (`lightning_ft.strategies.kept`): a forward (no grad) keeps attention's output and
    log-sum-exp; the recompute returns that output and differentiates through the kernel's backward
    op. Against the backend run plainly with autograd: the same output, gradients equal on the CPU
    (the same kernel) and within bf16 rounding on CUDA (flash's dq is accumulated with atomics)."""
    cuda = device == "cuda"
    backend = attention.varlen_attention if cuda else attention.sdpa_attention
    batch = collate_packed(_docs(lengths))
    g = torch.Generator().manual_seed(2)
    T, D = sum(lengths), 64
    # transformers' layout: [1, T, H, D] in memory, passed as [1, H, T, D] views; GQA 4:2
    q, k, v = (torch.randn(1, T, h, d, generator=g).to(device, dtype).transpose(1, 2) for h, d in ((4, D), (2, D), (2, value_dim)))
    dout = torch.randn(1, T, 4, value_dim, generator=g).to(device, dtype)
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    want = backend(*inputs, batch, 0.125, None)
    want_grads = torch.autograd.grad(want, inputs, dout)

    keep = kept.KeptActivations("attention", allow=lambda nbytes: nbytes > 0)
    with torch.no_grad(), kept.keeping(keep, recompute=False):
        forward_out = backend(q, k, v, batch, 0.125, None)
    assert keep.enabled and len(keep.kept) == 1 and keep.nbytes >= T * 4 * D * q.element_size()
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    with kept.keeping(keep, recompute=True):
        got = backend(*inputs, batch, 0.125, None)
    if value_dim == D:  # the kept output, not a recomputed one (sliced from padded v: copied, compared by value below)
        assert got.data_ptr() == keep.kept[0][0].data_ptr()
    got_grads = torch.autograd.grad(got, inputs, dout)
    torch.testing.assert_close(got, forward_out, rtol=0, atol=0)
    tolerance = dict(rtol=2e-2, atol=2e-2) if cuda else dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tolerance)
    for name, a, b in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(a, b, **tolerance, msg=lambda m: f"d{name}: {m}")

    refused = kept.KeptActivations("attention", allow=lambda nbytes: False)  # over budget: the plain backend both times
    with torch.no_grad(), kept.keeping(refused, recompute=False):
        backend(q, k, v, batch, 0.125, None)
    assert refused.enabled is False and refused.kept == [None]


def test_kept_attention_casts_under_autocast_and_refuses_a_recompute_that_differs():
    batch = collate_packed(_docs([5, 20]))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 25, 16, generator=g) for h in (4, 2, 2))
    keep = kept.KeptActivations("attention", allow=lambda nbytes: True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = attention.sdpa_attention(q, k, v, batch, 0.25, None)
        with torch.no_grad(), kept.keeping(keep, recompute=False):
            attention.sdpa_attention(q, k, v, batch, 0.25, None)
            got = attention.sdpa_attention(q, k, v, batch, 0.25, None)  # a second call: kept too
    assert got.dtype == want.dtype == torch.bfloat16 and len(keep.kept) == 2
    torch.testing.assert_close(got, want)
    with pytest.raises(RuntimeError, match="1 attention calls, the layer's first forward made 2"):
        with kept.keeping(keep, recompute=True):
            attention.sdpa_attention(q, k, v, batch, 0.25, None)


def _cpu_flash(q, k, v, mask, scale, is_causal):
    """[T, H, D] q and k/v of fewer heads through the CPU's flash op (k/v repeated, their gradients summed back)."""
    groups = q.shape[1] // k.shape[1]
    q4, k4, v4 = (t.repeat_interleave(r, 1).transpose(0, 1)[None] for t, r in ((q, 1), (k, groups), (v, groups)))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, is_causal, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1), (lse, mask, is_causal, groups)


def _cpu_flash_backward(grad_out, q, k, v, out, aux, scale):
    lse, mask, is_causal, groups = aux
    q4, k4, v4, out4, g4 = (
        t.repeat_interleave(r, 1).transpose(0, 1)[None].contiguous()
        for t, r in ((q, 1), (k, groups), (v, groups), (out, 1), (grad_out, 1))
    )
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g4, q4, k4, v4, out4, lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    fold = lambda t: t[0].transpose(0, 1).unflatten(1, (-1, groups)).sum(2)  # noqa: E731
    return dq[0].transpose(0, 1), fold(dk), fold(dv)


CALLS = []


def cudnn_standin(scale):
    """`cudnn_causal_kernel`'s contract (one causal document, [T, H, D], GQA) on the CPU's flash op."""
    CALLS.append("cudnn")
    return AttentionKernel(
        lambda q, k, v: _cpu_flash(q, k, v, None, scale, True),
        lambda g, q, k, v, out, aux: _cpu_flash_backward(g, q, k, v, out, aux, scale),
    )


def varlen_standin(cu_seqlens, max_seqlen, scale, sliding_window):
    """`flash_varlen_kernel`'s contract (documents of a run, offsets from 0 to T, window) on the CPU's flash op."""
    CALLS.append("varlen")
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens[0] == 0
    assert max_seqlen == int(cu_seqlens.diff().max())

    def mask_for(q):
        keep = attention.block_causal_mask(cu_seqlens, q.device, sliding_window)
        assert keep.shape[-1] == q.shape[0]
        return torch.zeros(keep.shape, dtype=q.dtype).masked_fill_(~keep, float("-inf"))

    return AttentionKernel(
        lambda q, k, v: _cpu_flash(q, k, v, mask_for(q), scale, False),
        lambda g, q, k, v, out, aux: _cpu_flash_backward(g, q, k, v, out, aux, scale),
    )


@pytest.fixture
def standin_kernels(monkeypatch):
    """The CUDA kernels of auto/cudnn/varlen replaced by stand-ins with their contracts, cuDNN 'runnable'."""
    monkeypatch.setattr(attention_plan, "cudnn_causal_kernel", cudnn_standin)
    monkeypatch.setattr(attention_plan, "flash_varlen_kernel", varlen_standin)
    monkeypatch.setattr(attention, "cudnn_runs", lambda q: True)
    monkeypatch.setattr(attention_plan, "_CROSSOVERS", {})
    CALLS.clear()


def test_plan_cuts_a_row_into_long_documents_and_runs_of_short_ones():
    # empty and one-token documents, a long one first, in the middle, last, and exactly at the bound
    lengths = [50, 0, 1, 3, 40, 2, 0, 60, 39, 1]
    segments, offsets = attention_plan.plan_segments(_cu_seqlens(lengths), min_cudnn_tokens=40)
    got = [(s.kind, s.start, s.end, offsets[s.first : s.last].tolist() if s.kind == "varlen" else None, s.max_seqlen)
           for s in segments]
    assert got == [
        ("cudnn", 0, 50, None, 0),
        ("varlen", 50, 54, [0, 0, 1, 4], 3),
        ("cudnn", 54, 94, None, 0),
        ("varlen", 94, 96, [0, 2, 2], 2),
        ("cudnn", 96, 156, None, 0),
        ("varlen", 156, 196, [0, 39, 40], 39),
    ]
    # every document but the empty ones and those of one token (which cuDNN refuses) alone
    all_cudnn, _ = attention_plan.plan_segments(_cu_seqlens(lengths), 1)
    assert [(s.kind, s.end - s.start) for s in all_cudnn] == [
        ("cudnn", 50), ("varlen", 1), ("cudnn", 3), ("cudnn", 40), ("cudnn", 2), ("cudnn", 60), ("cudnn", 39), ("varlen", 1)
    ]
    whole, _ = attention_plan.plan_segments(_cu_seqlens(lengths), attention_plan.NEVER)
    assert [(s.kind, s.start, s.end) for s in whole] == [("varlen", 0, 196)]


def _batch_with(lengths):
    """A packed batch whose documents may be empty (as CUDA graphs' buckets pad ``cu_seqlens``)."""
    batch = collate_packed(_docs([n for n in lengths if n]))
    return dataclasses.replace(batch, cu_seqlens=_cu_seqlens(lengths), max_seqlen=max(lengths), _cache={})


def _qkv(T, heads, kv_heads, D, dtype, seed, value_dim=None):
    g = torch.Generator().manual_seed(seed)
    # transformers' layout: [1, T, H, D] in memory, passed as [1, H, T, D] views
    return [torch.randn(1, T, h, d, generator=g).to(dtype).transpose(1, 2).requires_grad_()
            for h, d in ((heads, D), (kv_heads, D), (kv_heads, value_dim or D))]


PLAN_LAYOUTS = {
    "mixed": [50, 0, 1, 3, 40, 2, 0, 60, 39, 1],
    "one_long": [97],
    "one_longer_than_the_rest": [3, 120, 1, 2],
    "all_short": [5, 1, 7],
}


@pytest.mark.parametrize("lengths", PLAN_LAYOUTS.values(), ids=PLAN_LAYOUTS.keys())
@pytest.mark.parametrize("policy, crossover", [("auto", 40), ("cudnn", None), ("varlen", None)])
@pytest.mark.parametrize("heads", [(3, 1), (4, 2)], ids=["odd_heads", "gqa"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_segments_equal_each_document_alone(standin_kernels, monkeypatch, lengths, policy, crossover, heads, sinks):
    """auto/cudnn/varlen through `varlen_attention` with stand-in kernels: packed equals unpacked,
    forward and backward (the sinks' gradient too), whichever kernel each document took."""
    if crossover is not None:
        monkeypatch.setattr(attention, "crossover", lambda q, k, v: crossover)
    batch = _batch_with(lengths)
    q, k, v = _qkv(sum(lengths), *heads, 16, torch.bfloat16, seed=4, value_dim=12)
    sink = torch.randn(heads[0]).mul(2).requires_grad_() if sinks else None
    out = attention.varlen_attention(q, k, v, batch, 0.3, None, policy, sink)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    sink_f = sink.detach().clone().requires_grad_() if sinks else None
    ref = attention.packed_attention_reference(qf, kf, vf, batch.cu_seqlens, 0.3, None, sink_f)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    inputs, ref_inputs = [q, k, v, *([sink] if sinks else [])], [qf, kf, vf, *([sink_f] if sinks else [])]
    for name, a, b in zip("qkvs", torch.autograd.grad(out, inputs, dout.bfloat16()), torch.autograd.grad(ref, ref_inputs, dout)):
        torch.testing.assert_close(a.float(), b, rtol=3e-2, atol=3e-2, msg=lambda m: f"d{name}: {m}")
    long_docs = sum(n >= max(crossover or 1, 2) for n in lengths) if policy != "varlen" else 0
    assert CALLS.count("cudnn") == long_docs
    runs = len([s for s in attention_plan.plan_segments(batch.cu_seqlens, crossover or 1)[0] if s.kind == "varlen"])
    assert CALLS.count("varlen") == (1 if policy == "varlen" else runs)


def test_segments_keep_attention_and_windowed_layers_take_flash_attention(standin_kernels, monkeypatch):
    """Kept attention over a plan of several kernels returns the forward's output and the same
    gradients; a layer with a sliding window runs flash-attention 2 for every document."""
    monkeypatch.setattr(attention, "crossover", lambda q, k, v: 40)
    lengths = PLAN_LAYOUTS["mixed"]
    batch = _batch_with(lengths)
    q, k, v = _qkv(sum(lengths), 4, 2, 16, torch.float32, seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = attention.varlen_attention(q, k, v, batch, 0.25, None, "auto")
        want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
        keep = kept.KeptActivations("attention", allow=lambda nbytes: True)
        with torch.no_grad(), kept.keeping(keep, recompute=False):
            attention.varlen_attention(q, k, v, batch, 0.25, None, "auto")
        with kept.keeping(keep, recompute=True):
            got = attention.varlen_attention(q, k, v, batch, 0.25, None, "auto")
        got_grads = torch.autograd.grad(got.float().square().sum(), (q, k, v))
    assert got.data_ptr() == keep.kept[0][0].data_ptr() and keep.kept[0][1] == (4,) * 6  # aux lengths of the 6 segments
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    CALLS.clear()
    qb, kb, vb = (t.detach().bfloat16() for t in (q, k, v))
    out = attention.varlen_attention(qb, kb, vb, batch, 0.25, 30, "auto")
    assert CALLS == ["varlen"]
    ref = attention.packed_attention_reference(qb.float(), kb.float(), vb.float(), batch.cu_seqlens, 0.25, 30)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="needs bfloat16 or float16"):
        attention.varlen_attention(q, k, v, batch, None, None, "auto")


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_sinks_and_softcap_on_sdpa_and_flex_equal_the_eager_reference(softcap, sinks):
    """sdpa (CPU flash kernel with the sink correction, or the written-out attention with soft-capping)
    forward and backward, flex forward (no FlexAttention backward on the CPU), against
    transformers-style eager attention per document; the window too."""
    lengths, window = [1, 37, 1, 50, 3], 20
    batch = collate_packed(_docs(lengths))
    q, k, v = _qkv(sum(lengths), 4, 2, 16, torch.float32, seed=7)
    sink = torch.randn(4).requires_grad_() if sinks else None
    ref = attention.packed_attention_reference(q, k, v, batch.cu_seqlens, 0.3, window, sink, softcap)
    out = attention.sdpa_attention(q, k, v, batch, 0.3, window, 0.0, sink, softcap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    inputs = [q, k, v, *([sink] if sinks else [])]
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(8))
    for a, b in zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(ref, inputs, dout)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    detached = [t.detach() for t in (q, k, v)]
    flex = attention.flex_attention(*detached, batch, 0.3, window, sink.detach() if sinks else None, softcap)
    torch.testing.assert_close(flex, ref.detach(), rtol=1e-5, atol=1e-5)


def test_eager_reference_matches_transformers_gpt_oss_attention():
    """`packed_attention_reference` with sinks is transformers' gpt-oss eager attention on one document."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    q, k, v = _qkv(23, 4, 2, 16, torch.float32, seed=9)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = torch.randn(4), 2, False
    mask = torch.zeros(23, 23).masked_fill_(torch.ones(23, 23, dtype=torch.bool).triu_(1), float("-inf"))[None, None]
    want, _ = modeling_gpt_oss.eager_attention_forward(module, q, k, v, mask, scaling=0.3, dropout=0.0)
    got = attention.packed_attention_reference(q, k, v, _cu_seqlens([23]), 0.3, None, module.sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_softcap_falls_back_visibly(caplog):
    lengths = [5, 9]
    batch = collate_packed(_docs(lengths))
    q, k, v = _qkv(14, 4, 2, 16, torch.float32, seed=10)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            out, _ = attention.packed_attention_forward(None, q, k, v, None, 0.3, packed_batch=batch, backend="auto", softcap=4.0)
    ref = attention.packed_attention_reference(q, k, v, batch.cu_seqlens, 0.3, None, None, 4.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    warned = [r.getMessage() for r in caplog.records if "soft-capping" in r.getMessage()]
    assert warned == ["model.attention=auto: flash-attention and cuDNN have no logit soft-capping; the soft-capped layers run sdpa"]


@pytest.mark.parametrize("kind", [*MOE_KINDS, "llama"])
def test_packed_loss_equals_documents_one_by_one(kind):
    """Stock attention over packed rows; the MoE architectures through our MoE path (native_torch)."""
    model = _model(kind)
    if kind in MOE_KINDS:
        from lightning_ft.model.moe import apply_moe

        apply_moe(model, "native_torch")
    docs = _docs([7, 1, 12, 2, 9])
    with torch.no_grad():
        packed = collate_packed(docs)
        packed_loss = _loss_sum(model, packed) / packed.num_target_tokens
        sums, counts = 0.0, 0
        for doc in docs:
            single = collate_packed([doc])
            sums += _loss_sum(model, single)
            counts += single.num_target_tokens
    assert packed.num_target_tokens == counts
    torch.testing.assert_close(packed_loss, sums / counts, rtol=1e-5, atol=1e-5)


def test_flex_model_matches_sdpa_model():
    batch = collate_packed(_docs([7, 1, 130, 2, 9]))
    with torch.no_grad():
        sdpa = _model("llama", "sdpa")(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch)
        flex = _model("llama", "flex")(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch)
    torch.testing.assert_close(flex.logits, sdpa.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_metadata_is_built_once_per_batch_whatever_the_layer_count(monkeypatch, backend):
    builds = []
    real = getattr(attention, BUILDERS[backend])
    monkeypatch.setattr(attention, BUILDERS[backend], lambda *a: builds.append(a[1]) or real(*a))
    model = _model("qwen3_moe", backend)
    assert model.config.num_hidden_layers == 3
    with torch.no_grad():
        for n_batches in (1, 2):
            _loss_sum(model, collate_packed(_docs([5, 3, 8], seed=n_batches)))
            assert builds == [torch.device("cpu")] * n_batches


def test_flex_compiles_once_for_any_packed_length_on_the_cpu():
    """One trace serves every packed length (the GPU test checks the compiled kernels; here dynamo
    traces to a backend that counts). The first row has 2 blocks of 128 tokens and the keys 2 heads:
    with duck sizing the blocks took the heads' symbol, which GQA specializes, and the next block
    count traced again."""
    traces = []

    def counting(gm, example_inputs):
        traces.append(len(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    try:
        flex = attention.compile_flex_attention(backend=counting)
        g = torch.Generator().manual_seed(0)
        for lengths in ([100, 1, 29], [300, 7], [1, 1, 511], [1000, 24]):
            batch = collate_packed(_docs(lengths))
            mask = attention.build_block_mask(batch.cu_seqlens, torch.device("cpu"))
            q, k, v = (torch.randn(1, h, batch.num_tokens, 64, generator=g) for h in (8, 2, 2))
            out = flex(q, k, v, block_mask=mask, enable_gqa=True)
            assert out.shape == q.shape
    finally:
        torch._dynamo.reset()
    assert len(traces) == 1, f"flex_attention traced {len(traces)} times for four packed lengths"
    from torch.fx.experimental import _config as fx_config

    assert fx_config.use_duck_shape, "the patch stays inside the flex calls"


def test_block_causal_mask_matches_the_picture():
    mask = attention.block_causal_mask(_cu_seqlens([3, 2, 4]), torch.device("cpu"))[0, 0]
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    expected = (doc[:, None] == doc[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)
    windowed = attention.block_causal_mask(_cu_seqlens([3, 2, 4]), torch.device("cpu"), sliding_window=2)[0, 0]
    q, k = torch.arange(9)[:, None], torch.arange(9)[None, :]
    assert torch.equal(windowed, expected & (q - k < 2))


@pytest.mark.parametrize("sliding_window", [None, 1, 7, 130])
@pytest.mark.parametrize("lengths", [[256], [1], [128, 128], [1, 300, 2, 1, 77], [129, 1, 1, 5, 200]])
def test_host_built_block_mask_equals_create_block_mask(lengths, sliding_window):
    from torch.nn.attention.flex_attention import create_block_mask

    cu = _cu_seqlens(lengths)
    doc = attention.document_ids(cu)
    T = doc.numel()

    def document_causal(b, h, q, k):
        keep = (doc[q] == doc[k]) & (q >= k)
        return keep & (q - k < sliding_window) if sliding_window is not None else keep

    for block in (32, 128):
        ours = attention.build_block_mask(cu, torch.device("cpu"), sliding_window, block_size=block)
        ref = create_block_mask(document_causal, None, None, T, T, device="cpu", BLOCK_SIZE=block)
        assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):  # fmt: skip
            assert torch.equal(getattr(ours, name), getattr(ref, name)), name


def test_backend_resolution_and_registered_names():
    cpu = torch.device("cpu")
    assert attention.resolve_attention_backend("auto", cpu, torch.bfloat16)[0] == "sdpa"
    with pytest.raises(ValueError, match="model.attention=flex cannot train on cpu.*use model.attention=sdpa"):
        attention.resolve_attention_backend("flex", cpu, torch.float32)  # FlexAttention has no CPU backward
    with pytest.raises(ValueError, match="model.attention=varlen needs CUDA, not cpu: use model.attention=sdpa$"):
        attention.resolve_attention_backend("varlen", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="model.attention=cudnn needs CUDA, not cpu: use model.attention=sdpa$"):
        attention.resolve_attention_backend("cudnn", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="expected one of"):
        attention.resolve_attention_backend("flash", cpu, torch.bfloat16)
    names = {backend: attention.register_packed_attention(backend) for backend in ("sdpa", "varlen", "cudnn", "auto", "flex")}
    assert names == attention.ATTENTION_NAMES
    assert not any(word in name for name in names.values() for word in ("sdpa", "flash", "flex_attention"))


@pytest.mark.parametrize("capability, version, limit", [((9, 0), 91300, 256), ((9, 0), 91200, 128), ((10, 0), 91300, 128),
                                                      ((8, 0), 91300, 128), ((9, 0), None, 128)])
def test_cudnn_takes_head_dims_up_to_256_on_sm90_with_cudnn_9_13(monkeypatch, capability, version, limit):
    """Head dims up to 256 go to cuDNN on sm90 from cuDNN 9.13 (torch allows 9.10; 9.11-9.12 had a Hopper backward bug
    for large head dims), else up to 128."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: version)
    assert cudnn_head_dim_limit(torch.device("cuda")) == limit


def test_varlen_size_guard_names_the_limit():
    check_varlen_size(total_q=65536, num_docs=200, num_heads=32, head_dim=128)
    # (T + 128·N)·heads·round32(head_dim) < 2³¹: with 32 heads of 128 and 100 documents, T <= 511487
    check_varlen_size(total_q=511_487, num_docs=100, num_heads=32, head_dim=128)
    with pytest.raises(ValueError, match=r"at most 511487 .*model.attention=flex"):
        check_varlen_size(total_q=511_488, num_docs=100, num_heads=32, head_dim=128)


UNPACKED = {  # attention sinks and a sliding window (gpt-oss), soft-capping and a window (Gemma 2), plain (Llama)
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
        layer_types=["sliding_attention", "full_attention"], initializer_range=0.5, vocab_size=97,
    ),
    "gemma2": dict(
        model_type="gemma2", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=3, attn_logit_softcapping=1.0, vocab_size=97,
    ),
    "llama": TINY["llama"],
}


@pytest.mark.parametrize("kind", list(UNPACKED))
def test_unpacked_rows_equal_transformers_eager_with_padding_sinks_softcap_and_windows(kind):
    """Calls without a packed batch (evaluation, generation, the logits a run dumps) get transformers' mask
    (padding, sliding window) and keep sinks and soft-capping, as the model's own eager attention does."""
    import copy

    torch.manual_seed(0)
    ours = load_causal_lm(None, "random", dict(UNPACKED[kind]), attn_implementation=attention.register_packed_attention("sdpa"))
    eager = copy.deepcopy(ours)
    eager.set_attn_implementation("eager")
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    with torch.no_grad():
        got, want = (m.eval()(input_ids=ids, attention_mask=mask).logits for m in (ours, eager))
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1, 3:], want[1, 3:], rtol=1e-5, atol=1e-5)  # padding's own logits are not used
        # generation: the prompt, then one token at a time through the KV cache
        prompt = ids[:1, :6]
        torch.testing.assert_close(*(m.generate(prompt, max_new_tokens=4, do_sample=False) for m in (ours, eager)))


def test_a_packed_forward_gets_no_transformers_mask(monkeypatch):
    """Inside `packed_forward` transformers builds no mask and runs no packed-sequence detection (a device sync);
    outside, unpacked calls get its SDPA mask."""
    from transformers import masking_utils

    model = _model("llama")
    batch = collate_packed(_docs([5, 3]))
    detected = []
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda *args: detected.append(1))
    with attention.packed_forward(), torch.no_grad():
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch, use_cache=False)
    assert not detected
    assert attention.ATTENTION_NAMES["sdpa"] in masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping  # restored
    with torch.no_grad():
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch, use_cache=False)
    assert detected  # the check above would see it
