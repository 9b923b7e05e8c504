"""4-bit dequantisation (kernels/nf4.py) against bitsandbytes, and the QLoRA linear (kernels/qlora.py) against its reference."""

import pytest
import torch

from lightning_ft.kernels.nf4 import Quant4bitWeight, dequantize_4bit, dequantize_4bit_reference
from lightning_ft.kernels.qlora import qlora_linear, qlora_linear_reference

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
def test_qlora_linear_makes_no_host_sync_on_cuda():
    weight = Quant4bitWeight.from_quant_state(*_quantize((1024, 512), "nf4", True, torch.bfloat16, "cuda"))
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    lora_A = torch.randn(16, 512, device="cuda", requires_grad=True)
    lora_B = torch.randn(1024, 16, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        qlora_linear(x, weight, None, lora_A, lora_B, 2.0).sum().backward()  # warm-up: Triton compiles, the buffer grows
        torch.cuda.set_sync_debug_mode("error")
        try:
            qlora_linear(x, weight, None, lora_A, lora_B, 2.0).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
