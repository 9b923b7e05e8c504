"""MXFP4 weights (OCP Microscaling FP4): storage, quantisation, plain-torch dequantisation, the Triton tile load.

Layout (gpt-oss's published checkpoints, transformers' ``*_blocks`` / ``*_scales``): a weight W [..., N, C] is
quantised along C in blocks of 32 elements. Each element is an e2m1 code (1 sign, 2 exponent, 1 mantissa bit:
the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte, element ``2i`` in the LOW nibble of byte ``i`` and
``2i + 1`` in its high nibble; each block shares one e8m0 scale byte ``s`` (a power of two, 2^(s - 127)):

    blocks [..., N, C / 32, 16] uint8        scales [..., N, C / 32] uint8
    W[..., n, c] = e2m1(nibble(n, c)) · 2^(scales[..., n, c // 32] - 127)

Dequantised values are exact in bf16 and fp32 (one mantissa bit times a power of two; the extreme scales
0 and 255 aside, which `quantize_mxfp4` never writes for finite weights of normal range), so the dequantised
weight is the same in any compute dtype. Quantisation (`quantize_mxfp4`) follows the OCP spec: the shared
exponent is ``floor(log2(amax)) - 2`` (2 = e2m1's largest exponent), elements are divided by the scale,
rounded to the nearest e2m1 value (ties to the even code) and saturated at ±6.

`Mxfp4Weight` carries one 3-D expert weight in this layout to the grouped GEMMs, so the frozen experts stay in ~a
quarter of bf16's bytes (4.25 bits per weight). Before each GEMM it is dequantised whole into the reused 4-bit buffer
(`dequantize_mxfp4`, `lightning_ft.kernels._utils.dequant_buffer`: one expert weight at a time is dense) and read as a
dense weight. Why not in the GEMM's tile loads: on an H100 a grouped GEMM that decoded each B tile in registers
(`mxfp4_tile`) ran at about 100 TFLOP/s at gpt-oss's expert shapes, a fifth of the dense bf16 kernel, while the
whole weight's decode is one pass over its bytes (as NF4's, `lightning_ft.kernels.nf4`, measured 13× faster per step
than a decode in the tile loads).

Sources: OCP Microscaling Formats (MX) v1.0 specification (e2m1, e8m0, block 32, shared-exponent rule);
transformers 5 ``integrations/mxfp4.py`` (``FP4_VALUES``, ``_convert_moe_packed_tensors``: the nibble order
and the ``scales - 127`` exponent), read for the layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import dequant_buffer, triton_can_run, warn_fallback

__all__ = ["MXFP4_BLOCK", "Mxfp4Weight", "dequantize_mxfp4", "dequantize_mxfp4_reference", "mxfp4_tile", "quantize_mxfp4"]

MXFP4_BLOCK = 32  # elements per e8m0 scale
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitude of codes 0..7; bit 3 is the sign


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [..., N, C] (any float dtype, C a multiple of 32) -> (blocks [..., N, C/32, 16], scales [..., N, C/32]) uint8.

    Per block of 32 along C: biased exponent ``s = clamp(floor(log2(amax)) - 2 + 127, 0, 254)`` (amax 0: s = 0),
    codes = round-to-nearest-even e2m1 of ``W / 2^(s - 127)`` (computed in fp32), saturated at ±6.

    Raises:
        ValueError: C is not a multiple of 32.
    """
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 quantises along the last dim in blocks of {MXFP4_BLOCK}; got a weight of shape {tuple(w.shape)}")
    values = w.detach().float().contiguous().view(*w.shape[:-1], -1, MXFP4_BLOCK)
    amax = values.abs().amax(dim=-1, keepdim=True)
    exponent = (torch.floor(torch.log2(amax)) - 2 + 127).clamp(0, 254)  # log2(0) = -inf -> 0
    scaled = (values * torch.exp2(127 - exponent)).abs()
    grid = torch.tensor(_E2M1, device=w.device)
    bounds = (grid[1:] + grid[:-1]) / 2
    low = torch.bucketize(scaled, bounds, right=False)
    high = torch.bucketize(scaled, bounds, right=True)
    code = torch.where((low != high) & (low % 2 == 1), high, low)  # a tie goes to the even code
    code = code | torch.where(values < 0, 8, 0)
    code = code.to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), exponent[..., 0].to(torch.uint8)


def dequantize_mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plain torch: (blocks [..., N, G, 16], scales [..., N, G]) -> W [..., N, 32·G] in ``dtype``.

    ``e2m1(code) · 2^(s - 127)`` in fp32, then cast (exact, see the module docstring); for a 3-D weight this is
    transformers' ``convert_moe_packed_tensors(blocks, scales, dtype=dtype)`` before its final ``transpose(1, 2)``.
    """
    grid = torch.tensor(_E2M1, device=blocks.device)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()  # the low nibble first
    values = torch.where(codes >= 8, -grid[codes & 7], grid[codes & 7])
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


class Mxfp4Weight(NamedTuple):
    """A 3-D MXFP4 expert weight as the grouped GEMM reads it (in place of a dense [E, rows, cols] tensor).

    Attributes:
        blocks: uint8 [E, N, C/2] (the checkpoint's [E, N, C/32, 16] flattened: a view), last dim contiguous.
        scales: uint8 [E, N, C/32], last dim contiguous.
        dtype: the compute dtype (what the dense weight would be: the model's dtype).
        transposed: the logical tensor is [E, C, N] (a ``transpose(1, 2)`` of the stored [E, N, C]).
    """

    blocks: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype
    transposed: bool = False

    @classmethod
    def from_checkpoint(cls, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> Mxfp4Weight:
        """From the checkpoint's ``*_blocks`` [E, N, C/32, 16] and ``*_scales`` [E, N, C/32] (the logical [E, N, C])."""
        return cls(blocks.flatten(-2), scales, dtype)

    @property
    def shape(self) -> torch.Size:
        """The logical shape: [E, N, C], or [E, C, N] when transposed."""
        experts, rows, half = self.blocks.shape
        return torch.Size((experts, 2 * half, rows) if self.transposed else (experts, rows, 2 * half))

    def transpose(self, dim0: int, dim1: int) -> Mxfp4Weight:
        """The [E, C, N] <-> [E, N, C] view (no copy); only ``transpose(1, 2)``, as a dense 3-D weight is transposed here."""
        if {dim0 % 3, dim1 % 3} != {1, 2}:
            raise ValueError(f"an MXFP4 expert weight transposes its last two dims only, not ({dim0}, {dim1})")
        return self._replace(transposed=not self.transposed)

    def dequantize(self) -> torch.Tensor:
        """The dense logical weight in ``dtype`` (`dequantize_mxfp4_reference`; a transposed view when transposed)."""
        dense = dequantize_mxfp4_reference(self.blocks.unflatten(-1, (-1, 16)), self.scales, self.dtype)
        return dense.transpose(1, 2) if self.transposed else dense

    def dense_in_buffer(self) -> torch.Tensor:
        """The dense logical weight in ``dtype``, dequantised whole into the shared reused buffer (`dequantize_mxfp4`:
        `dequantize`'s values) and valid until the next dequantisation into it; a transposed view when transposed."""
        dense = dequantize_mxfp4(self.blocks, self.scales, self.dtype)
        return dense.transpose(1, 2) if self.transposed else dense


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(blocks [..., N, C/2], scales [..., N, C/32]) uint8 -> the stored dense W [..., N, C] in ``dtype``, written into
    the shared reused buffer of the device and dtype (`lightning_ft.kernels._utils.dequant_buffer`: overwritten by the
    next dequantisation) by a Triton kernel, one pass over the bytes; the reference where Triton cannot run. Equal to
    `dequantize_mxfp4_reference` (the values are exact in every float dtype).

    Raises:
        ValueError: blocks and scales whose shapes do not match (C/2 bytes and C/32 scales per row).
    """
    *lead, half = blocks.shape
    cols = 2 * half
    if tuple(scales.shape) != (*lead, cols // MXFP4_BLOCK) or cols % MXFP4_BLOCK:
        raise ValueError(f"dequantize_mxfp4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"(expected scales [..., N, C / {MXFP4_BLOCK}] for C = 2 * blocks' last dim)")
    rows = blocks[..., 0].numel()
    out = dequant_buffer(rows * cols, blocks.device, dtype).view(rows, cols)
    blocks_2d, scales_2d = blocks.reshape(rows, half), scales.reshape(rows, cols // MXFP4_BLOCK)
    if not triton_can_run(blocks):
        warn_fallback("dequantize_mxfp4", blocks.device)
        out.copy_(dequantize_mxfp4_reference(blocks_2d.unflatten(-1, (-1, 16)), scales_2d, dtype))
    else:
        block_rows, block_cols = 16, 256
        grid = (triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols))
        _dequantize_mxfp4_kernel[grid](
            blocks_2d, scales_2d, out, rows, cols, blocks_2d.stride(0), scales_2d.stride(0), out.stride(0),
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=4,
        )
    return out.view(*lead, cols)


@triton.jit
def mxfp4_tile(blocks_ptr, scales_ptr, rows, qcols, stride_b_row, stride_s_row, mask):
    """fp32 values of the MXFP4 weight at (rows, qcols) (broadcastable int index tensors; qcols along the quantised
    axis), 0 outside ``mask``: each element's nibble and its block's e8m0 scale, decoded in registers (exact)."""
    byte = tl.load(blocks_ptr + rows * stride_b_row + qcols // 2, mask=mask, other=0).to(tl.int32)
    code = (byte >> ((qcols & 1) * 4)) & 15  # the low nibble holds the even element
    scale = tl.load(scales_ptr + rows * stride_s_row + qcols // 32, mask=mask, other=127).to(tl.int32)
    exponent = (code >> 1) & 3
    mantissa = code & 1
    # e2m1: exponent 0 is the subnormal m·0.5; else (1 + m/2)·2^(exponent - 1), built as fp32 bits
    normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    value = tl.where((code & 8) != 0, -magnitude, magnitude)
    # 2^(s - 127) as fp32 bits (s >= 1); s = 0 is 2^-126 · 0.5 (fp32 has no normal 2^-127)
    power = (tl.maximum(scale, 1) << 23).to(tl.float32, bitcast=True)
    value = value * power
    return tl.where(scale == 0, value * 0.5, value)


@triton.jit
def _dequantize_mxfp4_kernel(
    blocks_ptr, scales_ptr, out_ptr, n_rows, n_cols, stride_b_row, stride_s_row, stride_out_row,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):  # fmt: skip
    """One program: a [BLOCK_ROWS, BLOCK_COLS] tile of the dense weight (`mxfp4_tile`), stored in out's dtype (exact)."""
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)[:, None]
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    values = mxfp4_tile(blocks_ptr, scales_ptr, rows, cols, stride_b_row, stride_s_row, mask)
    tl.store(out_ptr + rows * stride_out_row + cols, values.to(out_ptr.dtype.element_ty), mask=mask)
