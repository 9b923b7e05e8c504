"""`lora_linear` against its plain-torch reference (PEFT's ``lora.Linear`` order of operations).

Pure torch (no Triton), so every case runs on the CPU; the same cases run on the GPU (marked).
Tolerances: fp32 1e-5 (the scaling moves into the GEMM epilogue: rounding order only). bf16 under
autocast: 1e-2 relative L2 on outputs and gradients (measured 2.5e-3; a 10% error in the scaling
gives 8e-2): PEFT's path rounds the [T, N] adapter product to bf16 before scaling it and adding it
in bf16, ours scales and adds in fp32 inside one GEMM, so each is a few bf16 roundings (2^-9
relative each) from the fp32 result.
"""

import pytest
import torch

from lightning_ft.kernels.lora import lora_linear, lora_linear_reference
from lightning_ft.strategies import kept

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(device, lead, k, n, r, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g).to(device).requires_grad_()
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device)
    b = torch.randn(n, generator=g).to(device) if bias else None
    a = (torch.randn(r, k, generator=g) / k**0.5).to(device).requires_grad_()
    bb = torch.randn(n, r, generator=g).to(device).requires_grad_()
    return x, w, b, a, bb


def _run(fn, x, w, b, a, bb, scaling, grad_seed=1):
    y = fn(x, w, b, a, bb, scaling)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_seed)).to(y.device, y.dtype)
    dx, da, db = torch.autograd.grad(y, (x, a, bb), g)
    return y, dx, da, db


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("lead", "k", "n", "r", "bias"), [((1, 37), 48, 80, 4, False), ((2, 1), 33, 17, 8, True), ((5,), 2880, 96, 16, False)])
def test_fp32_matches_the_reference(device, lead, k, n, r, bias):
    inputs = _inputs(device, lead, k, n, r, bias)
    got = _run(lora_linear, *inputs, 2.0)
    expected = _run(lora_linear_reference, *inputs, 2.0)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype == torch.float32
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_matches_the_reference_with_fp32_adapters(device):
    x, w, b, a, bb = _inputs(device, (1, 61), 96, 130, 16, True)
    x = x.detach().to(torch.bfloat16).requires_grad_()
    w, b = w.to(torch.bfloat16), b.to(torch.bfloat16)  # bf16 base, fp32 adapters, as PEFT keeps them
    with torch.autocast(device, dtype=torch.bfloat16):
        got = _run(lora_linear, x, w, b, a, bb, 0.5)
        expected = _run(lora_linear_reference, x, w, b, a, bb, 0.5)
    assert got[0].dtype == expected[0].dtype == torch.bfloat16
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32  # gradients in the adapters' dtype
    for g, e in zip(got, expected, strict=True):
        assert _rel(g, e) <= 1e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["fp32", "bf16-autocast", "fp32-input-bf16-autocast"])
def test_kept_output_gives_the_plain_gradients_exactly(device, case):
    """Kept projections (CUDA graphs' recompute): a forward (no grad) offers (y, x Aᵀ); the recompute
    returns that y (no product runs) and differentiates as autograd does through the three ops:
    output and the adapters' gradients equal bit for bit (odd sizes, fp32 adapters as PEFT keeps
    them). x's gradient is summed in the base GEMM's epilogue (`_InputGradient`), so it rounds
    otherwise: as close to the float64 sum as autograd's (bit for bit where x's dtype is not the
    products', which keeps autograd's sum)."""
    x, w, b, a, bb = _inputs(device, (3, 19), 40, 72, 8, True)
    if case != "fp32":
        w, b = w.to(torch.bfloat16), b.to(torch.bfloat16)
    if case == "bf16-autocast":
        x = x.detach().to(torch.bfloat16).requires_grad_()
    # no cast cache, as the CUDA graphs record (a cached cast of a leaf x sums dx's two paths in bf16)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=case != "fp32", cache_enabled=False)
    keep = kept.KeptActivations("projections", allow=lambda nbytes: True)
    with autocast:
        want = _run(lora_linear, x, w, b, a, bb, 0.5)
        with torch.no_grad(), kept.keeping(keep, recompute=False):
            forward_y = lora_linear(x, w, b, a, bb, 0.5, keep=keep)
        with kept.keeping(keep, recompute=True):
            got = _run(lambda *args: lora_linear(*args, keep=keep), x, w, b, a, bb, 0.5)
    assert got[0].data_ptr() == keep.kept[0][0].data_ptr() == forward_y.data_ptr()  # the kept output
    for name, g, e in zip(("y", "dx", "dA", "dB"), got, want, strict=True):
        assert g.dtype == e.dtype, name
        if name != "dx" or case == "fp32-input-bf16-autocast":
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    exact = _input_grad_float64(x, w, a, bb, 0.5, grad_seed=1)
    assert _rel(got[1], exact) <= max(1.25 * _rel(want[1], exact), 1e-6)


def _input_grad_float64(x, w, a, bb, scaling, grad_seed):
    """dx = dy W + s (dy B) A in float64 for the dy `_run` draws, from the operands as the products read them."""
    dtype = torch.bfloat16 if w.dtype == torch.bfloat16 else x.dtype
    dy = torch.randn(*x.shape[:-1], w.shape[0], generator=torch.Generator().manual_seed(grad_seed)).to(x.device, dtype)
    w64, a64, b64 = (t.detach().to(dtype).double() for t in (w, a, bb))
    return dy.double() @ w64 + scaling * (dy.double() @ b64) @ a64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["fp32", "bf16-autocast"])
def test_kept_layers_reading_one_input_sum_its_gradient_once(device, case, monkeypatch):
    """q/k/v-like: three kept LoRA layers read one x, a fourth reads another. x's gradient is summed
    by one `_InputGradient.total` per input and backward pass (three terms for the shared x), close to
    the plain path's (fp32 1e-5; bf16 as close to float64 as autograd's sum); the adapters' gradients
    bit for bit; a second backward through the retained graph gives the same; a reader left out of
    the loss adds nothing."""
    import lightning_ft.kernels.lora as lora

    g = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if case != "fp32" else torch.float32
    x = torch.randn(2, 9, 40, generator=g).to(device, dtype).requires_grad_()
    shapes = [72, 24, 24, 40]  # q, k, v; o reads q's output
    ws = [(torch.randn(n, 40, generator=g) / 40**0.5).to(device, dtype) for n in shapes]
    adapters = [((torch.randn(8, 40, generator=g) / 40**0.5).to(device).requires_grad_(),
                 torch.randn(n, 8, generator=g).to(device).requires_grad_()) for n in shapes]
    totals = []
    monkeypatch.setattr(lora._InputGradient, "total", lambda self, f=lora._InputGradient.total: totals.append(len(self.terms)) or f(self))
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=case != "fp32", cache_enabled=False)

    def forward(keep, readers=3):
        ys = [lora_linear(x, ws[i], None, *adapters[i], 0.5, keep=keep) for i in range(readers)]
        o_in = ys[0][..., :40].contiguous()
        return ys, lora_linear(o_in, ws[3], None, *adapters[3], 0.5, keep=keep)

    o_weight = torch.randn(2, 9, 40, generator=g).to(device)  # (a sum's gradient, expanded ones, takes other GEMM paths on CUDA)

    def loss(ys, o):
        return sum((y.float() * (i + 1)).square().mean() for i, y in enumerate(ys)) + (o.float() * o_weight).sum()

    params = [t for pair in adapters for t in pair]
    with autocast:
        ys, o = forward(None)
        want = torch.autograd.grad(loss(ys, o), [x, *params])
        keep = kept.KeptActivations("projections", allow=lambda nbytes: True)
        with torch.no_grad(), kept.keeping(keep, recompute=False):
            forward(keep)
        with kept.keeping(keep, recompute=True):
            ys, o = forward(keep)
        total = loss(ys, o)
        got = torch.autograd.grad(total, [x, *params], retain_graph=True)
        again = torch.autograd.grad(total, [x, *params])
    assert totals == [1, 3, 1, 3]  # o's input, then the shared x; each backward pass
    for g1, g2 in zip(got, again, strict=True):
        torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    # k's, v's and o's adapters bit for bit; x's gradient and q's adapters (q's output gradient
    # includes o's input gradient, summed otherwise) to rounding
    for name, g1, e in zip(["x", "q.A", "q.B", "k.A", "k.B", "v.A", "v.B", "o.A", "o.B"], got, want, strict=True):
        assert g1.dtype == e.dtype, name
        if name[0] in "kvo":
            torch.testing.assert_close(g1, e, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        elif case == "fp32":
            torch.testing.assert_close(g1, e, rtol=1e-5, atol=1e-5)
        else:
            assert _rel(g1, e) <= 1e-2, name
    # a reader left out of the loss: q and k only, no o
    with autocast:
        keep = kept.KeptActivations("projections", allow=lambda nbytes: True)
        with torch.no_grad(), kept.keeping(keep, recompute=False):
            [lora_linear(x, ws[i], None, *adapters[i], 0.5, keep=keep) for i in range(3)]
        with kept.keeping(keep, recompute=True):
            ys = [lora_linear(x, ws[i], None, *adapters[i], 0.5, keep=keep) for i in range(3)]
        (dx_two,) = torch.autograd.grad(ys[0].float().sum() + ys[1].float().sum(), [x])
        plain = [lora_linear(x, ws[i], None, *adapters[i], 0.5) for i in range(2)]
        (dx_plain,) = torch.autograd.grad(plain[0].float().sum() + plain[1].float().sum(), [x])
    assert totals[-1] == 2
    assert _rel(dx_two, dx_plain) <= (1e-6 if case == "fp32" else 1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["plain", "bias", "grad-mode", "non-contiguous-x"])
@pytest.mark.parametrize("case", ["fp32", "bf16-autocast", "fp32-input-bf16-autocast"])
def test_later_forward_computes_into_the_kept_buffers(device, case, variant):
    """A later forward (the CUDA graphs' recording and replays, without grad) writes y and x Aᵀ
    straight into the first forward's buffers, with the values a plain call gives (bit for bit).
    Where that could not give F.linear's values or autograd, it computes and copies as before: a
    cast autocast would make (an fp32 input under bf16 autocast), a bias, grad mode, a
    non-contiguous x."""
    x, w, b, a, bb = _inputs(device, (3, 19), 40, 72, 8, variant == "bias")
    if variant == "non-contiguous-x":
        x = x.detach().transpose(0, 1).contiguous().transpose(0, 1)  # [3, 19, 40], strides of [19, 3, 40]
    if case != "fp32":
        w, b = w.to(torch.bfloat16), b.to(torch.bfloat16) if b is not None else None
    if case == "bf16-autocast":
        x = x.detach().to(torch.bfloat16)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=case != "fp32", cache_enabled=False)
    keep = kept.KeptActivations("projections", allow=lambda nbytes: True)
    with autocast, torch.set_grad_enabled(variant == "grad-mode"):
        with kept.keeping(keep, recompute=False):
            first_y = lora_linear(x * 0.5, w, b, a, bb, 0.5, keep=keep)
        buffers = tuple(t.detach().clone() for t in keep.kept[0])
        with kept.keeping(keep, recompute=False):
            later_y = lora_linear(x, w, b, a, bb, 0.5, keep=keep)
        want_y = lora_linear(x, w, b, a, bb, 0.5)
        want_h = torch.nn.functional.linear(x, a)
    assert first_y.data_ptr() == keep.kept[0][0].data_ptr()
    computed_into = variant == "plain" and case != "fp32-input-bf16-autocast"
    assert (later_y.data_ptr() == first_y.data_ptr()) == computed_into
    assert not torch.equal(buffers[0], keep.kept[0][0])  # overwritten by the later forward
    torch.testing.assert_close(later_y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(keep.kept[0][0], want_y, rtol=0, atol=0)
    torch.testing.assert_close(keep.kept[0][1], want_h, rtol=0, atol=0)


def _three_readers(device, seed=0):
    """q/k/v-like weights (fp32) and adapters reading one [2, 9, 40] input."""
    g = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(n, 40, generator=g) / 40**0.5).to(device) for n in (72, 24, 24)]
    adapters = [((torch.randn(8, 40, generator=g) / 40**0.5).to(device).requires_grad_(),
                 torch.randn(n, 8, generator=g).to(device).requires_grad_()) for n in (72, 24, 24)]
    dys = [torch.randn(2, 9, n, generator=g).to(device) for n in (72, 24, 24)]
    return ws, adapters, dys


def _read_three(x, ws, adapters, kept_path):
    """The three layers' outputs on x: through a kept forward and its recompute, or the plain path."""
    if not kept_path:
        return [lora_linear(x, w, None, a, b, 0.5) for w, (a, b) in zip(ws, adapters)]
    keep = kept.KeptActivations("projections", allow=lambda nbytes: True)
    with torch.no_grad(), kept.keeping(keep, recompute=False):
        [lora_linear(x, w, None, a, b, 0.5, keep=keep) for w, (a, b) in zip(ws, adapters)]
    with kept.keeping(keep, recompute=True):
        return [lora_linear(x, w, None, a, b, 0.5, keep=keep) for w, (a, b) in zip(ws, adapters)]


@pytest.mark.parametrize("device", DEVICES)
def test_shared_input_gradient_after_a_pass_that_did_not_ask_for_it(device):
    """A backward pass for one adapter alone (retain_graph), then one for x: x's gradient holds each
    reader's terms once (a reader's backward in the first pass must not leave its terms behind)."""
    ws, adapters, dys = _three_readers(device)
    x0 = torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(5)).to(device)
    got = []
    for kept_path in (False, True):
        x = x0.clone().requires_grad_()
        ys = _read_three(x * 1.0, ws, adapters, kept_path)  # a non-leaf x, as the normed hidden states
        loss = sum((y * dy).sum() for y, dy in zip(ys, dys))
        torch.autograd.grad(loss, [adapters[1][0]], retain_graph=True)
        got.append(torch.autograd.grad(loss, [x])[0])
    torch.testing.assert_close(got[1], got[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_shared_input_gradient_frees_a_leaf_input_and_differentiates_again(device):
    """The readers' token does not keep a leaf x alive (x's attribute holds it weakly), and x's summed
    gradient is differentiable (create_graph): a gradient penalty's gradients match the plain path's."""
    import gc
    import weakref

    ws, adapters, dys = _three_readers(device)
    x = torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(5)).to(device).requires_grad_()
    ys = _read_three(x, ws, adapters, kept_path=True)
    sum((y * dy).sum() for y, dy in zip(ys, dys)).backward()
    ref = weakref.ref(x)
    del x, ys
    gc.collect()
    assert ref() is None
    params = [t for pair in adapters for t in pair]
    penalties = []
    for kept_path in (False, True):
        x = torch.randn(2, 9, 40, generator=torch.Generator().manual_seed(5)).to(device).requires_grad_()
        ys = _read_three(x * 1.0, ws, adapters, kept_path)
        (dx,) = torch.autograd.grad(sum((y * dy).sum() for y, dy in zip(ys, dys)), [x], create_graph=True)
        assert dx.requires_grad
        penalties.append(torch.autograd.grad(dx.square().sum(), params))
    for name, g, e in zip(["q.A", "q.B", "k.A", "k.B", "v.A", "v.B"], penalties[1], penalties[0], strict=True):
        assert _rel(g, e) <= 1e-5, name  # fp32, products summed in another order


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_input_and_zero_lora_B(device):
    """No input gradient asked (the first layer reads frozen embeddings); B = 0 (PEFT's init): dA = 0, dB ≠ 0."""
    x, w, b, a, bb = _inputs(device, (9,), 24, 12, 4, False)
    x = x.detach()
    bb = torch.zeros_like(bb).requires_grad_()
    y = lora_linear(x, w, b, a, bb, 2.0)
    torch.testing.assert_close(y, x @ w.t())
    da, db = torch.autograd.grad(y.sum(), (a, bb))
    assert da.abs().max() == 0 and db.abs().max() > 0


def test_a_tensor_hook_on_a_biased_output_runs_and_sees_the_gradient():
    """A tensor hook on the output of a layer with a bias (a user's hook on gpt-oss's q_proj): the in-place
    LoRA add runs on the 2-D product, viewed back after, because an in-place op through a view of F.linear's
    3-D output with a hook on it crashes torch 2.13's autograd (a segfault). In a subprocess, so a crash
    fails this test only. The hook doubles the gradient: x's gradient is twice the hook-free one."""
    import subprocess
    import sys

    code = """
import torch
from lightning_ft.kernels.lora import lora_linear
g = torch.Generator().manual_seed(0)
w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
a, bb = torch.randn(4, 40, generator=g).requires_grad_(), torch.randn(24, 4, generator=g).requires_grad_()
for _ in range(50):
    x = torch.randn(3, 5, 40, generator=g).requires_grad_()
    grads = []
    for hook in (False, True):
        y = lora_linear(x * 1.0, w, b, a, bb, 2.0)
        if hook:
            y.register_hook(lambda grad: grad * 2)
        grads.append(torch.autograd.grad(y.sum(), x)[0])
    torch.testing.assert_close(grads[1], 2 * grads[0])
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["fp32", "bf16-autocast"])
def test_fp8_base_kept_and_shared_input_gradient_match_the_plain_fp8_path(device, case):
    """An e4m3 base (``weight_scale``): the kept recompute returns the forward's y and differentiates as the
    plain fp8 path does (the same `fp8_input_grad` for dy W): y and the adapters' gradients bit for bit, dx
    summed per reader or once for readers of one x (`_InputGradient`) within 1e-5 (fp32) / 1e-2 (bf16)."""
    from lightning_ft.kernels.fp8 import quantize_weight

    x, w, _, a, bb = _inputs(device, (3, 19), 48, 80, 8, False)
    wq, ws = quantize_weight(w)
    if case != "fp32":
        x = x.detach().to(torch.bfloat16).requires_grad_()
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=case != "fp32", cache_enabled=False)

    def layer(*args, keep=None):
        return lora_linear(*args, keep=keep, weight_scale=ws)

    for readers in (1, 3):  # one reader: dx per layer; three: summed once
        def run(keep=None):
            ys = [layer(x, wq, None, a, bb, 0.5, keep=keep) for _ in range(readers)]
            grads = torch.autograd.grad(sum(y.float().square().sum() for y in ys), (x, a, bb))
            return ys[0], *grads

        keep = kept.KeptActivations("projections", allow=lambda nbytes: True)
        with autocast:
            want = run()
            with torch.no_grad(), kept.keeping(keep, recompute=False):
                [layer(x, wq, None, a, bb, 0.5, keep=keep) for _ in range(readers)]
            with kept.keeping(keep, recompute=True):
                got = run(keep)
        assert got[0].data_ptr() == keep.kept[0][0].data_ptr()  # the kept output, no product run
        for name, g, e in zip(("y", "dx", "dA", "dB"), got, want, strict=True):
            assert g.dtype == e.dtype, name
            if name == "dx":
                assert _rel(g, e) <= (1e-5 if case == "fp32" else 1e-2), name
            else:
                torch.testing.assert_close(g, e, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
