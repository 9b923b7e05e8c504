"""4-bit dequantisation (kernels/nf4.py) against bitsandbytes, the QLoRA linear (kernels/qlora.py) against its
reference, and NF4 expert weights (dequantised into the reused buffer) in the Triton grouped GEMM against the dense
GEMM. The e4m3 dequantisation
and the QLoRA linear with fp8 products (strategy.fp8 over a 4-bit base) against quantize_rows / the fp8 linear's
math and the bf16 QLoRA linear:
    python -m pytest -q tests/kernels/test_nf4.py -k "e4m3 or fp8"                       (CPU: the torch reference)
    TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_nf4.py -k "e4m3 or fp8"    (CPU: the Triton kernel)
    python -m pytest -q -m gpu tests/kernels/test_nf4.py -k "e4m3 or fp8"                (GPU; _scaled_mm on sm90+)"""

import pytest
import torch

from lightning_ft.kernels.fp8 import E4M3, attach_fp8_rows, quantize_rows_reference
from lightning_ft.kernels.lora import lora_linear
from lightning_ft.kernels.nf4 import (
    Nf4ExpertWeight, Quant4bitWeight, dequantize_4bit, dequantize_4bit_reference, e4m3_scales_4bit,
)
from lightning_ft.kernels.qlora import qlora_linear, qlora_linear_reference
from packed_weight_checks import assert_grouped_gemm_reads

BF = pytest.importorskip("bitsandbytes.functional", reason='bitsandbytes is the reference: pip install -e ".[qlora]"')

# odd sizes: a last block shorter than 64, an odd element count (a half-used last byte), one element,
# blocks straddling rows, more than 256 blocks (two nested scales), several Triton programs
SHAPES = [(5, 13), (64, 64), (3, 1000), (7, 333), (1, 1), (96, 64), (130, 200)]


def _quantize(shape, quant_type, nested, dtype, device, seed=0):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype) * 0.05 + 0.01
    packed, state = BF.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=nested)
    return packed, state


def _bnb_dequantize(packed, state):
    """bitsandbytes' dequantize_4bit; on the CPU its generic op, the one its CPU kernel falls back to: that kernel
    (bitsandbytes 0.50.2, rows of an even length) misplaces blocks where the row length is an odd multiple of 32
    ([64, 96]: errors of 2.0 against the weight, 0.46 through the generic op, CUDA's kernel or ours)."""
    if packed.is_cuda:
        return BF.dequantize_4bit(packed, state)
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    absmax = BF.dequantize_blockwise(state.absmax, state.state2) + state.offset if state.nested else state.absmax
    return _dequantize_4bit_compute(packed.view(-1), absmax.float(), state.code, state.blocksize, state.shape, state.dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("quant_type", "nested", "dtype"), [
    ("nf4", True, torch.bfloat16), ("nf4", True, torch.float16), ("nf4", True, torch.float32), ("nf4", False, torch.bfloat16),
    ("fp4", False, torch.bfloat16),
])  # fmt: skip
def test_dequantize_is_bitwise_bitsandbytes(device, shape, quant_type, nested, dtype):
    packed, state = _quantize(shape, quant_type, nested, dtype, device)
    expected = _bnb_dequantize(packed, state)
    weight = Quant4bitWeight.from_quant_state(packed, state)
    assert torch.equal(dequantize_4bit_reference(weight, dtype), expected)
    got = dequantize_4bit(weight, dtype, reuse=False)
    assert got.shape == shape and got.dtype == dtype and torch.equal(got, expected)


def test_reference_is_bitwise_bitsandbytes_cpu_kernel_where_that_kernel_is_right():
    """The CPU kernel's own path (even row lengths that are multiples of 64), and the bug `_bnb_dequantize` avoids."""
    for shape in [(64, 128), (3, 1000)]:
        packed, state = _quantize(shape, "nf4", True, torch.bfloat16, "cpu")
        reference = dequantize_4bit_reference(Quant4bitWeight.from_quant_state(packed, state), torch.bfloat16)
        assert torch.equal(reference, BF.dequantize_4bit(packed, state))


def test_dequantize_reuses_one_buffer(device):
    small, big = (_quantize(s, "nf4", True, torch.bfloat16, device, seed=i) for i, s in enumerate([(8, 64), (64, 96)]))
    first = dequantize_4bit(Quant4bitWeight.from_quant_state(*big), torch.bfloat16)
    second = dequantize_4bit(Quant4bitWeight.from_quant_state(*small), torch.bfloat16)
    assert second.data_ptr() == first.data_ptr()  # the smaller weight lands in the start of the same buffer
    assert torch.equal(second, _bnb_dequantize(*small))


@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast"])
def test_qlora_linear_matches_its_reference_forward_and_backward(device, precision):
    """x, A and B gradients of `qlora_linear` (dequantised again in the backward, from a buffer another weight
    overwrote in between) against autograd through the reference; fp32: to rounding; bf16: to bf16 rounding."""
    packed, state = _quantize((48, 64), "nf4", True, torch.float32, device)
    weight = Quant4bitWeight.from_quant_state(packed, state)
    other = Quant4bitWeight.from_quant_state(*_quantize((64, 64), "nf4", True, torch.float32, device, seed=1))
    gen = torch.Generator().manual_seed(2)
    x, lora_A, lora_B, bias, dy = (torch.randn(s, generator=gen).to(device) for s in [(2, 5, 64), (4, 64), (48, 4), (48,), (2, 5, 48)])
    results = []
    for fn in (qlora_linear, qlora_linear_reference):
        leaves = [t.clone().requires_grad_() for t in (x, lora_A, lora_B)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision != "fp32"):
            y = fn(leaves[0], weight, bias, leaves[1], leaves[2], 0.5)
        dequantize_4bit(other, y.dtype)  # the shared buffer now holds another weight
        y.backward(dy)
        results.append((y.float(), *(t.grad for t in leaves)))
    tol = 1e-5 if precision == "fp32" else 2e-2
    for got, expected in zip(*results):
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())


@pytest.mark.gpu
def test_dequantize_matches_bitsandbytes_cuda_kernel_on_model_shapes():
    """Qwen3-14B's projection shapes through bitsandbytes' CUDA kernel (also the row lengths its CPU kernel misplaces)."""
    for shape in [(5120, 5120), (1024, 5120), (17408, 5120), (5120, 17408), (64, 96)]:
        packed, state = _quantize(shape, "nf4", True, torch.bfloat16, "cuda")
        got = dequantize_4bit(Quant4bitWeight.from_quant_state(packed, state), torch.bfloat16)
        assert torch.equal(got, BF.dequantize_4bit(packed, state)), shape


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_qlora_linear_makes_no_host_sync_on_cuda(fp8):
    weight = Quant4bitWeight.from_quant_state(*_quantize((1024, 512), "nf4", True, torch.bfloat16, "cuda"))
    if fp8 and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs sm90+ (row-wise torch._scaled_mm)")
    scale = e4m3_scales_4bit(weight) if fp8 else None
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    lora_A = torch.randn(16, 512, device="cuda", requires_grad=True)
    lora_B = torch.randn(1024, 16, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        # warm-up: Triton compiles, the buffer grows
        qlora_linear(x, weight, None, lora_A, lora_B, 2.0, fp8_scale=scale).sum().backward()
        torch.cuda.set_sync_debug_mode("error")
        try:
            qlora_linear(x, weight, None, lora_A, lora_B, 2.0, fp8_scale=scale).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _expert_weight(shape, dtype, device, seed=0):
    return Nf4ExpertWeight.from_quant_state(*_quantize(shape, "nf4", True, dtype, device, seed), dtype)


# an odd element count with blocks straddling rows and experts; more than 256 blocks (two absmax2 scales)
@pytest.mark.parametrize("shape", [(3, 7, 37), (5, 70, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_expert_weight_in_the_buffer_is_bitwise_the_reference_and_bitsandbytes(device, shape, dtype):
    """`Nf4ExpertWeight.dense_in_buffer`: the whole weight dequantised into the reused buffer (where a 2-D weight's
    dequantisation lands), bitwise `dequantize` and bitsandbytes'; transposed, the same buffer viewed transposed."""
    packed, state = _quantize(shape, "nf4", True, dtype, device)
    weight = Nf4ExpertWeight.from_quant_state(packed, state, dtype)
    reference = dequantize_4bit_reference(weight.quant4bit(), dtype)
    assert torch.equal(weight.dequantize(), reference) and torch.equal(reference, _bnb_dequantize(packed, state))
    dense = weight.dense_in_buffer()
    assert dense.shape == shape and dense.dtype == dtype and dense.is_contiguous() and torch.equal(dense, reference)
    other = dequantize_4bit(Quant4bitWeight.from_quant_state(*_quantize((2, 64), "nf4", True, dtype, device, seed=1)), dtype)
    assert other.data_ptr() == dense.data_ptr()  # the buffer the other weights use: dense until the next dequantisation
    flipped = weight.transpose(1, 2).dense_in_buffer()
    assert flipped.data_ptr() == dense.data_ptr() and flipped.stride() == reference.transpose(1, 2).stride()
    assert torch.equal(flipped, reference.transpose(1, 2))


@pytest.mark.gpu
def test_expert_weight_in_the_buffer_matches_bitsandbytes_cuda_kernel_on_qwen3_30b_a3b_shapes():
    """One layer's experts of Qwen3-30B-A3B (gate_up [128, 1536, 2048], down [128, 2048, 768]) in bf16, quantised by
    bitsandbytes on the GPU: `dense_in_buffer` is bitwise its CUDA dequantisation."""
    for shape in [(128, 1536, 2048), (128, 2048, 768)]:
        packed, state = _quantize(shape, "nf4", True, torch.bfloat16, "cuda")
        weight = Nf4ExpertWeight.from_quant_state(packed, state, torch.bfloat16)
        assert torch.equal(weight.dense_in_buffer(), BF.dequantize_4bit(packed, state)), shape
        del packed, state, weight


def test_expert_weight_views_bytes_and_errors():
    """[E, N, C] stored, its transpose a view (the same tensors, last two dims swapped); QLoRA's bytes: n/2 + n/64
    (+ 4 per 256 blocks + the 273 table entries); other quantisations are refused."""
    weight = _expert_weight((4, 48, 64), torch.bfloat16, "cpu")
    n = 4 * 48 * 64
    flipped = weight.transpose(1, 2)
    assert weight.shape == (4, 48, 64) and flipped.shape == (4, 64, 48) and flipped.packed is weight.packed
    assert not flipped.transpose(1, 2).transposed
    assert torch.equal(flipped.dequantize(), weight.dequantize().transpose(1, 2))
    assert (weight.packed.numel(), weight.absmax.numel(), weight.absmax2.numel(), weight.tables.numel()) == (n // 2, n // 64, 1, 273)
    with pytest.raises(ValueError, match="last two dims"):
        weight.transpose(0, 1)
    for shape, nested, quant_type in [((48, 64), True, "nf4"), ((4, 48, 64), False, "nf4"), ((4, 48, 64), True, "fp4")]:
        with pytest.raises(ValueError, match="3-D NF4 weight in blocks of 64 with double quantisation"):
            Nf4ExpertWeight.from_quant_state(*_quantize(shape, quant_type, nested, torch.float32, "cpu"), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("contract_stored_rows", [False, True], ids=["forward", "input_grad"])
def test_grouped_gemm_reads_nf4_expert_weights(device, dtype, contract_stored_rows):
    """The Triton grouped GEMM on an `Nf4ExpertWeight` (x·Wᵀ, contracting the stored weight's last dim, as the
    forward reads it; dy·W, contracting its rows, as the input gradient reads it) dequantises it into the reused
    buffer and is bitwise the same call on the dequantised dense weight, on every device, and the plain-torch
    reference's result to rounding (`assert_grouped_gemm_reads`: gather, scatter, routing weights, LoRA, bias,
    groups of 9, 0, 14, 3 rows; fp32: 1e-5; bf16: the bf16 output's rounding)."""
    from lightning_ft.kernels import _utils

    stored = _expert_weight((4, 37, 70), dtype, device)  # [E, N, C]: C = 70 straddles the 64-blocks
    w_ECN = stored if contract_stored_rows else stored.transpose(1, 2)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    assert_grouped_gemm_reads(w_ECN, device, dtype, tolerance, bitwise_everywhere=True)
    in_buffer = _utils._BUFFERS[(stored.packed.device, dtype)][: 4 * 37 * 70]  # what the first call dequantised there
    assert torch.equal(in_buffer.view(4, 37, 70), stored.dequantize())


def _e4m3_reference(weight):
    """quantize_rows_reference of the fp32 reference dequantisation: (e4m3 bytes, scales)."""
    q, scale = quantize_rows_reference(dequantize_4bit_reference(weight, torch.float32))
    return q.view(torch.uint8), scale


def _outlier_rows(packed, state):
    """A weight with an all-zero row (the scale floor) and a row with one outlier (its other values near e4m3's
    subnormals and flush to zero), quantised like the others."""
    w = _bnb_dequantize(packed, state).float()
    w[0] = 0.0
    w[-1, 0] = 40.0
    return BF.quantize_4bit(w.to(packed.device), blocksize=64, quant_type="nf4", compress_statistics=state.nested)


@pytest.mark.parametrize("shape", [(5, 13), (3, 1000), (7, 333), (1, 1), (130, 200)])
@pytest.mark.parametrize("nested", [True, False], ids=["double_quant", "fp32_absmax"])
def test_e4m3_dequantize_is_bitwise_quantize_rows_of_the_fp32_dequantisation(device, shape, nested):
    """The kernel's e4m3 output (the reused e4m3 buffer) and its scales against quantize_rows_reference of the fp32
    reference dequantisation: bit for bit (odd shapes, blocks straddling rows, a zero row, an outlier row)."""
    packed, state = _quantize(shape, "nf4", nested, torch.float32, device)
    if shape[0] > 1:
        packed, state = _outlier_rows(packed, state)
    weight = Quant4bitWeight.from_quant_state(packed, state)
    expected_q, expected_scale = _e4m3_reference(weight)
    scale = e4m3_scales_4bit(weight)
    assert scale.dtype == torch.float32 and torch.equal(scale.cpu(), expected_scale.cpu())
    got = dequantize_4bit(weight, E4M3, fp8_scale=scale)
    assert got.shape == shape and got.dtype == E4M3 and torch.equal(got.view(torch.uint8).cpu(), expected_q.cpu())


def test_e4m3_dequantize_reference_path_and_argument_errors(monkeypatch):
    """Where Triton cannot run (the CPU without the interpreter) the torch reference gives the same bytes; e4m3 needs
    a 2-D weight and its [N] scales, other dtypes take none."""
    import lightning_ft.kernels.nf4 as nf4

    monkeypatch.setattr(nf4, "triton_can_run", lambda t: False)
    packed, state = _outlier_rows(*_quantize((6, 100), "nf4", True, torch.float32, "cpu"))
    weight = Quant4bitWeight.from_quant_state(packed, state)
    expected_q, expected_scale = _e4m3_reference(weight)
    with pytest.warns(UserWarning, match="using the plain-torch reference"):
        got = dequantize_4bit(weight, E4M3, fp8_scale=e4m3_scales_4bit(weight), reuse=False)
    assert torch.equal(got.view(torch.uint8), expected_q)
    with pytest.raises(ValueError, match=r"e4m3 takes a 2-D weight and its \[N\] fp32 fp8_scale"):
        dequantize_4bit(weight, E4M3)
    with pytest.raises(ValueError, match="other dtypes none"):
        dequantize_4bit(weight, torch.bfloat16, fp8_scale=expected_scale)
    with pytest.raises(ValueError, match=r"fp8_scale \(5,\)"):
        dequantize_4bit(weight, E4M3, fp8_scale=expected_scale[:5])


def _qlora_operands(device, shape=(48, 64), tokens=(2, 5)):
    packed, state = _quantize(shape, "nf4", True, torch.float32, device)
    weight = Quant4bitWeight.from_quant_state(packed, state)
    gen = torch.Generator().manual_seed(2)
    n, k = shape
    x, lora_A, lora_B, bias, dy = (
        torch.randn(s, generator=gen).to(device) for s in [(*tokens, k), (4, k), (n, 4), (n,), (*tokens, n)]
    )
    return weight, x, lora_A, lora_B, bias, dy


def _fwd_bwd(fn, x, lora_A, lora_B, dy, autocast):
    leaves = [t.clone().requires_grad_() for t in (x, lora_A, lora_B)]
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = fn(*leaves)
    y.backward(dy)
    return [y.float(), *(t.grad.float() for t in leaves)]


def test_qlora_linear_in_fp8_is_the_fp8_linear_math_on_the_dequantised_weight():
    """fp32, CPU (the fp8 products' reference math): `qlora_linear` with ``fp8_scale`` against `lora_linear` over the
    e4m3 weight quantize_rows makes of the fp32 dequantisation (what `Fp8Linear` would hold): output and x, A, B
    gradients to fp32 rounding (1e-5 of each tensor's largest value; the LoRA sum is ordered otherwise). The base
    weight is dequantised to e4m3 again in the backward, from a buffer another weight overwrote in between."""
    weight, x, lora_A, lora_B, bias, dy = _qlora_operands("cpu")
    other = Quant4bitWeight.from_quant_state(*_quantize((64, 64), "nf4", True, torch.float32, "cpu", seed=1))
    scale = e4m3_scales_4bit(weight)
    wq, wq_scale = quantize_rows_reference(dequantize_4bit_reference(weight, torch.float32))

    def ours(x, a, b):
        y = qlora_linear(x, weight, bias, a, b, 0.5, fp8_scale=scale)
        dequantize_4bit(other, E4M3, fp8_scale=e4m3_scales_4bit(other))  # the e4m3 buffer now holds another weight
        return y

    got = _fwd_bwd(ours, x, lora_A, lora_B, dy, autocast=False)
    expected = _fwd_bwd(lambda x, a, b: lora_linear(x, wq, bias, a, b, 0.5, weight_scale=wq_scale), x, lora_A, lora_B, dy, False)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5 * e.abs().max().item())


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_qlora_linear_in_fp8_against_the_bf16_qlora_linear(device):
    """bf16 autocast: fp8 against the bf16 QLoRA linear on the same 4-bit weight, no bias and a small B (as early in
    training: the base product dominates y and x's gradient). Output and x's gradient 1% to 8% relative (Frobenius;
    measured 3.4% and 3.5% on the CPU, `lightning_ft.kernels.fp8`'s ~3.5%). A's and B's gradients do not pass through
    the base product in one layer (dA = dhᵀx, dB = s·dyᵀh): the same. On CUDA (sm90+; K and N multiples of 16) the
    base products run through torch._scaled_mm."""
    weight, x, lora_A, lora_B, _, dy = _qlora_operands(device, shape=(256, 128), tokens=(4, 32))
    lora_B = lora_B * 0.01
    scale = e4m3_scales_4bit(weight)
    fp8 = _fwd_bwd(lambda x, a, b: qlora_linear(x, weight, None, a, b, 0.5, fp8_scale=scale), x, lora_A, lora_B, dy, True)
    bf16 = _fwd_bwd(lambda x, a, b: qlora_linear(x, weight, None, a, b, 0.5), x, lora_A, lora_B, dy, True)
    errors = [_rel(f, b) for f, b in zip(fp8[:2], bf16[:2])]
    assert all(0.01 < e < 0.08 for e in errors), errors
    assert torch.equal(fp8[2], bf16[2]) and torch.equal(fp8[3], bf16[3])


def test_qlora_linear_in_fp8_takes_the_rows_a_kernel_attached_to_x(monkeypatch):
    """x's fp8 rows left on it (as RMSNorm/SwiGLU leave them) are used as they are: no quantize_rows pass over x; the
    result is the same as quantising x here (the rows are quantize_rows' of x)."""
    import lightning_ft.kernels.qlora as qlora

    weight, x, lora_A, lora_B, bias, _ = _qlora_operands("cpu")
    scale = e4m3_scales_4bit(weight)
    plain = qlora_linear(x, weight, bias, lora_A, lora_B, 0.5, fp8_scale=scale)
    x_with_rows = attach_fp8_rows(x.clone(), quantize_rows_reference(x.reshape(-1, x.shape[-1])))
    monkeypatch.setattr(qlora, "quantize_rows", lambda *a: pytest.fail("x quantised again"))
    assert torch.equal(qlora_linear(x_with_rows, weight, bias, lora_A, lora_B, 0.5, fp8_scale=scale), plain)
