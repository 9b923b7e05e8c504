"""PEFT's expert LoRA B to the expert-major layout the grouped GEMMs read: cast and transposed in one pass.

PEFT 0.21 (``LoraConfig(target_parameters=...)``, ``ParamWrapper``) keeps B of all E experts of a
3-D weight [E, N, C] as one ``nn.Linear`` weight ``lora_B`` [N, R*E] whose column ``j*E + e`` is
column j of expert e's B_e [N, R]: the experts are innermost. The grouped GEMMs want
``b_ENR`` [E, N, R], each B_e contiguous, in the compute dtype (bf16 where PEFT keeps its adapters in
fp32). As a view, ``lora_B.view(N, R, E).permute(2, 0, 1)`` has strides (1, R*E, E), so torch's copy
of it (cast included) reads one scattered element at a time, which is slow on the GPU at N=2048,
R=16, E=128 (Qwen3-30B-A3B's down projection), and the forward, the recompute and the backward of
each expert projection pay it in every decoder layer and step. Here each program moves a
[BLOCK_N, BLOCK_R, BLOCK_E] block: the reads are contiguous along E, the writes along R (Triton
converts the layout in shared memory between the two).

Forward: ``b_ENR[e, n, j] = lora_B[n, j*E + e]`` cast to ``dtype``. Backward: the same map
transposed, ``grad_lora_B[n, j*E + e] = grad_b_ENR[e, n, j]`` cast to lora_B's dtype. Exact: a copy
and one rounding to nearest even, as torch's ``.to`` rounds, on the GPU. (Triton's CPU interpreter
truncates fp32 to bf16 instead, within one bf16 ulp: the tests allow that there only.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import triton_can_run

_BLOCK_ELEMS = 4096  # values per program: 16 fp32 registers per thread at 8 warps


@triton.jit
def _transpose_nre_kernel(
    SRC, DST, N, R, E,
    src_n, src_r, src_e, dst_n, dst_r, dst_e,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """DST[n, j, e] = SRC[n, j, e] through each side's (n, j, e) strides, cast to DST's dtype."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None, None]
    j = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)[None, :, None]
    e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)[None, None, :]
    mask = (n < N) & (j < R) & (e < E)
    n, j, e = n.to(tl.int64), j.to(tl.int64), e.to(tl.int64)
    values = tl.load(SRC + n * src_n + j * src_r + e * src_e, mask=mask)
    tl.store(DST + n * dst_n + j * dst_r + e * dst_e, values.to(DST.dtype.element_ty), mask=mask)


def _transpose_nre(src: torch.Tensor, src_nre: tuple[int, int, int], dst: torch.Tensor, dst_nre: tuple[int, int, int],
                   sizes: tuple[int, int, int]) -> None:
    """Copy the [N, R, E] index space from ``src`` to ``dst``, each addressed by its (n, j, e) element strides."""
    n_size, r_size, e_size = sizes
    block_e = min(64, triton.next_power_of_2(e_size))
    block_r = min(16, triton.next_power_of_2(r_size))
    block_n = max(1, min(triton.next_power_of_2(n_size), _BLOCK_ELEMS // (block_e * block_r)))
    grid = (triton.cdiv(n_size, block_n), triton.cdiv(r_size, block_r), triton.cdiv(e_size, block_e))
    _transpose_nre_kernel[grid](
        src, dst, n_size, r_size, e_size, *src_nre, *dst_nre,
        BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_E=block_e, num_warps=8,
    )


class _ExpertMajorLoRAB(torch.autograd.Function):
    """lora_B [N, R*E] (any dtype) -> b_ENR [E, N, R] contiguous in ``dtype``; the gradient goes back the same way."""

    @staticmethod
    def forward(ctx, lora_b: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
        n_size, rank = lora_b.shape[0], lora_b.shape[1] // num_experts
        b_ENR = torch.empty(num_experts, n_size, rank, dtype=dtype, device=lora_b.device)
        sizes = (n_size, rank, num_experts)
        _transpose_nre(lora_b, (lora_b.stride(0), num_experts * lora_b.stride(1), lora_b.stride(1)),
                       b_ENR, (rank, 1, n_size * rank), sizes)
        ctx.lora_b_meta = (lora_b.shape, lora_b.dtype, sizes)
        return b_ENR

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_ENR: torch.Tensor):
        shape, dtype, sizes = ctx.lora_b_meta
        grad = torch.empty(shape, dtype=dtype, device=grad_ENR.device)
        _transpose_nre(grad_ENR, (grad_ENR.stride(1), grad_ENR.stride(2), grad_ENR.stride(0)),
                       grad, (grad.stride(0), sizes[2] * grad.stride(1), grad.stride(1)), sizes)
        return grad, None, None


def expert_major_lora_b(lora_b: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """PEFT's ``lora_B`` [N, R*E] as ``b_ENR`` [E, N, R] (contiguous, ``dtype``), differentiable w.r.t. ``lora_b``.

    One Triton pass each way on CUDA (or the CPU under ``TRITON_INTERPRET=1``); elsewhere the
    plain-torch reference. Raises ValueError when R*E is not a multiple of ``num_experts``.
    """
    if lora_b.dim() != 2 or lora_b.shape[1] % num_experts:
        raise ValueError(f"lora_B {tuple(lora_b.shape)} is not [N, R*E] for E={num_experts} experts")
    if triton_can_run(lora_b) and lora_b.numel() > 0:
        return _ExpertMajorLoRAB.apply(lora_b, num_experts, dtype)
    return expert_major_lora_b_reference(lora_b, num_experts, dtype)


def expert_major_lora_b_reference(lora_b: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """Plain torch: the permuted view, cast and made contiguous by one copy (`.to` keeps a strided view as is)."""
    b_ENR = lora_b.view(lora_b.shape[0], -1, num_experts).permute(2, 0, 1)
    return b_ENR.to(dtype, memory_format=torch.contiguous_format).contiguous()
