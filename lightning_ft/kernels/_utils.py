"""Launch helpers shared by the kernels: where Triton can run, warps per block, persistent grid size, padded rows."""

from __future__ import annotations

import functools
import os
import warnings

import torch


def interpreter_requested() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter now (1, true, on, yes or y)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "on", "yes", "y"}


# `triton.jit` reads TRITON_INTERPRET when a kernel is decorated, i.e. when a kernel module is first
# imported; read it here at the same moment so the two always agree.
INTERPRETER = interpreter_requested()


def triton_can_run(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on `t`'s device: CUDA, or the CPU under TRITON_INTERPRET=1."""
    return t.is_cuda or (INTERPRETER and t.device.type == "cpu")


@functools.cache
def warn_fallback(op: str, device: torch.device) -> None:
    """Warn once per op and device that the plain-torch reference runs instead of the Triton kernel."""
    warnings.warn(
        f"{op}: Triton cannot run on {device}; using the plain-torch reference instead "
        "(run on CUDA, or set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU).",
        stacklevel=3,
    )


def num_warps_for(block_elems: int) -> int:
    """Warps for a program holding `block_elems` values per tensor: about 8 values per thread.

    Eight bf16 values are one 16-byte load per thread, and the fp32 copies of a few such tensors
    fit in registers without spilling (checked with ptxas for sm_90).
    """
    warps = 4
    while warps < 32 and warps * 32 * 8 < block_elems:
        warps *= 2
    return warps


@functools.cache
def persistent_programs(device: torch.device) -> int:
    """Programs in a persistent grid (one that loops over row blocks): four per SM on CUDA."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def row_padded(num_rows: int, num_cols: int, pad: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [rows, cols] tensor like ``like``; with ``pad`` > 0 a view of [rows, cols +
    pad] rows, whose spare columns a LoRA-augmented expert GEMM writes its thin LoRA middle into
    (`lightning_ft.kernels.moe.grouped_mm.augment_expert_weight`). index_select writes such rows
    about as fast as contiguous ones on Hopper, so the padding costs no bandwidth."""
    return like.new_empty(num_rows, num_cols + pad)[:, :num_cols] if pad else like.new_empty(num_rows, num_cols)
