"""The fp8 path of the Triton grouped GEMM (`grouped_gemm` on an `Fp8ExpertWeight`): e4m3 expert weights with
per-expert per-output-channel scales, the A tiles quantised in registers per row per K tile.

    python -m pytest -q tests/kernels/moe/test_grouped_gemm_fp8.py            (CPU, Triton interpreted)
    python -m pytest -q -m gpu tests/kernels/moe/test_grouped_gemm_fp8.py     (GPU; fp8 tl.dot needs sm89+)

Bounds (relative Frobenius error, fp32 inputs unless said): against the plain-torch reference of the same fp8
math (`grouped_gemm_reference` with ``fp8_block_c``): 1e-5 (fp32 sums in another order; bitwise here so far);
against the dense product with the dequantised weight: 5% (the e4m3 activations, ~2.5% measured); against the
original weight: 8% (both operands rounded, ~3.5% measured). bf16 inputs: 8% against the original weight.
"""

import pytest
import torch
import triton
import triton.language as tl

from lightning_ft.kernels.fp8 import E4M3, Fp8ExpertWeight, e4m3_cast, quantize_expert_weight
from lightning_ft.kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_reference

COUNTS = [9, 0, 14, 3]  # expert 1 has no rows; no group is a multiple of 16
N_OUT, C_IN = 37, 80  # W[e] is [N_OUT, C_IN]; 80 columns: a partial K tile of the interpreter's BLOCK_C = 64


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@triton.jit
def _cast_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, e4m3_cast(tl.load(x_ptr + i)))


def test_e4m3_cast_rounds_as_torch(device):
    """In-register e4m3 casts round as torch's conversion does: to nearest even, rounding carried into the
    exponent (31.6 -> 32, which Triton's interpreter alone gets wrong), subnormals, ±448."""
    special = torch.tensor([31.6, -127.47, 448.0, -448.0, 0.0, 2.0**-9, 3 * 2.0**-10, 1.0625, 1.1875, 2.0**-7 * 1.03])
    values = torch.cat([special, torch.randn(1014, generator=torch.Generator().manual_seed(0)) * 60]).clamp(-448, 448)
    values = values.to(device)
    out = torch.empty(values.shape, dtype=E4M3, device=device)
    _cast_kernel[(1,)](values, out, BLOCK=values.numel())
    assert torch.equal(out.view(torch.uint8), values.to(E4M3).view(torch.uint8))


def _weight(device, dtype):
    """A random [E, N_OUT, C_IN] weight (rows of different magnitudes) and its `Fp8ExpertWeight`."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(len(COUNTS), N_OUT, C_IN, generator=gen) * torch.rand(len(COUNTS), N_OUT, 1, generator=gen)
    dense = dense.to(device, dtype)
    return dense, Fp8ExpertWeight(*quantize_expert_weight(dense), dtype)


@pytest.mark.parametrize("options", [False, True], ids=["plain", "gather_scatter_scale_bias_lora"])
@pytest.mark.parametrize("direction", ["forward", "input_grad"])
def test_fp8_grouped_gemm_against_its_exact_reference_and_the_dense_one(device, direction, options):
    """``x W[e]ᵀ`` (forward: the weight transposed, scales along N, in the epilogue) and ``dy W[e]`` (input
    gradient: scales along the contraction, folded into dy before it is quantised) on an expert with no rows and
    group sizes off 16, with or without gather, scatter, routing weights, bias and LoRA (kept in fp32 here)."""
    torch.manual_seed(0)
    dense, weight = _weight(device, torch.float32)
    w_ECN, dense_ECN = (weight.transpose(1, 2), dense.transpose(1, 2)) if direction == "forward" else (weight, dense)
    assert w_ECN.shape == dense_ECN.shape
    experts, c_dim, n_dim = w_ECN.shape
    rows, rank = sum(COUNTS), 3
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32).to(device)
    kwargs = {}
    if options:
        kwargs = dict(
            src_idx_S=torch.randint(0, 11, (rows,), device=device), out_idx_S=torch.randperm(rows, device=device),
            row_scale_S=torch.rand(rows, device=device), lora_mid_SR=torch.randn(rows, rank, device=device),
            lora_b_ERN=torch.randn(experts, rank, n_dim, device=device) * 0.1, scaling=0.5,
            bias_EN=torch.randn(experts, n_dim, device=device),
        )
    src = torch.randn(11 if options else rows, c_dim, device=device) * 3
    out = grouped_gemm(src, w_ECN, offsets, rows, **kwargs)
    assert out.shape == (rows, n_dim) and out.dtype == torch.float32
    if device.type == "cpu":  # the interpreter's one config: BLOCK_C = 64, capped to the contraction (at least 32)
        block_c = min(64, max(32, triton.next_power_of_2(c_dim)))
        exact = grouped_gemm_reference(src, w_ECN, offsets, rows, fp8_block_c=block_c, **kwargs)
        torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)
    assert _rel(out, grouped_gemm_reference(src, w_ECN, offsets, rows, **kwargs)) < 0.05  # dequantised weight
    assert _rel(out, grouped_gemm_reference(src, dense_ECN, offsets, rows, **kwargs)) < 0.08  # original weight


def test_fp8_grouped_gemm_bf16_rows_and_zero_rows(device):
    """bf16 inputs (the training dtype) within the bound of the original bf16 product, both directions; an
    all-zero row gives zeros (its tile scale is the floor, not a division by zero)."""
    dense, weight = _weight(device, torch.bfloat16)
    rows = sum(COUNTS)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32).to(device)
    for w_ECN, dense_ECN in ((weight.transpose(1, 2), dense.transpose(1, 2)), (weight, dense)):
        src = torch.randn(rows, w_ECN.shape[1], device=device).to(torch.bfloat16)
        src[4] = 0
        out = grouped_gemm(src, w_ECN, offsets, rows)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and not out[4].any()
        assert _rel(out, grouped_gemm_reference(src, dense_ECN, offsets, rows)) < 0.08


def test_fp8_expert_weight_views():
    dense, weight = _weight("cpu", torch.bfloat16)
    assert weight.values.dtype == E4M3 and weight.scales.shape == (4, N_OUT) and weight.scales.dtype == torch.float32
    assert weight.shape == (4, N_OUT, C_IN) and weight.transpose(1, 2).shape == (4, C_IN, N_OUT)
    assert torch.equal(weight.transpose(1, 2).dequantize(), weight.dequantize().transpose(1, 2))
    assert weight.dequantize().dtype == torch.bfloat16 and _rel(weight.dequantize(), dense) < 0.05
    # per-output-channel scales: each row's largest magnitude is 448 · scale, exactly
    assert torch.equal(weight.values.float().abs().amax(-1), torch.full((4, N_OUT), 448.0))
    with pytest.raises(ValueError, match="last two dims"):
        weight.transpose(0, 1)
