"""The grouped_mm backend (`lightning_ft.kernels.moe.grouped_mm`): kept gate/up recompute, the thin
LoRA products and their timing, the fused gathers, the one-time probe and its fallback."""

import itertools
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import lightning_ft.kernels.moe.grouped_mm as gmm
from lightning_ft.kernels.moe import grouped_mm_mode
from lightning_ft.kernels.moe.grouped_gemm import grouped_gemm, grouped_wgrad
from lightning_ft.strategies import kept
from moe_cases import CASES, DEVICES, Case, _assert_close, _make, _reference_run, _run, _skip_unless_runnable

KEPT_CASES = {name: CASES[name] for name in ("base", "e6_top1_empty", "full_finetune", "gpt_oss")} | {
    "padded_rank": Case(tokens=16, hidden=32, intermediate=16, experts=4, top_k=2, rank=3, empty=(1,)),
}


@pytest.mark.parametrize("thin", ["grouped_mm", "triton"])
@pytest.mark.parametrize("mode", ["views", "copies"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_name", list(KEPT_CASES))
def test_kept_gate_up_recompute_gives_the_plain_gradients_bit_for_bit(case_name, dtype, mode, thin, monkeypatch):
    """grouped_mm with the gate/up output kept (the CUDA graphs' recompute, `_KeptGroupedMMLinear`):
    after a first and a later forward without grad keep h and s·x·Aᵀ, the recompute on the same
    inputs reads the tokens through the routing (no [S, D] gather) and gives the plain path's
    output and every gradient bit for bit: top_k=1 with empty experts, a rank padded to 16-byte
    rows, full fine-tuning of the experts (no LoRA: dW from the tokens), gpt-oss's experts (their
    gate/up bias is added after the kept GEMM output, on both paths), the weights' views and
    copies modes, and each thin-product candidate (Triton's LoRA A gradient then gathers in its
    loads). CPU: the same kernels on both paths (on CUDA the candidates are timed per key)."""
    case = KEPT_CASES[case_name]
    monkeypatch.setattr(gmm, "grouped_mm_mode", lambda device, dtype: mode)
    if thin == "triton":
        monkeypatch.setattr(gmm, "_thin_product", lambda kind, rows, a, grouped_mm_fn, triton_fn: triton_fn())
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1))
    want_out, want = _run("grouped_mm", case, topk_idx, tensors, dtype, grad_out)
    keep = kept.KeptActivations("mlp", allow=lambda nbytes: True)
    for scale in (0.5, 1.0):  # the first forward's results become the buffers, the later one's land in them
        _run("grouped_mm", case, topk_idx, tensors | {"x": tensors["x"] * scale}, dtype, None, keep=keep)
    assert keep.enabled and len(keep.kept) == 1
    permuted = []
    real_permute = gmm.permute_tokens
    monkeypatch.setattr(gmm, "permute_tokens", lambda *args: permuted.append(args) or real_permute(*args))
    got_out, got = _run("grouped_mm", case, topk_idx, tensors, dtype, grad_out, keep=keep)
    assert not permuted
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=0)
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_thin_handoff_gives_its_product_to_that_gradient_once():
    """`_ThinHandoff`: the dy B product goes to the gradient it was computed from, once; a view of
    other strides, another tensor, or the same one changed in place (autograd accumulating into
    it) get None, and the projection computes its own."""
    handoff, dy, dyb = gmm._ThinHandoff(), torch.randn(6, 4), torch.randn(6, 2)
    handoff.put(dy, dyb)
    assert handoff.take(dy) is dyb and handoff.take(dy) is None
    for other in (lambda: dy[:, :3], lambda: dy.clone(), lambda: dy.add_(1.0)):
        handoff.put(dy, dyb)
        assert handoff.take(other()) is None


@pytest.mark.parametrize("case_name", ["base", "e6_top1_empty"])  # odd_sizes: grouped_mm needs 16-byte rows
def test_grouped_mm_backend_gathers_into_the_thin_products(case_name, monkeypatch):
    """Where Triton runs, the grouped_mm backend computes gate/up's x A^T in the pass that gathers x
    into expert order and down's dy B in the pass that gathers the output gradient (no separate
    thin product runs for those two), the down projection's backward takes that dy B, and the
    output and every gradient match the reference."""
    _skip_unless_runnable("triton", "cpu")
    thin, kinds = gmm._thin_product, []

    def counted(kind, *args):
        kinds.append(kind)
        return thin(kind, *args)

    taken = []
    take = gmm._ThinHandoff.take
    monkeypatch.setattr(gmm, "_thin_product", counted)
    monkeypatch.setattr(gmm._ThinHandoff, "take", lambda self, dy: taken.append(take(self, dy)) or taken[-1])
    case = CASES[case_name]
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = _reference_run(case, topk_idx, tensors, grad_out)
    out, grads = _run("grouped_mm", case, topk_idx, tensors, torch.float32, grad_out)
    assert len(taken) == 1 and taken[0] is not None
    # down's x A^T (its input comes from the SwiGLU kernel) and gate/up's dy B (from its backward)
    assert sorted(kinds) == ["dA", "dA", "dB", "dB", "dyb", "xa"]
    _assert_close(out, ref_out, torch.float32, "output")
    for name, ref_grad in ref_grads.items():
        _assert_close(grads[name], ref_grad, torch.float32, f"grad of {name}")


def test_fused_gather_computes_no_input_gradient_that_x_does_not_need(monkeypatch):
    """With x frozen (a first layer, LoRA on the experts only), the gate/up projection's backward
    computes no input gradient: the fused gather's output does not require grad through A."""
    _skip_unless_runnable("triton", "cpu")
    needs = []
    backward = gmm._grouped_mm_linear_backward
    monkeypatch.setattr(gmm, "_grouped_mm_linear_backward", lambda *args: needs.append(args[10][0]) or backward(*args))
    case = CASES["base"]
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1))
    trainable = ["gate_up_A", "gate_up_B", "down_A", "down_B"]
    _, grads = _run("grouped_mm", case, topk_idx, tensors, torch.float32, grad_out, trainable=trainable)
    assert needs == [True, False]  # down (its input a depends on gate/up's LoRA), then gate/up
    _, ref_grads = _reference_run(case, topk_idx, tensors, grad_out)
    for name in trainable:
        _assert_close(grads[name], ref_grads[name], torch.float32, f"grad of {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_thin_products_equal_grouped_mm(device, dtype):
    """The four thin LoRA products `_thin_product` chooses between, both ways: xa = x A_e^T,
    dyb = dy B_e, dA = dyb^T x, dB = dy^T xa; 5 experts, one with no rows, odd row counts
    (C, N, R aligned to 16 bytes: grouped_mm needs it)."""
    _skip_unless_runnable("triton", device)
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([7, 0, 13, 1, 10])
    rows, c_dim, n_dim, rank = int(counts.sum()), 40, 24, 8
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    x_SC, dy_SN, a_ERC, b_ENR = rand(rows, c_dim), rand(rows, n_dim), rand(5, rank, c_dim), rand(5, n_dim, rank)
    xa_SR = gmm._GROUPED_MM(x_SC, a_ERC.transpose(1, 2), offs=offsets)
    dyb_SR = gmm._GROUPED_MM(dy_SN, b_ENR, offs=offsets)
    pairs = {
        "xa": (xa_SR, grouped_gemm(x_SC, a_ERC.transpose(1, 2), offsets, rows)),
        "dyb": (dyb_SR, grouped_gemm(dy_SN, b_ENR, offsets, rows)),
        "dA": (gmm._GROUPED_MM(dyb_SR.t(), x_SC, offs=offsets), grouped_wgrad(dyb_SR, x_SC, offsets)),
        "dB": (gmm._GROUPED_MM(dy_SN.t(), xa_SR, offs=offsets), grouped_wgrad(dy_SN, xa_SR, offsets)),
    }
    for kind, (expected, actual) in pairs.items():
        assert actual.shape == expected.shape and actual.dtype == dtype, kind
        _assert_close(actual, expected.double(), dtype, kind)
    assert not pairs["dA"][1][1].any() and not pairs["dB"][1][1].any()  # the expert with no rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_mm_backend_with_the_triton_thin_products(dtype, monkeypatch):
    """The grouped_mm backend as it runs where Triton was timed faster for every thin product (on
    CUDA only; forced here): output and gradients match the reference."""
    _skip_unless_runnable("triton", "cpu")
    monkeypatch.setattr(gmm, "_thin_product", lambda kind, rows_S, a_ERC, grouped_mm_fn, triton_fn: triton_fn())
    case = CASES["e6_top1_empty"]
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = _reference_run(case, topk_idx, tensors, grad_out)
    out, grads = _run("grouped_mm", case, topk_idx, tensors, dtype, grad_out)
    _assert_close(out, ref_out, dtype, "output")
    for name, ref_grad in ref_grads.items():
        _assert_close(grads[name], ref_grad, dtype, f"grad of {name}")


def test_thin_product_times_once_per_key_and_never_while_capturing(monkeypatch, caplog):
    """The choice logic with fake candidates, timer and device: the faster is timed once, cached and
    reused per (product, sizes, power-of-two rows); nothing is timed during capture or off CUDA."""
    monkeypatch.setattr(gmm, "_THIN_CHOICES", {})
    monkeypatch.setattr(gmm, "_LOGGED", set())
    monkeypatch.setattr(gmm, "_INTERPRET", False)
    capturing = False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    calls = []

    def candidate(name):
        def run():
            calls.append(name)
            return name
        return run

    grouped_mm_fn, triton_fn = candidate("grouped_mm"), candidate("triton")
    times_ms = {grouped_mm_fn: 0.2, triton_fn: 0.1}
    timed = []
    monkeypatch.setattr(gmm, "_time_ms", lambda fn: timed.append(fn) or times_ms[fn])

    def thin(kind, rows, dtype=torch.bfloat16, device=torch.device("cuda", 0)):  # only shape, dtype, device are read
        rows_S = SimpleNamespace(shape=(rows, 64), dtype=dtype, device=device)
        return gmm._thin_product(kind, rows_S, torch.empty(6, 16, 64), grouped_mm_fn, triton_fn)

    with caplog.at_level(logging.INFO, logger="lightning_ft.kernels.moe.grouped_mm"):
        assert thin("xa", 1000) == "triton"  # warm-up of each, timed, the faster's warm-up result returned
        assert calls == ["grouped_mm", "triton"] and timed == [grouped_mm_fn, triton_fn]
        assert thin("xa", 1024) == "triton"  # the same power-of-two bucket: cached
        assert len(timed) == 2 and calls[2:] == ["triton"]
    assert list(gmm._THIN_CHOICES.values()) == ["triton"]
    assert sum("using triton" in r.message for r in caplog.records) == 1

    times_ms[triton_fn] = 0.2  # a tie keeps grouped_mm
    assert thin("dB", 1000) == "grouped_mm" and len(timed) == 4

    capturing = True
    calls.clear()
    assert thin("xa", 600) == "triton"  # cached (bucket 1024): replayed as chosen
    assert thin("xa", 3000) == "grouped_mm"  # new bucket: grouped_mm, untimed, not cached
    assert calls == ["triton", "grouped_mm"] and len(timed) == 4 and len(gmm._THIN_CHOICES) == 2

    capturing = False
    for device, dtype in ((torch.device("cpu"), torch.bfloat16), (torch.device("cuda", 0), torch.float64)):
        assert thin("dA", 1000, dtype, device) == "grouped_mm"
    monkeypatch.setattr(gmm, "_INTERPRET", True)
    assert thin("dA", 1000) == "grouped_mm"
    assert len(timed) == 4 and len(gmm._THIN_CHOICES) == 2

    # the real backend off CUDA: no timing, no cache entries
    case = CASES["base"]
    topk_idx, tensors = _make(case, "cpu")
    _run("grouped_mm", case, topk_idx, tensors, torch.float32, torch.randn(case.tokens, case.hidden))
    assert len(timed) == 4 and len(gmm._THIN_CHOICES) == 2


def test_grouped_mm_probe_and_fallback(caplog, monkeypatch):
    """On this torch the view path is probed once, with the same answer when the first call comes from
    inference_mode (generation before training); misaligned sizes fall back to the loop, logged once."""
    monkeypatch.setattr(gmm, "_GROUPED_MM_MODES", {})
    with torch.inference_mode():
        mode = grouped_mm_mode(torch.device("cpu"), torch.float32)
    has_grouped_mm = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")
    assert mode in (("views", "copies") if has_grouped_mm else ("unsupported",))
    assert grouped_mm_mode(torch.device("cpu"), torch.float32) == mode  # cached

    case = CASES["odd_sizes"]  # hidden 33: rows of 132 bytes, not a multiple of 16
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden)
    gmm._LOGGED.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_ft.kernels.moe.grouped_mm"):
        out, _ = _run("grouped_mm", case, topk_idx, tensors, torch.float32, grad_out)
        _run("grouped_mm", case, topk_idx, tensors, torch.float32, grad_out)
    assert sum("running the native_torch loop" in r.message for r in caplog.records) == 1
    native, _ = _run("native_torch", case, topk_idx, tensors, torch.float32, grad_out)
    torch.testing.assert_close(out, native, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("timing", ["measured", "triton_faster"])
def test_grouped_mm_thin_products_timed_once_on_cuda(timing, monkeypatch):
    """The grouped_mm backend on CUDA: the first forward+backward times the six thin products that
    run apart (four per projection, but gate/up's x A^T and down's dy B, which the gathers compute;
    "triton_faster" fakes the timer so the Triton ones surely run), the second reuses the choices;
    both match the reference."""
    monkeypatch.setattr(gmm, "_THIN_CHOICES", {})
    timed = []
    fake_times = itertools.cycle([1.0, 0.0])  # calls come grouped_mm, triton
    real_time_ms = gmm._time_ms
    monkeypatch.setattr(
        gmm, "_time_ms", lambda fn: timed.append(fn) or (real_time_ms(fn) if timing == "measured" else next(fake_times))
    )
    # F = 192, D = 256, I = 96: the six (product, C or N) keys differ; expert 3 gets no tokens
    case = Case(tokens=512, hidden=256, intermediate=96, experts=6, top_k=2, rank=16, empty=(3,))
    topk_idx, tensors = _make(case, "cuda")
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1)).to("cuda")
    ref_out, ref_grads = _reference_run(case, topk_idx, tensors, grad_out)
    for _ in range(2):
        out, grads = _run("grouped_mm", case, topk_idx, tensors, torch.bfloat16, grad_out)
        _assert_close(out, ref_out, torch.bfloat16, "output")
        for name, ref_grad in ref_grads.items():
            _assert_close(grads[name], ref_grad, torch.bfloat16, f"grad of {name}")
        assert len(gmm._THIN_CHOICES) == 6 and len(timed) == 12  # timed on the first pass only
    assert {key[0] for key in gmm._THIN_CHOICES} == {"xa", "dyb", "dA", "dB"}
    if timing == "triton_faster":
        assert set(gmm._THIN_CHOICES.values()) == {"triton"}
