"""Chunked linear cross-entropy vs the materialised reference (HF's logits.float() math).

Tolerances, kernel vs reference in the same dtype:
    loss sum    fp32 rtol 1e-5         bf16 rtol 1e-3   (same bf16 logits; only the fp32 reduction
                                                         order differs)
    dhidden     fp32 atol/rtol 1e-5    bf16 atol/rtol 2e-2 (dz is rounded to bf16 in both; the
                                                         chunked matmuls accumulate in another order)
    dweight     fp32 1e-5              bf16 2e-2 of its largest value (accumulated across chunks in
                                                         bf16, as peers do)
Under the CPU interpreter bf16 sits up to an ulp further: it truncates fp32 -> bf16 where the GPU
rounds to nearest even.

An e4m3 head (``weight_scale``: strategy.fp8_lm_head) against its reference (`fp8_linear_reference`'s logits, the
same quantised operands in fp32): loss as above; dhidden within 1e-4 (fp32) and 2e-2 (bf16) relative (Frobenius): a
value a rounding apart before quantisation can land an e4m3 step (2⁻⁴ relative) apart. Against the bf16 head it
was quantised from (the fp8 error itself): loss within 1%, dhidden within 8% relative (each fp8 product is ~4% off).
"""

import pytest
import torch

from lightning_ft.kernels.fp8 import quantize_weight
from lightning_ft.kernels.linear_cross_entropy import fused_linear_cross_entropy, linear_cross_entropy_reference

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-3, 2e-2)}  # dtype -> (loss rtol, grad tol)


def _inputs(n_tokens, hidden, vocab, dtype, device, ignored=0.25, train_head=True):
    torch.manual_seed(0)
    h = torch.randn(n_tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(dtype).requires_grad_(train_head)
    labels = torch.randint(0, vocab, (n_tokens,), device=device)
    labels[torch.rand(n_tokens, device=device) < ignored] = -100
    return h, w, labels


def _run(fn, h, w, labels, **kwargs):
    loss, n_targets = fn(h, w, labels, **kwargs)
    (loss * 0.5).backward()  # a grad_output other than 1 must reach the precomputed gradients
    grads = h.grad, w.grad
    h.grad = w.grad = None
    return loss.detach(), n_targets, *grads


def _check(h, w, labels, **kwargs):
    loss, n_targets, dh, dw = _run(fused_linear_cross_entropy, h, w, labels, **kwargs)
    loss_ref, n_ref, dh_ref, dw_ref = _run(linear_cross_entropy_reference, h, w, labels, softcap=kwargs.get("softcap"))
    loss_tol, tol = TOL[h.dtype]
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert n_targets.dtype == torch.int64 and n_targets.dim() == 0 and n_targets.item() == n_ref.item()
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=loss_tol)
    torch.testing.assert_close(dh, dh_ref, atol=tol, rtol=tol)
    if w.requires_grad:
        torch.testing.assert_close(dw, dw_ref, atol=tol * dw_ref.abs().max().item(), rtol=tol)
    else:
        assert dw is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n_tokens, hidden, vocab, chunk_size, softcap, train_head",
    [
        (37, 48, 1000, None, None, False),  # one chunk, frozen head (LoRA)
        (37, 48, 1000, 8, None, True),  # several chunks, a ragged last one, trainable head
        (21, 32, 777, 5, 30.0, True),  # softcapping, odd vocab
        (1, 32, 500, None, None, True),  # a single token
    ],
)
def test_matches_reference(device, dtype, n_tokens, hidden, vocab, chunk_size, softcap, train_head):
    ignored = 0.25 if n_tokens > 1 else 0.0
    h, w, labels = _inputs(n_tokens, hidden, vocab, dtype, device, ignored=ignored, train_head=train_head)
    _check(h, w, labels, chunk_size=chunk_size, softcap=softcap)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n_tokens, hidden, vocab, chunk_size, softcap",
    [
        (37, 48, 1000, None, None),  # one chunk
        (37, 64, 1024, 8, None),  # several chunks, a ragged last one; multiples of 16 (_scaled_mm on the GPU in bf16)
        (21, 32, 777, 5, 30.0),  # softcapping, odd vocab
        (1, 32, 500, None, None),  # a single token
    ],
)
def test_e4m3_head_matches_its_reference_and_stays_near_the_bf16_head(device, dtype, n_tokens, hidden, vocab, chunk_size, softcap):
    h, w, labels = _inputs(n_tokens, hidden, vocab, dtype, device, ignored=0.25 if n_tokens > 1 else 0.0, train_head=False)
    w_q, w_scale = quantize_weight(w)
    kwargs = dict(softcap=softcap, weight_scale=w_scale)
    loss, n_targets, dh, dw = _run(fused_linear_cross_entropy, h, w_q, labels, chunk_size=chunk_size, **kwargs)
    loss_ref, n_ref, dh_ref, _ = _run(linear_cross_entropy_reference, h, w_q, labels, **kwargs)
    assert dw is None and n_targets.item() == n_ref.item() and dh.dtype == dtype
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=TOL[dtype][0])
    assert _rel(dh, dh_ref) <= (1e-4 if dtype == torch.float32 else 2e-2)
    loss_bf16, _, dh_bf16, _ = _run(linear_cross_entropy_reference, h, w, labels, softcap=softcap)
    assert abs(loss.item() - loss_bf16.item()) <= 0.01 * abs(loss_bf16.item()) and _rel(dh, dh_bf16) <= 0.08


def test_e4m3_head_needs_e4m3_weights_and_fp32_scales(device):
    h, w, labels = _inputs(5, 32, 64, torch.float32, device, train_head=False)
    w_q, w_scale = quantize_weight(w)
    with pytest.raises(ValueError, match="e4m3 head needs weight"):
        fused_linear_cross_entropy(h, w, labels, weight_scale=w_scale)  # a bf16 weight
    with pytest.raises(ValueError, match=r"weight_scale \[V\] fp32"):
        fused_linear_cross_entropy(h, w_q, labels, weight_scale=w_scale[:10])


def test_qwen_vocab_few_tokens(device):
    # vocab 151936 (Qwen) is cheap enough under the interpreter with a handful of tokens.
    h, w, labels = _inputs(3, 16, 151936, torch.float32, device, ignored=0.0)
    _check(h, w, labels)


@pytest.mark.parametrize("train_head", [False, True])
def test_all_labels_ignored(device, train_head):
    h, w, labels = _inputs(9, 32, 300, torch.float32, device, ignored=1.0, train_head=train_head)
    loss, n_targets, dh, dw = _run(fused_linear_cross_entropy, h, w, labels, chunk_size=4)
    assert loss.item() == 0.0 and n_targets.item() == 0
    assert torch.count_nonzero(dh) == 0 and not dh.isnan().any()
    if train_head:
        assert torch.count_nonzero(dw) == 0


def test_no_grad_returns_the_same_loss(device):
    h, w, labels = _inputs(20, 32, 300, torch.float32, device)
    with torch.no_grad():
        loss, n_targets = fused_linear_cross_entropy(h, w, labels, chunk_size=8)
    loss_ref, n_ref = linear_cross_entropy_reference(h, w, labels)
    assert loss.grad_fn is None and n_targets.item() == n_ref.item()
    torch.testing.assert_close(loss, loss_ref.detach(), atol=1e-5, rtol=1e-5)


def test_autocast_computes_in_the_autocast_dtype(device):
    # fp32 hidden and head under bf16 autocast: the logits are bf16 like autocast's nn.Linear.
    h, w, labels = _inputs(20, 32, 300, torch.float32, device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss, n_targets, dh, dw = _run(fused_linear_cross_entropy, h, w, labels, chunk_size=8)
        loss_ref, _, dh_ref, dw_ref = _run(linear_cross_entropy_reference, h, w, labels)
    assert dh.dtype == torch.float32 and dw.dtype == torch.float32
    torch.testing.assert_close(loss, loss_ref, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(dh, dh_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dw, dw_ref, atol=2e-2 * dw_ref.abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
def test_qwen_vocab_on_gpu_and_no_host_sync():
    h, w, labels = _inputs(1024, 2048, 151936, torch.bfloat16, torch.device("cuda"), train_head=False)
    _check(h, w, labels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _ = fused_linear_cross_entropy(h, w, labels)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_e4m3_qwen_head_on_hopper_matches_its_reference_without_host_sync():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the e4m3 head's _scaled_mm needs sm90+")
    h, w, labels = _inputs(1024, 2048, 151936, torch.bfloat16, torch.device("cuda"), train_head=False)
    w_q, w_scale = quantize_weight(w)
    loss, _, dh, _ = _run(fused_linear_cross_entropy, h, w_q, labels, weight_scale=w_scale)
    loss_ref, _, dh_ref, _ = _run(linear_cross_entropy_reference, h, w_q, labels, weight_scale=w_scale)
    torch.testing.assert_close(loss, loss_ref, atol=1e-5, rtol=1e-3)
    assert _rel(dh, dh_ref) <= 2e-2
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _ = fused_linear_cross_entropy(h, w_q, labels, weight_scale=w_scale)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
def test_peak_memory_is_an_eighth_of_the_materialised_version():
    # The Qwen3 head at 16K tokens: T=16384, vocab 151936, hidden 2048, bf16, frozen head; the fused
    # version must peak at no more than an eighth of the materialised [T, V] logits' memory.
    h, w, labels = _inputs(16384, 2048, 151936, torch.bfloat16, torch.device("cuda"), train_head=False)
    peaks = []
    for fn in (fused_linear_cross_entropy, linear_cross_entropy_reference):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss, _ = fn(h, w, labels)
        loss.backward()
        h.grad = None
        del loss
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[0] * 8 <= peaks[1], f"fused {peaks[0] / 2**20:.0f} MiB vs materialised {peaks[1] / 2**20:.0f} MiB"
