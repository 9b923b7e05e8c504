"""Our Triton grouped GEMM and weight-gradient kernels (`lightning_ft.kernels.moe.grouped_gemm`)
against their plain-torch references."""

import pytest
import torch

from lightning_ft.kernels.moe.grouped_gemm import (
    grouped_gemm,
    grouped_gemm_reference,
    grouped_wgrad,
    grouped_wgrad_reference,
)
from moe_cases import DEVICES, TOL, _assert_close, _skip_unless_runnable

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_triton_grouped_gemm_gather_scatter_lora(device, with_bias):
    """One kernel call with every option on (a per-expert bias or none), against plain torch; expert 1 has no rows."""
    _skip_unless_runnable("triton", device)
    torch.manual_seed(0)
    rows, experts, c_dim, n_dim, rank = 23, 3, 20, 37, 5
    counts = torch.tensor([9, 0, 14])
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    expert_of_row = torch.repeat_interleave(torch.arange(experts), counts).to(device)
    src = torch.randn(7, c_dim, device=device)
    src_idx = torch.randint(0, 7, (rows,), device=device)
    out_idx = torch.randperm(rows, device=device)
    w_ECN = torch.randn(experts, n_dim, c_dim, device=device).transpose(1, 2)  # a strided view
    scale = torch.rand(rows, device=device)
    mid = torch.randn(rows, rank, device=device)
    lora_b = torch.randn(experts, rank, n_dim, device=device)
    bias = torch.randn(n_dim, experts, device=device).T if with_bias else None  # a strided view

    out = grouped_gemm(
        src, w_ECN, offsets, rows, src_idx_S=src_idx, out_idx_S=out_idx, row_scale_S=scale,
        lora_mid_SR=mid, lora_b_ERN=lora_b, scaling=0.5, bias_EN=bias,
    )
    per_row = torch.einsum("sc,scn->sn", src[src_idx], w_ECN[expert_of_row])
    per_row = per_row + 0.5 * torch.einsum("sr,srn->sn", mid, lora_b[expert_of_row])
    if with_bias:
        per_row = per_row + bias[expert_of_row]
    expected = torch.empty_like(out)
    expected[out_idx] = per_row * scale[:, None]
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    reference = grouped_gemm_reference(
        src, w_ECN, offsets, rows, src_idx_S=src_idx, out_idx_S=out_idx, row_scale_S=scale,
        lora_mid_SR=mid, lora_b_ERN=lora_b, scaling=0.5, bias_EN=bias,
    )
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_grouped_gemm_accumulates_in_place(device, dtype):
    """``accumulate_into``: a thin per-expert GEMM added into an existing output, once, in place; with
    ``out`` the sum goes there (a strided view here) and ``accumulate_into`` is left as it was."""
    _skip_unless_runnable("triton", device)
    torch.manual_seed(0)
    counts = torch.tensor([6, 0, 13, 2])
    rows, rank, n_dim = int(counts.sum()), 16, 35
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts).to(device)
    mid = torch.randn(rows, rank, device=device, dtype=dtype)
    b_ERN = torch.randn(4, rank, n_dim, device=device, dtype=dtype)
    out = torch.randn(rows, n_dim, device=device, dtype=dtype)
    expected = out.float() + torch.einsum("sr,srn->sn", mid.float(), b_ERN.float()[expert_of_row])

    tolerance = {} if dtype == torch.float32 else TOL[dtype]
    before = out.clone()
    dest = torch.full((n_dim, rows), float("nan"), device=device, dtype=dtype).t()
    assert grouped_gemm(mid, b_ERN, offsets, rows, accumulate_into=out, out=dest) is dest
    torch.testing.assert_close(dest.float(), expected, **tolerance)
    assert torch.equal(out, before)
    torch.testing.assert_close(grouped_gemm_reference(mid, b_ERN, offsets, rows, accumulate_into=before).float(), expected, **tolerance)
    result = grouped_gemm(mid, b_ERN, offsets, rows, accumulate_into=out)
    assert result is out
    torch.testing.assert_close(out.float(), expected, **tolerance)
    with pytest.raises(ValueError, match="accumulate_into"):
        grouped_gemm(mid, b_ERN, offsets, rows, accumulate_into=out[:, :-1])
    with pytest.raises(ValueError, match="out= is for accumulate_into"):
        grouped_gemm(mid, b_ERN, offsets, rows, out=dest)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_grouped_gemm_stores_the_rows_it_gathers(device, dtype):
    """``gathered_out``: the gathered rows land bit for bit in a padded [S, C] view (its spare
    columns untouched), beside ``alpha`` times the product; C spans two tiles and N two column tiles
    (each row stored once is the kernel's business, the same values either way)."""
    _skip_unless_runnable("triton", device)
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 12, 3])
    rows, c_dim, n_dim, pad = int(counts.sum()), 70, 80, 3
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    expert_of_row = torch.repeat_interleave(torch.arange(4), counts).to(device)
    src = torch.randn(9, c_dim, generator=gen).to(device, dtype)
    src_idx = torch.randint(0, 9, (rows,), generator=gen).to(device)
    w_ECN = torch.randn(4, c_dim, n_dim, generator=gen).to(device, dtype)
    padded = torch.full((rows, c_dim + pad), float("nan"), device=device, dtype=dtype)

    out = grouped_gemm(src, w_ECN, offsets, rows, src_idx_S=src_idx, gathered_out=padded[:, :c_dim], alpha=0.25)
    assert torch.equal(padded[:, :c_dim], src[src_idx])
    assert padded[:, c_dim:].isnan().all()
    expected = 0.25 * torch.einsum("sc,scn->sn", src[src_idx].double(), w_ECN[expert_of_row].double())
    _assert_close(out, expected, dtype, "alpha * product")
    with pytest.raises(ValueError, match="gathered_out"):
        grouped_gemm(src, w_ECN, offsets, rows, src_idx_S=src_idx, gathered_out=padded[:, : c_dim - 1])


@pytest.mark.parametrize("device", DEVICES)
def test_triton_grouped_wgrad_ragged_with_empty_expert(device):
    _skip_unless_runnable("triton", device)
    torch.manual_seed(0)
    counts = torch.tensor([0, 5, 18, 1])
    rows = int(counts.sum())
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    lhs = torch.randn(rows, 6, device=device)
    rhs = torch.randn(10, 33, device=device)
    rhs_idx = torch.randint(0, 10, (rows,), device=device)
    scale = torch.rand(rows, device=device)

    out = grouped_wgrad(lhs, rhs, offsets, rhs_idx_S=rhs_idx, row_scale_S=scale, scaling=2.0)
    bounds = zip([0, *offsets[:-1].tolist()], offsets.tolist())
    expected = torch.stack([2.0 * (lhs[s:e] * scale[s:e, None]).T @ rhs[rhs_idx[s:e]] for s, e in bounds])
    assert torch.all(out[0] == 0)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    reference = grouped_wgrad_reference(lhs, rhs, offsets, rhs_idx_S=rhs_idx, row_scale_S=scale, scaling=2.0)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
