"""The check shared by the frozen 4-bit expert weights the Triton grouped GEMM takes in place of a dense weight:
MXFP4 (dequantised tile by tile in its B-tile loads) and NF4 (dequantised whole into the reused buffer first)."""

import torch

from lightning_ft.kernels.moe.grouped_gemm import grouped_gemm, grouped_gemm_reference


def assert_grouped_gemm_reads(
    w_ECN, device: torch.device, dtype: torch.dtype, tolerance: dict, bitwise_everywhere: bool = False
) -> None:
    """The Triton grouped GEMM on the packed ``w_ECN`` [E=4, C, N] equals the same kernel on ``w_ECN.dequantize()``
    and the plain-torch reference (``tolerance``); with gather, scatter, routing weights, LoRA and bias, over group
    sizes 9, 0, 14, 3 (expert 1 has no rows, none a multiple of 16). Against the dense twin: bitwise under the
    interpreter; on CUDA bitwise with ``bitwise_everywhere`` (the same launch on the same dense values), else within
    ``tolerance`` (a kernel that dequantises in its tile loads is autotuned apart, so the summation order may differ)."""
    torch.manual_seed(0)
    counts = torch.tensor([9, 0, 14, 3])
    rows, experts, rank = int(counts.sum()), 4, 3
    _, c_dim, n_dim = w_ECN.shape
    assert w_ECN.shape[0] == experts
    offsets = torch.cumsum(counts, 0).to(torch.int32).to(device)
    src = torch.randn(7, c_dim, device=device).to(dtype)
    kwargs = dict(
        src_idx_S=torch.randint(0, 7, (rows,), device=device), out_idx_S=torch.randperm(rows, device=device),
        row_scale_S=torch.rand(rows, device=device).to(dtype), lora_mid_SR=torch.randn(rows, rank, device=device).to(dtype),
        lora_b_ERN=torch.randn(experts, rank, n_dim, device=device).to(dtype), scaling=0.5,
        bias_EN=torch.randn(experts, n_dim, device=device),
    )
    out = grouped_gemm(src, w_ECN, offsets, rows, **kwargs)
    twin = grouped_gemm(src, w_ECN.dequantize(), offsets, rows, **kwargs)
    if device.type == "cpu" or bitwise_everywhere:
        assert torch.equal(out, twin)
    else:
        torch.testing.assert_close(out.float(), twin.float(), **tolerance)
    torch.testing.assert_close(out.float(), grouped_gemm_reference(src, w_ECN, offsets, rows, **kwargs).float(), **tolerance)
