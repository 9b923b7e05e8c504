"""Launch helpers shared by the kernels: where Triton can run, warps per block, persistent grid size, padded rows, the
reused buffer 4-bit weights are dequantised into."""

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


_BUFFERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_RECORDED: list[torch.Tensor] = []  # buffers a CUDA graph wrote: kept alive, as replays write them at their address


def dequant_buffer(numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The first ``numel`` elements of the reused flat buffer for (device, dtype), grown to at least ``numel``: where a
    4-bit weight (NF4, `lightning_ft.kernels.nf4`; MXFP4, `lightning_ft.kernels.mxfp4`) is dequantised whole right
    before the GEMM that reads it, so one weight at a time is dense.

    Under CUDA graphs (`lightning_ft.strategies.cuda_graphs`) the recorded kernels write the buffer at its
    address on every replay, so a recorded buffer stays allocated after it is outgrown, and it may not grow
    while a graph records (its new memory would come from the graphs' private pool). The graphs record a layer
    only after it ran eagerly, which sized the buffer for its weights.

    Raises:
        RuntimeError: the buffer must grow while the current stream records a CUDA graph.
    """
    buffer = _BUFFERS.get((device, dtype))
    recording = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if buffer is None or buffer.numel() < numel:
        if recording:
            raise RuntimeError(
                f"the 4-bit dequantisation buffer ({dtype}) must grow to {numel} elements while a CUDA graph records: "
                "run the layer eagerly first (lightning_ft.strategies.cuda_graphs does), or set strategy.cuda_graphs=false"
            )
        buffer = _BUFFERS[(device, dtype)] = torch.empty(numel, device=device, dtype=dtype)
    if recording and not any(buffer is kept for kept in _RECORDED):
        _RECORDED.append(buffer)
    return buffer[:numel]
