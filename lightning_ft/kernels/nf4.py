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

`Nf4ExpertWeight` carries a 3-D MoE expert weight quantised the same way (the whole [E, rows, cols] tensor as
one bitsandbytes weight) to the Triton grouped GEMM (`lightning_ft.kernels.moe.grouped_gemm`), which dequantises
it whole into that buffer right before each GEMM (`Nf4ExpertWeight.dense_in_buffer`) and reads it dense.

In e4m3 (``strategy.fp8``: 4-bit storage, fp8 compute) a 2-D [N, K] weight is written as the fp8 GEMMs of
`lightning_ft.kernels.fp8` read a frozen weight: row n in e4m3 with the fp32 scale s[n] = amax(|row n|) / 448
(`e4m3_scales_4bit`, computed once per weight from its fp32 dequantisation), each element ``clamp(w / s[n], ±448)``
rounded to nearest even from the same fp32 value w as above, with a correctly rounded division: bitwise
``quantize_rows_reference(dequantize_4bit_reference(w, float32))`` (1 byte an element, half the bf16 dequantisation's).
Triton's CPU interpreter converts fp32 to e4m3 wrongly, so the kernel rounds in fp32 first there
(`lightning_ft.kernels.fp8.e4m3_cast`).

Sources: QLoRA, Dettmers et al. 2023 (arXiv:2305.14314); bitsandbytes 0.50 ``functional.quantize_4bit``,
``functional.dequantize_4bit``, ``backends/default/ops.py`` (the published algorithm, read for the layout).
"""

from __future__ import annotations

from math import prod
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import dequant_buffer, triton_can_run, warn_fallback
from lightning_ft.kernels.fp8 import E4M3, e4m3_cast, e4m3_row_scales, quantize_rows_reference

__all__ = ["Nf4ExpertWeight", "Quant4bitWeight", "dequantize_4bit", "dequantize_4bit_reference", "e4m3_scales_4bit"]

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


_CODE = 16  # entries of the 4-bit code
_CODE2 = 256  # entries of the 8-bit absmax code
_BLOCKSIZE = 64  # `Nf4ExpertWeight`'s blocks: elements per absmax
_BLOCKSIZE2 = 256  # absmax per fp32 absmax2 scale


class Nf4ExpertWeight(NamedTuple):
    """A 3-D expert weight in NF4 with double quantisation, as the Triton grouped GEMM takes it (in place of a dense
    [E, rows, cols] tensor; dequantised into the reused buffer before each GEMM, `dense_in_buffer`): bitsandbytes'
    ``quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")`` of the whole stored tensor, so
    exactly QLoRA's layout and bytes: 4 bits a weight plus 8 bits per 64 weights plus 32 bits per 64·256, ~0.516
    bytes a weight against bf16's 2. The stored tensor is quantised row-major as bitsandbytes flattens it: element f
    (its flat index) in the high nibble of byte f // 2 when f is even, in block f // 64; blocks may straddle rows and
    experts, so any shape works.

    Attributes:
        packed: uint8 [ceil(n/2)] (n the stored weight's elements): bitsandbytes' packed data, flattened.
        absmax: uint8 [ceil(n/64)]: each block's absmax as an index into the 8-bit code.
        absmax2: fp32 [ceil(n/64/256)]: the scale of each 256 absmax.
        tables: fp32 [16 + 256 + 1]: the NF4 code (``quant_state.code``), the 8-bit dynamic code of the
            absmax (``state2.code``) and the absmax offset (``quant_state.offset``), in one tensor.
        stored_shape: the stored weight's shape [E, rows, cols] (the parameter it replaces).
        dtype: the compute dtype (what the dense weight would be: the model's dtype).
        transposed: the logical tensor is the stored one's ``transpose(1, 2)``.
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    absmax2: torch.Tensor
    tables: torch.Tensor
    stored_shape: torch.Size
    dtype: torch.dtype
    transposed: bool = False

    @classmethod
    def from_quant_state(cls, packed: torch.Tensor, quant_state: Any, dtype: torch.dtype) -> Nf4ExpertWeight:
        """From bitsandbytes' ``quantize_4bit`` output for a 3-D weight (read by attribute: no import of bitsandbytes).

        Raises:
            ValueError: not a 3-D NF4 weight in blocks of 64 with double quantisation in blocks of 256.
        """
        weight = Quant4bitWeight.from_quant_state(packed, quant_state)
        if (len(weight.shape), quant_state.quant_type, weight.blocksize, weight.absmax2 is None, weight.blocksize2) != (
            3, "nf4", _BLOCKSIZE, False, _BLOCKSIZE2
        ):
            raise ValueError(
                "an NF4 expert weight is a 3-D NF4 weight in blocks of 64 with double quantisation (blocks of 256); got "
                f"shape {weight.shape}, {quant_state.quant_type}, blocksize {weight.blocksize}, nested {weight.absmax2 is not None}"
            )
        tables = torch.cat([weight.code.float(), weight.code2.float(), weight.offset.float().reshape(1)])
        return cls(weight.packed, weight.absmax, weight.absmax2.float(), tables, torch.Size(weight.shape), dtype)

    def quant4bit(self) -> Quant4bitWeight:
        """The stored weight as a `Quant4bitWeight` (views of the same tensors)."""
        code, code2, offset = self.tables.split([_CODE, _CODE2, 1])
        return Quant4bitWeight(
            self.packed, self.absmax, code, tuple(self.stored_shape), _BLOCKSIZE, self.absmax2, code2, offset[0],
            _BLOCKSIZE2,
        )

    def dense_in_buffer(self) -> torch.Tensor:
        """The logical dense weight in the compute dtype, dequantised whole into the shared reused buffer
        (`dequantize_4bit`: bitwise `dequantize`'s values) and valid until the next dequantisation into it; when
        transposed, the stored weight dequantised and then viewed transposed (no copy)."""
        dense = dequantize_4bit(self.quant4bit(), self.dtype)
        return dense.transpose(1, 2) if self.transposed else dense

    @property
    def shape(self) -> torch.Size:
        """The logical shape: the stored one, or its last two dims swapped when transposed."""
        experts, rows, cols = self.stored_shape
        return torch.Size((experts, cols, rows) if self.transposed else (experts, rows, cols))

    def transpose(self, dim0: int, dim1: int) -> Nf4ExpertWeight:
        """The ``transpose(1, 2)`` view (no copy); only that, as a dense 3-D expert weight is transposed here.

        Raises:
            ValueError: other dims.
        """
        if {dim0 % 3, dim1 % 3} != {1, 2}:
            raise ValueError(f"an NF4 expert weight transposes its last two dims only, not ({dim0}, {dim1})")
        return self._replace(transposed=not self.transposed)

    def dequantize(self) -> torch.Tensor:
        """The dense logical weight in ``dtype`` (`dequantize_4bit_reference`; a transposed view when transposed)."""
        dense = dequantize_4bit_reference(self.quant4bit(), self.dtype)
        return dense.transpose(1, 2) if self.transposed else dense


def dequantize_4bit(
    weight: Quant4bitWeight, dtype: torch.dtype, reuse: bool = True, fp8_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The dense weight, [*weight.shape] in ``dtype``, by the Triton kernel (the reference where Triton cannot run).

    Args:
        weight: the 4-bit weight (`Quant4bitWeight.from_quant_state` for bitsandbytes' ``Params4bit``).
        dtype: the output dtype (bf16, fp16 or fp32), or e4m3 (``torch.float8_e4m3fn``) with ``fp8_scale``.
        reuse: write into the shared buffer of this device and dtype (overwritten by the next call: use
            the result before dequantising another weight), else into a new tensor.
        fp8_scale: for e4m3, the [N] fp32 row scales of a 2-D [N, K] weight (`e4m3_scales_4bit`).

    Returns:
        A contiguous [*weight.shape] tensor, bitwise bitsandbytes' ``dequantize_4bit`` cast to ``dtype``
        where bitsandbytes computes in fp32 (see the module docstring); in e4m3, bitwise
        ``quantize_rows_reference(dequantize_4bit_reference(weight, float32), row_scale=fp8_scale)[0]``.

    Raises:
        ValueError: an odd blocksize; e4m3 without ``fp8_scale``, or not of a 2-D weight with [N] scales; ``fp8_scale``
            with another dtype.
    """
    packed = weight.packed
    n = prod(weight.shape)
    if weight.blocksize % 2:
        raise ValueError(f"4-bit blocksize {weight.blocksize}: expected an even number of elements per absmax")
    e4m3 = dtype == E4M3
    if e4m3 != (fp8_scale is not None) or (e4m3 and (len(weight.shape) != 2 or tuple(fp8_scale.shape) != weight.shape[:1])):
        raise ValueError(
            f"dequantize_4bit: e4m3 takes a 2-D weight and its [N] fp32 fp8_scale, other dtypes none; got {dtype}, "
            f"weight {weight.shape}, fp8_scale {None if fp8_scale is None else tuple(fp8_scale.shape)}"
        )
    out = dequant_buffer(n, packed.device, dtype) if reuse else torch.empty(n, device=packed.device, dtype=dtype)
    if not triton_can_run(packed):
        warn_fallback("dequantize_4bit", packed.device)
        if e4m3:
            dense = quantize_rows_reference(dequantize_4bit_reference(weight, torch.float32), row_scale=fp8_scale)[0]
        else:
            dense = dequantize_4bit_reference(weight, dtype)
        out.copy_(dense.view(-1))
        return out.view(weight.shape)
    nested = weight.absmax2 is not None
    block = 1024  # bytes per program: 2048 elements
    grid = (triton.cdiv(packed.numel(), block),)
    _dequantize_4bit_kernel[grid](
        packed, weight.absmax, weight.code, weight.absmax2 if nested else weight.absmax,
        weight.code2 if nested else weight.code, weight.offset if nested else weight.code,
        fp8_scale if e4m3 else weight.code, out, n, weight.shape[-1],
        BLOCK=block, BLOCKSIZE=weight.blocksize, BLOCKSIZE2=weight.blocksize2, NESTED=nested, E4M3_OUT=e4m3,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out.view(weight.shape)


def e4m3_scales_4bit(weight: Quant4bitWeight) -> torch.Tensor:
    """The [N] fp32 row scales of a 2-D [N, K] 4-bit weight in e4m3: ``max(amax(|row|), 1e-12) / 448`` of its fp32
    dequantisation (`lightning_ft.kernels.fp8.e4m3_row_scales`), as `lightning_ft.kernels.fp8.quantize_weight` scales
    a dense weight. One transient fp32 [N, K] copy (not the reused buffer: freed on return).

    Raises:
        ValueError: a weight that is not 2-D.
    """
    if len(weight.shape) != 2:
        raise ValueError(f"e4m3_scales_4bit: a 2-D [N, K] weight expected, got shape {weight.shape}")
    return e4m3_row_scales(dequantize_4bit(weight, torch.float32, reuse=False))


@triton.jit
def _dequantize_4bit_kernel(
    packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr, scale_ptr, out_ptr, n, row_len,
    BLOCK: tl.constexpr, BLOCKSIZE: tl.constexpr, BLOCKSIZE2: tl.constexpr, NESTED: tl.constexpr, E4M3_OUT: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK bytes -> 2·BLOCK elements (the high nibble first), each block's absmax looked up once per byte;
    E4M3_OUT: each element divided by its row's scale (``scale_ptr``, rows of ``row_len``) and written in e4m3."""
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
    in_weight = elem_idx < n
    if E4M3_OUT:  # as quantize_rows_reference: w / s correctly rounded in fp32, clamped to ±448, then to nearest even
        row_scale = tl.load(scale_ptr + elem_idx // row_len, mask=in_weight, other=1.0)
        scaled = tl.minimum(tl.maximum(tl.math.div_rn(values, row_scale), -448.0), 448.0)
        tl.store(out_ptr + elem_idx, e4m3_cast(scaled), mask=in_weight)
    else:
        tl.store(out_ptr + elem_idx, _round_to(values, out_ptr.dtype.element_ty), mask=in_weight)


@triton.jit
def _round_to(values, dtype: tl.constexpr):
    """fp32 ``values`` in ``dtype``, rounded to nearest even. bf16 in integer arithmetic, as torch and bitsandbytes'
    kernels round (the GPU's conversion would too; Triton's interpreter truncates, so this keeps the CPU tests bitwise)."""
    if dtype == tl.bfloat16:
        bits = values.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        rounded = values.to(dtype)
    return rounded

