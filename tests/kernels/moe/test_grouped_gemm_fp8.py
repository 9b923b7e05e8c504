"""The fp8 path of the Triton grouped GEMM (`grouped_gemm` on an `Fp8ExpertWeight`): e4m3 expert weights with one
scale per expert, the input quantised per row before the launch (`quantize_rows`), a plain e4m3 dot chain, the
row and expert scales applied in the epilogue.

    python -m pytest -q tests/kernels/moe/test_grouped_gemm_fp8.py            (CPU, Triton interpreted)
    python -m pytest -q -m gpu tests/kernels/moe/test_grouped_gemm_fp8.py     (GPU; fp8 tl.dot needs sm89+)

Bounds (relative Frobenius error unless said):
* against the plain-torch reference of the same math (`grouped_gemm_reference` on the same e4m3 rows and scales):
  bitwise on data whose every sum is exact in fp32 (small integers, power-of-two scales: any summation order
  gives the same bits); on random data 1e-5 elementwise on the CPU (the interpreter sums each K tile in numpy's
  order, then adds the tiles; the reference sums the whole row in torch's: fp32 rounding only), 1e-3 on the GPU
  (Hopper's fp8 MMA accumulates in reduced precision, and in its own order);
* against the dense product with the dequantised weight and the unquantised input: 5% (the e4m3 input rows,
  ~2.5% measured);
* against the original weight: 8% (both operands rounded, ~3.5% measured), fp32 and bf16 inputs alike.
"""

import pytest
import torch
import triton
import triton.language as tl

from lightning_ft.kernels.fp8 import E4M3, Fp8ExpertWeight, e4m3_cast, quantize_expert_weight, quantize_rows
from lightning_ft.kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_reference

COUNTS = [9, 0, 14, 3]  # expert 1 has no rows; no group is a multiple of 16
N_OUT, C_IN = 37, 80  # W[e] is [N_OUT, C_IN]; 80 columns: a partial K tile of the interpreter's BLOCK_C = 64
SRC_ROWS = 11  # the gathered source rows (options on)


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
    """A random [E, N_OUT, C_IN] weight (experts and output channels of different magnitudes) and its
    `Fp8ExpertWeight`."""
    gen = torch.Generator().manual_seed(0)
    magnitude = torch.rand(len(COUNTS), 1, 1, generator=gen) * torch.rand(len(COUNTS), N_OUT, 1, generator=gen)
    dense = (torch.randn(len(COUNTS), N_OUT, C_IN, generator=gen) * magnitude).to(device, dtype)
    return dense, Fp8ExpertWeight(*quantize_expert_weight(dense), dtype)


def _oriented(direction, weight, dense):
    """(w_ECN, dense_ECN): the forward reads ``W[e]ᵀ`` [C_IN, N_OUT], the input gradient ``W[e]`` [N_OUT, C_IN]."""
    return (weight.transpose(1, 2), dense.transpose(1, 2)) if direction == "forward" else (weight, dense)


def _options(device, experts, n_dim, rows, rank=3, integer=False):
    """Gather, scatter, routing weights, bias and split LoRA; small integers and powers of two with ``integer``."""
    gen = torch.Generator().manual_seed(1)

    def draw(*shape):
        return torch.randint(-4, 5, shape, generator=gen).float() if integer else torch.randn(shape, generator=gen)

    row_scale = 2.0 ** torch.randint(-2, 2, (rows,), generator=gen).float() if integer else torch.rand(rows, generator=gen)
    options = dict(
        src_idx_S=torch.randint(0, SRC_ROWS, (rows,), generator=gen), out_idx_S=torch.randperm(rows, generator=gen),
        row_scale_S=row_scale, lora_mid_SR=draw(rows, rank), lora_b_ERN=draw(experts, rank, n_dim) * 0.125,
        scaling=0.5, bias_EN=draw(experts, n_dim),
    )
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in options.items()}


@pytest.mark.parametrize("src_kind", ["e4m3", "widened"])
@pytest.mark.parametrize("options", [False, True], ids=["plain", "gather_scatter_scale_bias_lora"])
@pytest.mark.parametrize("direction", ["forward", "input_grad"])
def test_fp8_grouped_gemm_against_its_reference_and_the_dense_product(device, direction, options, src_kind):
    """``x W[e]ᵀ`` (forward) and ``dy W[e]`` (input gradient: the contraction along the weight's output channels)
    on an expert with no rows and group sizes off 16, with or without gather, scatter, routing weights, bias and
    LoRA (kept in fp32 here); the rows quantised to e4m3 or left in the weight's dtype (the weight widened)."""
    dense, weight = _weight(device, torch.float32)
    w_ECN, dense_ECN = _oriented(direction, weight, dense)
    experts, c_dim, n_dim = w_ECN.shape
    rows = sum(COUNTS)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32).to(device)
    kwargs = _options(device, experts, n_dim, rows) if options else {}
    src = torch.randn(SRC_ROWS if options else rows, c_dim, generator=torch.Generator().manual_seed(2)).to(device) * 3
    src_q, src_scale = quantize_rows(src) if src_kind == "e4m3" else (src, None)
    out = grouped_gemm(src_q, w_ECN, offsets, rows, src_scale=src_scale, **kwargs)
    assert out.shape == (rows, n_dim) and out.dtype == torch.float32
    same_math = grouped_gemm_reference(src_q, w_ECN, offsets, rows, src_scale=src_scale, **kwargs)
    if device.type == "cpu":
        torch.testing.assert_close(out, same_math, rtol=1e-5, atol=1e-5)
    else:
        assert _rel(out, same_math) < 1e-3
    assert _rel(out, grouped_gemm_reference(src, weight.dequantize() if direction == "input_grad" else
                                            weight.transpose(1, 2).dequantize(), offsets, rows, **kwargs)) < 0.05
    assert _rel(out, grouped_gemm_reference(src, dense_ECN, offsets, rows, **kwargs)) < 0.08  # original weight


@pytest.mark.parametrize("src_kind", ["e4m3", "widened"])
@pytest.mark.parametrize("direction", ["forward", "input_grad"])
def test_fp8_grouped_gemm_is_bitwise_its_reference_on_exact_data(device, direction, src_kind):
    """Small-integer e4m3 rows and weights with power-of-two scales, integer LoRA and bias, power-of-two routing
    weights: every product and sum is exact in fp32, so the kernel (gather, scatter, an empty expert, odd group
    sizes, every epilogue term) must give the reference's bits."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randint(-8, 9, (len(COUNTS), N_OUT, C_IN), generator=gen).float().to(E4M3)
    w_scales = 2.0 ** torch.randint(-3, 3, (len(COUNTS),), generator=gen).float()
    weight = Fp8ExpertWeight(values.to(device), w_scales.to(device), torch.float32)
    w_ECN = weight.transpose(1, 2) if direction == "forward" else weight
    experts, c_dim, n_dim = w_ECN.shape
    src_q = torch.randint(-8, 9, (SRC_ROWS, c_dim), generator=gen).float().to(E4M3).to(device)
    src_scale = (2.0 ** torch.randint(-3, 3, (SRC_ROWS,), generator=gen).float()).to(device)
    rows = sum(COUNTS)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32).to(device)
    kwargs = _options(device, experts, n_dim, rows, integer=True)
    if src_kind == "widened":  # the same integers in the weight's dtype, no row scales
        src_q, src_scale = src_q.float(), None
    out = grouped_gemm(src_q, w_ECN, offsets, rows, src_scale=src_scale, **kwargs)
    assert out.abs().amax() > 100  # not a trivially small result
    assert torch.equal(out, grouped_gemm_reference(src_q, w_ECN, offsets, rows, src_scale=src_scale, **kwargs))


def test_fp8_grouped_gemm_bf16_rows_and_zero_rows(device):
    """bf16 inputs (the training dtype) within the bound of the original bf16 product, both directions; an
    all-zero row gives zeros (its scale is the floor, not a division by zero)."""
    dense, weight = _weight(device, torch.bfloat16)
    rows = sum(COUNTS)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32).to(device)
    for direction in ("forward", "input_grad"):
        w_ECN, dense_ECN = _oriented(direction, weight, dense)
        src = torch.randn(rows, w_ECN.shape[1], generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
        src[4] = 0
        for src_q, src_scale in (quantize_rows(src), (src, None)):  # e4m3 rows; bf16 rows (the weight widened)
            out = grouped_gemm(src_q, w_ECN, offsets, rows, src_scale=src_scale)
            assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and not out[4].any()
            assert _rel(out, grouped_gemm_reference(src, dense_ECN, offsets, rows)) < 0.08


def test_fp8_grouped_gemm_refuses_what_makes_no_sense():
    """An fp8 weight with a src neither e4m3 nor in its dtype, with row scales for an unquantised src, or an e4m3
    src without its row scales; row scales with a dense weight; a gathered copy of e4m3 rows (it is for the LoRA
    GEMMs, in the model's dtype)."""
    dense, weight = _weight("cpu", torch.bfloat16)
    rows = sum(COUNTS)
    offsets = torch.cumsum(torch.tensor(COUNTS), 0).to(torch.int32)
    src = torch.randn(rows, C_IN, dtype=torch.bfloat16)
    src_q, src_scale = quantize_rows(src)
    with pytest.raises(ValueError, match=r"an Fp8ExpertWeight takes e4m3 rows, quantize_rows, or torch.bfloat16 rows"):
        grouped_gemm(src.float(), weight.transpose(1, 2), offsets, rows)
    with pytest.raises(ValueError, match="src_scale is for an e4m3 src with an Fp8ExpertWeight only"):
        grouped_gemm(src, weight.transpose(1, 2), offsets, rows, src_scale=src_scale)
    with pytest.raises(ValueError, match=r"needs src_scale \[26\] fp32 \(quantize_rows\), got none"):
        grouped_gemm(src_q, weight.transpose(1, 2), offsets, rows)
    with pytest.raises(ValueError, match="src_scale is for an e4m3 src with an Fp8ExpertWeight only"):
        grouped_gemm(src, dense.transpose(1, 2), offsets, rows, src_scale=src_scale)
    with pytest.raises(ValueError, match="gathered_out .* takes no e4m3 src"):
        grouped_gemm(src_q, weight.transpose(1, 2), offsets, rows, src_scale=src_scale, gathered_out=torch.empty_like(src))


def test_fp8_expert_weight_views_and_per_expert_scales():
    dense, weight = _weight("cpu", torch.bfloat16)
    assert weight.values.dtype == E4M3 and weight.scales.shape == (4,) and weight.scales.dtype == torch.float32
    assert weight.shape == (4, N_OUT, C_IN) and weight.transpose(1, 2).shape == (4, C_IN, N_OUT)
    assert torch.equal(weight.transpose(1, 2).dequantize(), weight.dequantize().transpose(1, 2))
    assert weight.dequantize().dtype == torch.bfloat16 and _rel(weight.dequantize(), dense) < 0.05
    # one scale per expert: each expert's largest magnitude is 448 · scale, exactly; the output channels of small
    # magnitude (down to ~1% of the expert's largest here) keep e4m3's relative precision
    assert torch.equal(weight.values.float().abs().amax((1, 2)), torch.full((4,), 448.0))
    assert torch.equal(weight.scales, dense.float().abs().amax((1, 2)) / 448)
    per_channel = ((weight.dequantize().float() - dense.float()).norm(dim=-1) / dense.float().norm(dim=-1)).amax()
    assert per_channel < 0.05
    zero = Fp8ExpertWeight(*quantize_expert_weight(torch.zeros(2, 3, 4)), torch.float32)
    assert not zero.dequantize().any() and torch.equal(zero.scales, torch.full((2,), 1e-12 / 448))
    with pytest.raises(ValueError, match="last two dims"):
        weight.transpose(0, 1)
