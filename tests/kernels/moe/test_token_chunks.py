"""The experts over the tokens in chunks (`lightning_ft.kernels.moe.token_chunks`) against the same backend on the whole
row and the float64 reference: output and every gradient, with grad and without, with the output needed or not (a
recompute), chunks that do not divide the row; and what the chunked backward holds at a time."""

import math

import pytest
import torch

import lightning_ft.kernels.moe.token_chunks as token_chunks
from lightning_ft.kernels.moe import BACKENDS, ExpertBiases
from lightning_ft.kernels.moe.token_chunks import auto_chunk_tokens, moe_experts_in_chunks
from moe_cases import CASES, DEVICES, _assert_close, _loras, _make, _reference_run, _run, _skip_unless_runnable, _trainable, _weights, gpt_oss_act


def _run_chunked(backend, case, topk_idx, tensors, dtype, grad_out, chunk_tokens, output_needed=True, trainable=None):
    """`moe_cases._run` through `moe_experts_in_chunks` (grad_out None: a forward without grad)."""
    trainable = _trainable(case) if trainable is None else trainable
    t = {name: v.detach().to(dtype).requires_grad_(name in trainable) for name, v in tensors.items()}
    gate_up_lora, down_lora = _loras(case, t)
    with torch.set_grad_enabled(grad_out is not None):
        out = moe_experts_in_chunks(
            t["x"], t["topk_weight"], topk_idx, case.experts, *_weights(case, t),
            gpt_oss_act(dtype) if case.gpt_oss else torch.nn.SiLU(), chunk_tokens=chunk_tokens,
            gate_up_lora=gate_up_lora, down_lora=down_lora, backend=backend, output_needed=output_needed,
            biases=ExpertBiases(t["b_gate_up"], t["b_down"]) if case.gpt_oss else ExpertBiases(),
        )  # fmt: skip
    if grad_out is None:
        return out, {}
    out.backward(grad_out.to(dtype))
    return out, {name: t[name].grad for name in trainable}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("output_needed", [True, False], ids=["output", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case_name", ["odd_sizes", "full_finetune", "gpt_oss", "gpt_oss_odd_full"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_give_the_whole_row_s_output_and_gradients(backend, case_name, dtype, output_needed, device):
    """Chunks of 4 tokens (the last one shorter) against the backend on the whole row: fp32 to summation order
    (the LoRA and bias gradients are sums over the chunks), bf16 within the backends' tolerance of the float64
    reference; the output likewise where it is needed (else zeros, as the backend's own unneeded output)."""
    _skip_unless_runnable(backend, device)
    case = CASES[case_name]
    topk_idx, tensors = _make(case, device)
    grad_out = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(1)).to(device)
    whole, whole_grads = _run(backend, case, topk_idx, tensors, dtype, grad_out, output_needed=output_needed)
    out, grads = _run_chunked(backend, case, topk_idx, tensors, dtype, grad_out, chunk_tokens=4, output_needed=output_needed)
    assert out.shape == whole.shape and out.dtype == dtype
    ref_out, ref_grads = _reference_run(case, topk_idx, tensors, grad_out, dtype)
    if not output_needed:  # zeros, computed by no expert (native_torch's whole row computes its output anyway)
        assert not out.any()
    elif dtype == torch.float32:  # per token the same math; a GEMM's blocking may differ with its row count
        torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)
    else:
        _assert_close(out, ref_out, dtype, "output")
    assert grads.keys() == whole_grads.keys()
    for name, grad in grads.items():
        assert grad is not None and grad.dtype == dtype, name
        if dtype == torch.float32:
            scale = whole_grads[name].abs().max().clamp_min(1e-12)  # summation order: relative to the tensor's range
            torch.testing.assert_close(grad / scale, whole_grads[name] / scale, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
        else:
            _assert_close(grad, ref_grads[name], dtype, f"grad of {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_without_grad_the_chunks_write_the_whole_output(backend, device):
    _skip_unless_runnable(backend, device)
    case = CASES["gpt_oss"]
    topk_idx, tensors = _make(case, device)
    whole, _ = _run(backend, case, topk_idx, tensors, torch.float32, None)
    for chunk_tokens in (1, 5, case.tokens, case.tokens + 3):
        out, _ = _run_chunked(backend, case, topk_idx, tensors, torch.float32, None, chunk_tokens)
        torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6, msg=lambda m: f"chunk_tokens={chunk_tokens}: {m}")
    unneeded, _ = _run_chunked(backend, case, topk_idx, tensors, torch.float32, None, 5, output_needed=False)
    assert unneeded.shape == whole.shape and not unneeded.any()


@pytest.mark.parametrize("trainable", [("x",), ("topk_weight", "gate_up_B"), ("down_A",)])
def test_only_what_requires_grad_gets_a_gradient(trainable):
    case = CASES["e6_top1_empty"]
    topk_idx, tensors = _make(case, "cpu")
    grad_out = torch.randn(case.tokens, case.hidden).to("cpu")
    _, expected = _reference_run(case, topk_idx, tensors, grad_out)
    _, grads = _run_chunked("native_torch", case, topk_idx, tensors, torch.float32, grad_out, 3, trainable=trainable)
    for name in trainable:
        _assert_close(grads[name], expected[name], torch.float32, name)


def test_the_recompute_runs_the_experts_once_in_backward_one_chunk_at_a_time(monkeypatch):
    """With the output unneeded the forward runs no expert; the backward runs each chunk (≤ chunk_tokens tokens,
    routed on its own) once and differentiates it before the next runs: one chunk's graph alive at a time."""
    case = CASES["base"]
    topk_idx, tensors = _make(case, "cpu")
    calls, alive = [], []
    real = token_chunks.moe_experts

    def moe_experts(x_TD, *args, **kwargs):
        calls.append((x_TD.shape[0], torch.is_grad_enabled(), kwargs["output_needed"]))
        out = real(x_TD, *args, **kwargs)
        if out.requires_grad:
            alive.append(out)
            del alive[:-1]
        return out

    monkeypatch.setattr(token_chunks, "moe_experts", moe_experts)
    grad_out = torch.randn(case.tokens, case.hidden)
    t = {name: v.detach().requires_grad_(name in _trainable(case)) for name, v in tensors.items()}
    gate_up_lora, down_lora = _loras(case, t)
    out = moe_experts_in_chunks(t["x"], t["topk_weight"], topk_idx, case.experts, *_weights(case, t), torch.nn.SiLU(),
                                chunk_tokens=6, gate_up_lora=gate_up_lora, down_lora=down_lora, backend="native_torch",
                                output_needed=False)  # fmt: skip
    assert calls == [] and not out.any()
    out.backward(grad_out)
    assert calls == [(6, True, False), (6, True, False), (4, True, False)]
    assert all(t[name].grad is not None for name in _trainable(case))


def test_auto_chunk_tokens_fits_the_gate_up_output_in_the_budget():
    # gpt-oss-20b: top-4, F = 5760, bf16: 46,603 tokens fit 2 GiB (32K tokens run whole), 46,592 a multiple of 128;
    # Qwen3-30B-A3B: top-8, F = 1536
    assert 2 * 1024**3 // (4 * 5760 * 2) == 46603 and auto_chunk_tokens(4, 5760, 2) == 46592
    assert auto_chunk_tokens(8, 1536, 2) == 87296
    assert auto_chunk_tokens(4, 5760, 2, chunk_bytes=4 * 5760 * 2 * 100) == 100  # under 128: as it is
    assert auto_chunk_tokens(4, 5760, 2, chunk_bytes=1) == 1
    with pytest.raises(ValueError, match="chunk_tokens must be a positive number of tokens, got 0"):
        case = CASES["base"]
        topk_idx, tensors = _make(case, "cpu")
        _run_chunked("native_torch", case, topk_idx, tensors, torch.float32, None, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
def test_the_chunked_backward_needs_a_fraction_of_the_whole_row_s_memory(backend):
    """gpt-oss-20b's expert sizes (32 experts top-4, D = I = 2880) at 16K tokens, bf16, the graphs' recompute
    (output unneeded): the backward's peak above its inputs with 8 chunks is under a third of the whole row's."""
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k, rank = 16384, 2880, 2880, 32, 4, 16
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(tokens, hidden, device=dev, dtype=bf16, requires_grad=True)
    weight = torch.rand(tokens, top_k, device=dev, dtype=bf16, requires_grad=True)
    idx = torch.rand(tokens, experts, device=dev).argsort(-1)[:, :top_k]
    w_gate_up = torch.randn(experts, hidden, 2 * inter, device=dev, dtype=bf16) * hidden**-0.5
    w_down = torch.randn(experts, inter, hidden, device=dev, dtype=bf16) * inter**-0.5
    from lightning_ft.kernels.moe import ClampedSwiGLU, ExpertLoRA

    def lora(c, n):
        a = (torch.randn(experts * rank, c, device=dev, dtype=bf16) * 0.01).requires_grad_()
        return ExpertLoRA(a, (torch.randn(n, rank * experts, device=dev, dtype=bf16) * 0.01).requires_grad_(), 2.0, experts)

    loras = dict(gate_up_lora=lora(hidden, 2 * inter), down_lora=lora(inter, hidden))
    grad_out = torch.randn(tokens, hidden, device=dev, dtype=bf16)
    peaks, grads = {}, {}
    for chunk_tokens in (tokens, tokens // 8):
        x.grad = weight.grad = None
        for lo in loras.values():
            lo.lora_A.grad = lo.lora_B.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = moe_experts_in_chunks(x, weight, idx, experts, w_gate_up.transpose(1, 2), w_down.transpose(1, 2),
                                    ClampedSwiGLU(1.702, 7.0), chunk_tokens=chunk_tokens, backend=backend,
                                    output_needed=False, **loras)  # fmt: skip
        out.backward(grad_out)
        torch.cuda.synchronize()
        peaks[chunk_tokens] = torch.cuda.max_memory_allocated() - base
        grads[chunk_tokens] = [x.grad.clone(), weight.grad.clone(), *(t.grad.clone() for lo in loras.values() for t in lo[:2])]
    assert peaks[tokens // 8] < peaks[tokens] / 3, {k: v / 2**30 for k, v in peaks.items()}
    for got, want in zip(grads[tokens // 8], grads[tokens]):
        assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()
    assert math.isfinite(peaks[tokens])
