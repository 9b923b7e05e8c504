"""Packed attention: same loss as running each document alone; metadata built once per batch.

The backends that run on the CPU (sdpa: forward and backward; flex: forward, torch's unfused
reference) are checked here; varlen and the compiled flex kernel in tests/model/test_attention_gpu.py.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from lightning_ft.data.packing import collate_packed
from lightning_ft.model import attention
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


@pytest.mark.parametrize("value_dim", [16, 12], ids=["v16", "v12"])  # 12: zero-padded to 16 for the kernel, sliced back
@pytest.mark.parametrize("takes_enable_gqa", [False, True], ids=["torch2.11", "torch2.12+"])
def test_varlen_glue_calls_the_api_as_documented(monkeypatch, takes_enable_gqa, value_dim):
    """The varlen path on the CPU with a stand-in for `varlen_attn` that follows its documented
    contract ([T, H, D] tensors, cu_seqlens, window_size=(left, 0) for causal): checks layouts, the
    window and the GQA argument of either torch generation. The real kernel: test_attention_gpu.py."""
    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **gqa):
        calls.append({"contiguous": query.is_contiguous() and key.is_contiguous(), "max": (max_q, max_k), **gqa})
        assert value.is_contiguous() and value.shape[-1] == query.shape[-1]  # flash-attention takes one head dim
        assert window_size[1] == 0 and cu_seq_q is cu_seq_k and cu_seq_q.dtype == torch.int32
        window = None if window_size[0] == -1 else window_size[0] + 1
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
        return attention.packed_attention_reference(q, k, v, cu_seq_q, scale, window)[0]

    monkeypatch.setattr(attention, "_varlen_api", lambda: (varlen_attn, takes_enable_gqa))
    lengths = [1, 37, 1, 150]
    batch = collate_packed(_docs(lengths))
    g = torch.Generator().manual_seed(2)
    # laid out as transformers lays them out: [1, T, H, D] memory seen as [1, H, T, D]
    q, k, v = (
        torch.randn(1, sum(lengths), h, d, generator=g).to(torch.bfloat16).transpose(1, 2)
        for h, d in ((4, 16), (2, 16), (2, value_dim))
    )
    for window in (None, 30):
        out = attention.varlen_attention(q, k, v, batch, 0.25, window)
        ref = attention.packed_attention_reference(q, k, v, batch.cu_seqlens, 0.25, window)
        torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=2e-3)  # bf16: v12 takes another CPU kernel than v16
    gqa = {"enable_gqa": True} if takes_enable_gqa else {}
    assert calls == [{"contiguous": True, "max": (150, 150), **gqa}] * 2
    with pytest.raises(ValueError, match="needs bfloat16 or float16"):
        attention.varlen_attention(q.float(), k.float(), v.float(), batch, None, None)
    with pytest.raises(ValueError, match=r"value head dim \(32\) wider than the query/key head dim \(16\)"):
        attention.varlen_attention(q, k, torch.cat([v, v, v], dim=-1)[..., :32], batch, None, None)


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
    with pytest.raises(ValueError, match="expected one of"):
        attention.resolve_attention_backend("flash", cpu, torch.bfloat16)
    names = {backend: attention.register_packed_attention(backend) for backend in ("sdpa", "varlen", "flex")}
    assert names == attention.ATTENTION_NAMES
    assert not any(word in name for name in names.values() for word in ("sdpa", "flash", "flex_attention"))


def test_varlen_size_guard_names_the_limit():
    attention.check_varlen_size(total_q=65536, num_docs=200, num_heads=32, head_dim=128)
    # (T + 128·N)·heads·round32(head_dim) < 2³¹: with 32 heads of 128 and 100 documents, T <= 511487
    attention.check_varlen_size(total_q=511_487, num_docs=100, num_heads=32, head_dim=128)
    with pytest.raises(ValueError, match=r"at most 511487 .*model.attention=flex"):
        attention.check_varlen_size(total_q=511_488, num_docs=100, num_heads=32, head_dim=128)
