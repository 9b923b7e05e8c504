"""MXFP4 (`lightning_ft.kernels.mxfp4`): the reference against transformers' dequantisation, the quantiser, the Triton
dequantisation into the reused buffer, and the grouped GEMM reading MXFP4 expert weights against the dense path."""

import pytest
import torch

from lightning_ft.kernels.mxfp4 import Mxfp4Weight, dequantize_mxfp4, dequantize_mxfp4_reference, quantize_mxfp4
from packed_weight_checks import assert_grouped_gemm_reads


def _random_mxfp4(*shape, seed=0, scale_range=(0, 256)):
    """Random blocks [*shape, 16] and scales [*shape] (every byte value possible)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(*scale_range, shape, dtype=torch.uint8, generator=gen)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reference_is_bitwise_transformers_dequantisation(dtype):
    """Every nibble and every e8m0 byte (0 and 255 included): the same bits as transformers' own
    ``convert_moe_packed_tensors``, which returns the [E, C, N] (transposed) weight."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(3, 8, 16)
    scales.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    got = dequantize_mxfp4_reference(blocks, scales, dtype).transpose(1, 2).contiguous()
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert got.shape == want.shape == (3, 16 * 32, 8)
    assert torch.equal(got.view(bits), want.view(bits))


def test_quantize_rounds_to_nearest_e2m1_ties_to_even_and_saturates():
    """One block of known values: scale 2^(floor(log2 amax) - 2), round to nearest (ties to the even code),
    saturation at ±6 × scale; an all-zero block; the nibble order (element 2i low)."""
    row = torch.zeros(64)
    # amax 7.9 -> floor(log2) = 2 -> scale 2^0: codes saturate at 6
    row[:12] = torch.tensor([7.9, -7.9, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.3, 2.9, -5.2])
    blocks, scales = quantize_mxfp4(row[None])
    assert scales.tolist() == [[127, 0]]  # the second block is all zero
    got = dequantize_mxfp4_reference(blocks, scales, torch.float32)[0]
    want = [6.0, -6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5, 3.0, -6.0]
    assert got[:12].tolist() == want and not got[12:].any()
    assert blocks[0, 0, 0].item() == 0x7 | (0xF << 4)  # +6 low, -6 high


def test_quantize_error_bound_and_values_roundtrip():
    """Random weights (scales over many binades): every element within a quarter of its block's amax, and
    quantising the dequantised weight again gives the same values."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 6, 96, generator=gen) * torch.exp2(torch.randint(-20, 20, (4, 6, 1), generator=gen).float())
    blocks, scales = quantize_mxfp4(w.bfloat16())
    assert blocks.shape == (4, 6, 3, 16) and blocks.dtype == scales.dtype == torch.uint8
    dense = dequantize_mxfp4_reference(blocks, scales, torch.float32)
    amax = w.bfloat16().float().view(4, 6, 3, 32).abs().amax(-1, keepdim=True)
    assert ((dense - w.bfloat16().float()).view(4, 6, 3, 32).abs() <= amax / 4).all()
    assert torch.equal(dequantize_mxfp4_reference(*quantize_mxfp4(dense), torch.float32), dense)
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_mxfp4(torch.zeros(2, 40))


def test_weight_view_shapes_and_transpose():
    blocks, scales = _random_mxfp4(3, 5, 2, scale_range=(120, 130))
    weight = Mxfp4Weight.from_checkpoint(blocks, scales, torch.bfloat16)
    assert weight.shape == (3, 5, 64) and weight.transpose(1, 2).shape == (3, 64, 5)
    assert torch.equal(weight.transpose(1, 2).dequantize(), dequantize_mxfp4_reference(blocks, scales, torch.bfloat16).transpose(1, 2))
    with pytest.raises(ValueError, match="last two dims"):
        weight.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dequantize_into_the_buffer_equals_the_reference(device, dtype):
    """The Triton kernel writes every nibble and each e8m0 byte from 2 to 254 as the reference does, bitwise, over odd
    row counts and tiles (below 2 the smallest values are subnormal, which Triton's CPU interpreter flushes to zero in
    bf16; 0, 1 and 255 are no scales `quantize_mxfp4` writes for finite weights of normal range); the result lives in
    the reused buffer (a second weight overwrites it); mismatched shapes are refused."""
    blocks, scales = _random_mxfp4(3, 37, 9, scale_range=(2, 255))  # [E, N, C/32, 16]: C = 288, rows = 111
    blocks, scales = blocks.flatten(-2).to(device), scales.to(device)
    dense = dequantize_mxfp4(blocks, scales, dtype)
    assert dense.shape == (3, 37, 288) and dense.dtype == dtype
    assert torch.equal(dense, dequantize_mxfp4_reference(blocks.unflatten(-1, (-1, 16)), scales, dtype))
    weight = Mxfp4Weight(blocks, scales, dtype)
    assert torch.equal(weight.dense_in_buffer(), dense) and torch.equal(weight.transpose(1, 2).dense_in_buffer(), dense.transpose(1, 2))
    other, other_scales = _random_mxfp4(2, 5, 1, seed=1, scale_range=(120, 130))
    again = dequantize_mxfp4(other.flatten(-2).to(device), other_scales.to(device), dtype)
    assert again.data_ptr() == dense.data_ptr()  # the same reused buffer
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :-1], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("quantised_along_c", [True, False], ids=["forward", "input_grad"])
def test_grouped_gemm_reads_mxfp4_weights(device, dtype, quantised_along_c):
    """The Triton grouped GEMM on an `Mxfp4Weight` (both orientations: x·Wᵀ with W quantised along the
    contracted dim, as the forward reads it, and dy·W, as the input gradient reads it) equals the same kernel
    on the dequantised dense weight (it dequantises into the reused buffer, exactly, and runs that kernel) and the
    plain-torch reference; odd sizes, gather, scatter, routing weights, LoRA, bias; expert 1 has no rows."""
    experts = 4
    c_dim, n_dim = (64, 37) if quantised_along_c else (37, 64)
    stored = (n_dim, c_dim) if quantised_along_c else (c_dim, n_dim)
    blocks, scales = _random_mxfp4(experts, stored[0], stored[1] // 32, scale_range=(122, 130))
    weight = Mxfp4Weight.from_checkpoint(blocks.to(device), scales.to(device), dtype)
    w_ECN = weight.transpose(1, 2) if quantised_along_c else weight
    assert w_ECN.shape == (experts, c_dim, n_dim)
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    assert_grouped_gemm_reads(w_ECN, device, dtype, tolerance)
