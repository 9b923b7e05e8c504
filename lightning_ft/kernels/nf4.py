"""4-bit blockwise dequantisation (bitsandbytes' NF4 / FP4 layout): packed nibbles -> a dense weight.

bitsandbytes' ``quantize_4bit`` stores a weight of ``n`` elements (flattened row-major) as ``ceil(n/2)``
bytes, element ``2i`` in the high nibble of byte ``i`` and element ``2i+1`` in its low nibble; each
nibble indexes a 16-entry code table (``quant_state.code``: NF4, the normal-float quantiles of QLoRA,
or FP4). Every ``blocksize`` (64) consecutive elements share one fp32 ``absmax``. With double
quantisation (``compress_statistics=True``, QLoRA's "double quant") the absmax are stored as uint8
indices into an 8-bit dynamic code (``state2.code``) with one fp32 scale per 256 absmax
(``state2.absmax``) and one fp32 ``offset`` (their mean, subtracted before quantising). Dequantised:

    absmax[b] = code2[qabsmax[b]] · absmax2[b // 256] + offset     (fp32, two roundings)
    w[e]      = code[nibble(e)] · absmax[e // 64]                   (fp32, rounded once to the output dtype)

exactly as bitsandbytes' own kernels round (CUDA ``kDequantizeBlockwise`` after ``dequantize_blockwise``
and ``absmax += offset``; the CPU reference ops): the Triton kernel is compiled without floating-point
contraction (``enable_fp_fusion=False``) so the absmax's multiply and add are not fused into one FMA,
and the result is bitwise bitsandbytes' ``dequantize_4bit`` (compared on the CPU under Triton's
interpreter, and on CUDA by the ``gpu`` tests). The fp32 -> bf16 rounding is done in integer arithmetic
(round to nearest even, as torch and CUDA round): Triton's interpreter would otherwise truncate.

`dequantize_4bit` writes into a buffer reused across calls (one per device and dtype, grown to the
largest weight): the QLoRA linear (`lightning_ft.kernels.qlora`) dequantises a layer's weight right
before its GEMM, in the forward and again in the backward, so only one dense weight exists at a time.

Sources: QLoRA, Dettmers et al. 2023 (arXiv:2305.14314); bitsandbytes 0.50 ``functional.quantize_4bit``,
``functional.dequantize_4bit``, ``backends/default/ops.py`` (the published algorithm, read for the layout).
"""

from __future__ import annotations

from math import prod
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import triton_can_run, warn_fallback

__all__ = ["Quant4bitWeight", "dequantize_4bit", "dequantize_4bit_reference"]

class Quant4bitWeight(NamedTuple):
    """A 4-bit weight in bitsandbytes' layout (tensors on the weight's device).

    Attributes:
        packed: uint8 [ceil(n/2)] (any storage dtype, viewed as bytes): two elements per byte, the first high.
        absmax: [ceil(n/blocksize)] fp32 scales, or uint8 indices into ``code2`` with double quantisation.
        code: fp32 [16]: the values a nibble indexes (NF4 or FP4).
        shape: the dense weight's shape; n = its number of elements.
        blocksize: elements per absmax (64 in QLoRA).
        absmax2, code2, offset: with double quantisation, fp32 [ceil(len(absmax)/blocksize2)] scales, the fp32
            [256] 8-bit code and the fp32 0-d offset; else None.
        blocksize2: absmax per ``absmax2`` (256).
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    shape: tuple[int, ...]
    blocksize: int = 64
    absmax2: torch.Tensor | None = None
    code2: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    blocksize2: int = 256

    @classmethod
    def from_quant_state(cls, packed: torch.Tensor, quant_state: Any) -> "Quant4bitWeight":
        """From bitsandbytes' ``Params4bit`` data and its ``QuantState`` (read by attribute: no import of bitsandbytes)."""
        nested = quant_state.nested
        state2 = quant_state.state2 if nested else None
        return cls(
            packed.view(torch.uint8).reshape(-1),
            quant_state.absmax,
            quant_state.code,
            tuple(quant_state.shape),
            quant_state.blocksize,
            state2.absmax if nested else None,
            state2.code if nested else None,
            quant_state.offset if nested else None,
            state2.blocksize if nested else 256,
        )


def dequantize_4bit_reference(weight: Quant4bitWeight, dtype: torch.dtype) -> torch.Tensor:
    """Plain-torch reference: the dense weight of ``weight.shape`` in ``dtype``, computed in fp32 as in the module docstring."""
    n = prod(weight.shape)
    absmax = weight.absmax.float()
    if weight.absmax2 is not None:
        scales = weight.absmax2.repeat_interleave(weight.blocksize2)[: absmax.numel()]
        absmax = weight.code2[weight.absmax.long()] * scales + weight.offset
    packed = weight.packed.view(torch.uint8).reshape(-1)
    nibbles = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:n]
    values = weight.code[nibbles.long()] * absmax.repeat_interleave(weight.blocksize)[:n]
    return values.to(dtype).view(weight.shape)


_BUFFERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _buffer(numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The first ``numel`` elements of the reused flat buffer for (device, dtype), grown to at least ``numel``."""
    buffer = _BUFFERS.get((device, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = _BUFFERS[(device, dtype)] = torch.empty(numel, device=device, dtype=dtype)
    return buffer[:numel]


def dequantize_4bit(weight: Quant4bitWeight, dtype: torch.dtype, reuse: bool = True) -> torch.Tensor:
    """The dense weight, [*weight.shape] in ``dtype``, by the Triton kernel (the reference where Triton cannot run).

    Args:
        weight: the 4-bit weight (`Quant4bitWeight.from_quant_state` for bitsandbytes' ``Params4bit``).
        dtype: the output dtype (bf16, fp16 or fp32).
        reuse: write into the shared buffer of this device and dtype (overwritten by the next call: use
            the result before dequantising another weight), else into a new tensor.

    Returns:
        A contiguous [*weight.shape] tensor, bitwise bitsandbytes' ``dequantize_4bit`` cast to ``dtype``
        where bitsandbytes computes in fp32 (see the module docstring).
    """
    packed = weight.packed
    n = prod(weight.shape)
    if weight.blocksize % 2:
        raise ValueError(f"4-bit blocksize {weight.blocksize}: expected an even number of elements per absmax")
    out = _buffer(n, packed.device, dtype) if reuse else torch.empty(n, device=packed.device, dtype=dtype)
    if not triton_can_run(packed):
        warn_fallback("dequantize_4bit", packed.device)
        out.copy_(dequantize_4bit_reference(weight, dtype).view(-1))
        return out.view(weight.shape)
    nested = weight.absmax2 is not None
    block = 1024  # bytes per program: 2048 elements
    grid = (triton.cdiv(packed.numel(), block),)
    _dequantize_4bit_kernel[grid](
        packed, weight.absmax, weight.code, weight.absmax2 if nested else weight.absmax,
        weight.code2 if nested else weight.code, weight.offset if nested else weight.code, out, n,
        BLOCK=block, BLOCKSIZE=weight.blocksize, BLOCKSIZE2=weight.blocksize2, NESTED=nested,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out.view(weight.shape)


@triton.jit
def _dequantize_4bit_kernel(
    packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, out_ptr, n,
    BLOCK: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK bytes -> 2·BLOCK elements (the high nibble first), each block's absmax looked up once per byte."""
    pid = tl.program_id(0)
    byte_idx = pid * BLOCK + tl.arange(0, BLOCK)
    in_bounds = byte_idx < (n + 1) // 2
    byte = tl.load(packed_ptr + byte_idx, mask=in_bounds, other=0).to(tl.int32)
    block = (2 * byte_idx) // BLOCKSIZE  # both nibbles of a byte share a block (BLOCKSIZE is even)
    if NESTED:
        qabsmax = tl.load(absmax_ptr + block, mask=in_bounds, other=0).to(tl.int32)
        scale = tl.load(absmax2_ptr + block // BLOCKSIZE2, mask=in_bounds, other=0.0)
        absmax = tl.load(code2_ptr + qabsmax) * scale + tl.load(offset_ptr)
    else:
        absmax = tl.load(absmax_ptr + block, mask=in_bounds, other=0.0)
    high = tl.load(code_ptr + (byte >> 4)) * absmax
    low = tl.load(code_ptr + (byte & 15)) * absmax
    values = tl.reshape(tl.join(high, low), (2 * BLOCK,))  # [h0, l0, h1, l1, ...]
    elem_idx = pid * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        # round to nearest even in integer arithmetic, as torch and bitsandbytes' kernels round (the GPU's
        # conversion would too; Triton's interpreter does not, so this keeps the CPU tests bitwise)
        bits = values.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        values = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(out_ptr + elem_idx, values.to(out_ptr.dtype.element_ty), mask=elem_idx < n)
