"""Packed attention on CUDA: every backend against the per-document reference in bf16, metadata built
once per batch, flex compiled once, and a whole training step without a host-device sync.

    python -m pytest -q -m gpu tests/model/test_attention_gpu.py
"""

import functools
import logging
import math
import warnings

import pytest
import torch

from lightning_ft.data.packing import collate_packed
from lightning_ft.model import attention, attention_plan
from lightning_ft.model.build import ModelBuilder, load_causal_lm
from lightning_ft.module import FinetuneModule

pytestmark = pytest.mark.gpu
BACKENDS = ["auto", "cudnn", "varlen", "flex", "sdpa"]
BUILDERS = {
    "sdpa": (attention, "block_causal_mask"), "flex": (attention, "build_block_mask"),
    "auto": (attention_plan, "plan_segments"), "cudnn": (attention_plan, "plan_segments"),
    "varlen": (attention_plan, "plan_segments"),
}  # fmt: skip
ATTEND = {
    "sdpa": attention.sdpa_attention, "flex": attention.flex_attention,
    **{policy: functools.partial(attention.varlen_attention, policy=policy) for policy in attention.VARLEN_FAMILY},
}  # fmt: skip
# one-token documents among others, a single document of exactly T tokens, flex tile edges
LENGTHS = {
    "mixed": [1, 37, 1, 300, 1, 129, 64, 1],
    "one_document": [512],
    "tile_edges": [128, 127, 1, 128, 256],
    "one_longer_than_the_rest": [3, 700, 1, 20],
}
# head_dim a multiple of 8 (flash-attention); GQA in both
TINY = {
    "llama": dict(
        model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, vocab_size=256,
    ),
}
LORA = {
    "rank": 4, "alpha": 8, "dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}  # fmt: skip
CUDA = torch.device("cuda")


def _docs(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(ids, ids) for ids in (torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths)]


def _max_error(x, reference):
    return (x.float() - reference).abs().max().item()


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("backend", [*BACKENDS, "auto_from_100"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("heads, dims", [((8, 2), (64, 64)), ((7, 1), (96, 64)), ((4, 2), (256, 256)), ((4, 4), (192, 128))],
                         ids=["gqa", "odd_heads_mla_dims", "head_dim_256", "deepseek_mla_dims"])
def test_backend_equals_per_document_sdpa_bf16(monkeypatch, backend, lengths, sliding_window, sinks, heads, dims):
    """Forward and backward within bf16 error: at most twice the error of the reference run in bf16
    (against the reference in fp32), plus 1e-3 (flash-attention's own test criterion). The sinks'
    gradient too, with one bf16 ulp of its largest value more (a per-head sum, rounded once). ``auto_from_100``: auto with cuDNN from 100 tokens (a row of both kernels)."""
    if backend == "auto_from_100":
        monkeypatch.setattr(attention, "crossover", lambda q, k, v: 100)
        backend = "auto"
    batch = collate_packed(_docs(lengths)).to(CUDA, non_blocking=True)
    g = torch.Generator(device=CUDA).manual_seed(0)
    T, (Hq, Hkv), (D, Dv), scale = sum(lengths), heads, dims, 0.125
    # laid out as transformers lays them out: [1, T, H, D] memory seen as [1, H, T, D]
    q, k, v = (torch.randn(1, T, h, d, generator=g, device=CUDA).bfloat16().transpose(1, 2) for h, d in ((Hq, D), (Hkv, D), (Hkv, Dv)))
    dout = torch.randn(1, T, Hq, Dv, generator=g, device=CUDA, dtype=torch.bfloat16)
    sink = [torch.randn(Hq, generator=g, device=CUDA).bfloat16()] if sinks else []
    inputs = [t.detach().requires_grad_() for t in (q, k, v, *sink)]
    inputs32 = [t.detach().float().requires_grad_() for t in (q, k, v, *sink)]
    extra = {"sinks": inputs[3]} if sinks else {}

    out = ATTEND[backend](*inputs[:3], batch, scale, sliding_window, **extra)
    ref16 = attention.packed_attention_reference(*inputs[:3], batch.cu_seqlens, scale, sliding_window, *inputs[3:])
    ref32 = attention.packed_attention_reference(*inputs32[:3], batch.cu_seqlens, scale, sliding_window, *inputs32[3:])
    assert out.shape == ref32.shape and out.dtype == torch.bfloat16
    assert _max_error(out, ref32) <= 2 * _max_error(ref16, ref32) + 1e-3
    grads = torch.autograd.grad(out, inputs, dout)
    grads16 = torch.autograd.grad(ref16, inputs, dout)
    grads32 = torch.autograd.grad(ref32, inputs32, dout.float())
    for name, got, bf16, exact in zip("qkvs", grads, grads16, grads32):
        # ds is one sum per head over every query row, rounded once to bf16: a rounding the other way than the
        # reference's costs a whole ulp of |ds| (measured: -8.75 for -8.693, where the bf16 reference rounded to -8.6875)
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs().max().item() if name == "s" else 0.0
        assert _max_error(got, exact) <= 2 * _max_error(bf16, exact) + 1e-3 + ulp, f"d{name}"


def test_auto_measures_its_crossover_once_per_shape_class_and_logs_it(monkeypatch, caplog):
    monkeypatch.setattr(attention_plan, "_CROSSOVERS", {})
    q, k = (torch.empty(1, h, 128, device=CUDA, dtype=torch.bfloat16) for h in (32, 8))
    with caplog.at_level(logging.INFO, logger="lightning_ft.model.attention_plan"):
        first = attention_plan.crossover(q, k, k)
        assert attention_plan.crossover(q, k, k) == first == attention_plan.min_crossover()
    assert first in (*attention_plan.CALIBRATION_LENGTHS, attention_plan.NEVER)
    assert len([r for r in caplog.records if "attention auto (32 q / 8 kv heads of 128" in r.getMessage()]) == 1
    monkeypatch.setattr(attention_plan, "_CROSSOVERS", {})
    state = torch.cuda.get_rng_state()
    attention_plan.crossover(q, k, k)
    assert torch.equal(torch.cuda.get_rng_state(), state)  # its inputs come from its own generator, not the run's
    if torch.cuda.get_device_capability() >= (9, 0):  # measured on the H200: cuDNN wins from 8K tokens at the latest
        assert first <= 8192


def test_torch_packed_cudnn_entry_is_used_only_where_its_gradients_are_right():
    """torch's packed cuDNN attention (``aten::_cudnn_attention_forward`` with offsets) is re-checked on the
    installed torch: the backend may use it only for versions in `attention_plan.PACKED_CUDNN_TORCH`, and a
    version there must give flash-attention 2's gradients. Prints what it finds, so a torch that fixes it shows."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention runs on Hopper or newer")
    lengths = [1000, 3000, 500, 2000, 1389]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    g = torch.Generator(device=CUDA).manual_seed(0)
    T, H, D = sum(lengths), 8, 64
    q, k, v = (torch.randn(T, H, D, generator=g, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn(T, H, D, generator=g, device=CUDA, dtype=torch.bfloat16)
    ref = attention.packed_attention_reference(*(t.transpose(0, 1)[None] for t in (q, k, v)), cu.cpu())[0]
    try:
        out, lse, *_, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max(lengths), max(lengths), True, 0.0, True, False, scale=None)
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, torch.empty(0, device=CUDA), cu, cu, max(lengths), max(lengths), 0.0, True, scale=None)
        kernel = attention_plan.flash_varlen_kernel(cu, max(lengths), None, None)
        out2, aux = kernel.forward(q, k, v)
        want = kernel.backward(dout, q, k, v, out2, aux)
        errors = [_max_error(out, ref.float())] + [_max_error(a, b.float()) for a, b in zip((dq, dk, dv), want)]
        right = errors[0] < 2e-2 and max(errors[1:]) < 5e-2
    except (RuntimeError, IndexError) as err:  # torch 2.11: IndexError inside the backward op
        errors, right = repr(err)[:200], False
    version = ".".join(torch.__version__.split(".")[:2])
    print(f"torch {torch.__version__}: packed cuDNN attention errors (out, dq, dk, dv) {errors}; right={right}")
    assert version not in attention_plan.PACKED_CUDNN_TORCH or right


def test_varlen_casts_fp32_inputs_under_autocast():
    batch = collate_packed(_docs([3, 1, 60])).to(CUDA, non_blocking=True)
    q, k, v = (torch.randn(1, h, 64, 32, device=CUDA) for h in (4, 2, 2))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = attention.varlen_attention(q, k, v, batch, None, None)
    assert out.dtype == torch.bfloat16
    rounded = (t.bfloat16().float() for t in (q, k, v))  # the inputs as the kernel sees them, math in fp32
    expected = attention.packed_attention_reference(*rounded, batch.cu_seqlens)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_metadata_is_built_once_per_batch_and_device(monkeypatch, backend):
    builds = []
    module, name = BUILDERS[backend]
    real = getattr(module, name)
    # the plan is built on the host: count its builds as on the batch's device
    device_of = (lambda a: a[1]) if module is attention else (lambda a: CUDA)
    monkeypatch.setattr(module, name, lambda *a: builds.append(device_of(a)) or real(*a))
    torch.manual_seed(0)
    with CUDA:
        name = attention.register_packed_attention(backend)
        model = load_causal_lm(None, "random", dict(TINY["llama"]), dtype="bfloat16", attn_implementation=name)
    assert model.config.num_hidden_layers == 3
    with torch.no_grad():
        for n_batches in (1, 2):
            batch = collate_packed(_docs([50, 3, 200], seed=n_batches)).to(CUDA, non_blocking=True)
            model(input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch)
            assert [d.type for d in builds] == ["cuda"] * n_batches


def test_flex_compiles_once_for_any_packed_length():
    from torch._dynamo.utils import counters

    g = torch.Generator(device=CUDA).manual_seed(0)
    graphs = []
    for lengths in ([100, 1, 29], [300, 7], [1, 1, 511], [1000, 24]):
        batch = collate_packed(_docs(lengths)).to(CUDA, non_blocking=True)
        T = batch.num_tokens
        q, k, v = (torch.randn(1, h, T, 64, generator=g, device=CUDA).bfloat16().requires_grad_() for h in (8, 2, 2))
        attention.flex_attention(q, k, v, batch, None, None).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == graphs[:1] * 3, f"unique compiled graphs after each batch: {graphs}"


def _module(kind, backend, moe):
    torch.manual_seed(0)
    module = FinetuneModule(ModelBuilder(model={"init": "random", "config": dict(TINY[kind]), "dtype": "bfloat16", "attention": backend}, lora=LORA if kind == "llama" else {**LORA, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}, moe={"backend": moe}))
    with CUDA:
        module.configure_model()
    for name, p in module.model.named_parameters():  # non-zero lora_B: every LoRA weight gets gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return module


def _train_step(module, optimizer, host_batch):
    batch = host_batch.to(CUDA, non_blocking=True)
    loss = module.loss_sum(batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kind, moe",
    [("llama", "hf"), ("qwen3_moe", "auto"), ("qwen3_moe", "hf")],
    ids=["llama", "qwen3_moe-ours", "qwen3_moe-stock"],
)
def test_training_step_never_syncs(kind, moe, backend):
    """Batch to the GPU, forward, backward and AdamW step of a LoRA model under ``set_sync_debug_mode("error")``.

    A warm-up step first (flex compiles, first-use probes run); the checked step has other document
    lengths, so nothing is reused from the warm-up but compiled kernels. When the step syncs, it
    runs again under ``"warn"`` to list every op that synced (file:line of the Python caller; a
    sync inside backward points at ``loss.backward()``). ``qwen3_moe-stock`` runs transformers' own
    experts (``moe=hf``): a failure there locates the syncs of the installed transformers.
    """
    # the compiles of earlier tests (other head dims, windows, sinks) count toward dynamo's recompile limit, past
    # which flex runs torch's eager reference, which syncs: this model's compile starts afresh
    torch._dynamo.reset()
    module = _module(kind, backend, moe)
    optimizer = torch.optim.AdamW([p for p in module.model.parameters() if p.requires_grad], lr=1e-3)
    warm_up = _train_step(module, optimizer, collate_packed(_docs([40, 1, 200, 17], seed=0)))
    checked = collate_packed(_docs([3, 150, 1, 1, 90, 30], seed=1))
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        loss = _train_step(module, optimizer, checked)
    except RuntimeError as err:
        if "synchronizing" not in str(err):
            raise
        optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            _train_step(module, optimizer, checked)
        syncs = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)})
        pytest.fail(f"{kind} moe={moe} attention={backend}: {err}\nops that synced: {syncs}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(warm_up.item()) and math.isfinite(loss.item())


def test_auto_resolves_to_auto_on_this_gpu():
    assert attention.resolve_attention_backend("auto", CUDA, torch.bfloat16)[0] == "auto"
    assert attention.resolve_attention_backend("auto", CUDA, torch.float32)[0] == "sdpa"

