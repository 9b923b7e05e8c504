"""fp8 linear layer over a frozen e4m3 weight: ``y = x Wᵀ + b`` with row-wise scales, no weight gradient.

Storage and math (e4m3 = ``torch.float8_e4m3fn``, largest finite value 448):

    weight   W ≈ Wq · sw[:, None]      Wq [N, K] e4m3, sw [N] fp32 = amax(|W[n, :]|) / 448   (`quantize_weight`)
    forward  x ≈ xq · sx               xq [M, K] e4m3, sx [M] fp32 = amax(|x[m, :]|) / 448    (`quantize_rows`)
             y = (xq Wqᵀ) · sx[:, None] · sw[None, :] + b
    backward dx = dy W = (dy · sw[None, :]) Wq ≈ (gq Wq) · sg[:, None],  (gq, sg) = quantize_rows(dy · sw)

W's per-output-channel scale lies along the backward's contraction dimension, where a row-wise
scale cannot sit, so it is folded into dy before dy is quantised per row (the product with sw and
the row maximum are one elementwise pass). The weight gets no gradient (frozen: LoRA).

On CUDA the products run through ``torch._scaled_mm`` with row-wise scales and a bf16 output
(sm90+). ``_scaled_mm`` takes its first operand row-major and its second column-major (cuBLASLt's
"TN" fp8 layout): the forward passes ``Wq.t()``, a column-major view of the row-major [N, K] weight,
as it is; the backward needs Wq [N, K] column-major, i.e. Wqᵀ [K, N] in row-major memory, so it
transposes the e4m3 weight into a new [K, N] tensor (`transpose_bytes`: N·K bytes, written once per backward)
instead of keeping a second copy for the whole run. Both
dimensions must be multiples of 16 there; other shapes (and every shape on the CPU) run
`fp8_linear_reference`'s math: the same quantised operands, dequantised and multiplied in fp32.

Fused quantisation: the kernel that writes a GEMM's input can write its e4m3 rows and scales too
(`e4m3_scale`, `e4m3_values`, `quantize_rows_tile` in Triton; `lightning_ft.kernels.rms_norm`,
`lightning_ft.kernels.swiglu` with ``fp8_rows``), left on its output (`attach_fp8_rows`) for
`fp8_linear` to take (``x_rows``, `fp8_rows_of`) instead of quantising x in a pass of its own.
Where no kernel left them (o_proj's input, every dy), `quantize_rows` is one Triton kernel on CUDA:
the row read twice (its largest magnitude, then its values), e4m3 written once.

Errors against the bf16 ``F.linear``: e4m3 keeps 3 mantissa bits (relative rounding ≤ 2⁻⁴ per
value), so each product carries about 5% relative error per term on random data; summed over K
terms of both signs the output's relative (Frobenius) error is about 3.5%, bounded at 8% in the
tests for forward and input gradient alike.

Source of the method: row-wise ("per-token / per-channel") fp8 scaling as in NVIDIA Transformer
Engine and torchao's float8 training; the ``_scaled_mm`` layout rules are PyTorch's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lightning_ft.kernels._utils import INTERPRETER, num_warps_for, triton_can_run

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
_AMAX_FLOOR = 1e-12  # an all-zero row gets this amax (its values quantise to zero either way)
_GEMM_MULTIPLE = 16  # _scaled_mm's requirement on K and N

__all__ = [
    "E4M3", "E4M3_MAX", "Fp8ExpertWeight", "attach_fp8_rows", "e4m3_cast", "e4m3_row_scales", "fp8_gemm_runs", "fp8_input_grad",
    "fp8_linear", "fp8_linear_reference", "fp8_mm_rowwise", "fp8_product", "fp8_rows_of",
    "fp8_rows_done", "fp8_rows_like", "quantize_rows", "quantize_rows_reference", "quantize_rows_triton",
    "quantize_expert_weight", "quantize_weight", "scaled_mm_shape", "scaled_mm_supported", "transpose_bytes",
]  # fmt: skip


def quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` (optionally times ``col_scale``) in e4m3 with its own fp32 scale.

    On CUDA one Triton kernel (`quantize_rows_triton`: a row read twice, e4m3 written once); elsewhere
    `quantize_rows_reference`, the same math in torch ops.

    Args:
        x: [M, K] in any float dtype.
        col_scale: optional [K] fp32 factor multiplied into every row first (in fp32).

    Returns:
        (q [M, K] e4m3, scale [M] fp32) with scale = amax(|row|) / 448 (an all-zero row: 1e-12 / 448)
        and ``q.float() * scale[:, None]`` ≈ the row (relative rounding ≤ 2⁻⁴; values below
        scale · 2⁻⁹ flush to zero).
    """
    return quantize_rows_triton(x, col_scale) if x.is_cuda else quantize_rows_reference(x, col_scale)


def quantize_rows_reference(
    x: torch.Tensor, col_scale: torch.Tensor | None = None, row_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `quantize_rows`: ``s = max(amax(|x·c|), 1e-12) / 448`` (`e4m3_row_scales`),
    ``q = clamp(x·c / s, ±448)`` cast to e4m3. ``row_scale``: [M] fp32 scales to use as s instead (a frozen weight's,
    computed once)."""
    x32 = x.float() if col_scale is None else x.float() * col_scale
    scale = e4m3_row_scales(x32) if row_scale is None else row_scale
    q = (x32 / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def e4m3_row_scales(x: torch.Tensor) -> torch.Tensor:
    """`quantize_rows`' scales of an fp32 [M, K] ``x``: [M] fp32 ``max(amax(|row|), 1e-12) / 448`` (exact maxima: no
    [M, K] temporary for |x|)."""
    low, high = torch.aminmax(x, dim=-1)
    return torch.maximum(high, -low).clamp_min(_AMAX_FLOOR) / E4M3_MAX


def fp8_rows_like(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (q [M, N], scale [M] fp32) for the fp8 rows of a [M, N] ``y``, for a kernel to fill with
    `e4m3_values` and `e4m3_scale`; `fp8_rows_done` makes them (q e4m3, scale).

    q is e4m3 on CUDA (the kernel's store rounds to nearest even, saturating). Under Triton's CPU
    interpreter q is fp32 and `fp8_rows_done` casts it with torch: the interpreter's fp32 → e4m3
    conversion rounds some values wrongly (127.47 became 64 instead of 128, Triton 3.9).
    """
    q_dtype = torch.float32 if y.device.type == "cpu" else E4M3
    return torch.empty(y.shape, dtype=q_dtype, device=y.device), torch.empty(y.shape[0], dtype=torch.float32, device=y.device)


def fp8_rows_done(rows: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3, scale) from the buffers of `fp8_rows_like` once a kernel has filled them."""
    q, scale = rows
    return (q if q.dtype == E4M3 else q.to(E4M3)), scale


@triton.jit
def e4m3_scale(amax):
    """Triton: `quantize_rows`' scale of a row whose largest magnitude is fp32 ``amax``."""
    return tl.maximum(amax, 1e-12) / 448.0  # _AMAX_FLOOR, E4M3_MAX


@triton.jit
def e4m3_values(y, scale):
    """Triton: fp32 ``y / scale`` clamped to ±448 (what `quantize_rows` casts to e4m3; the caller casts on store)."""
    return tl.minimum(tl.maximum(y / scale, -448.0), 448.0)


@triton.jit
def quantize_rows_tile(y):
    """Triton: (values, scale) of `quantize_rows` for a [BLOCK_M, BLOCK_N] fp32 tile holding whole rows (masked
    columns zero): values fp32, clamped, for the caller to cast to e4m3; scale [BLOCK_M] fp32."""
    scale = e4m3_scale(tl.max(tl.abs(y), axis=1))
    return e4m3_values(y, scale[:, None]), scale


# Triton 3.9's CPU interpreter converts fp32 to e4m3 wrongly where rounding carries into the exponent
# (31.6 became 16, not 32): there `e4m3_cast` rounds in fp32 first, and the conversion of the exact value is right.
_ROUND_IN_FP32 = tl.constexpr(INTERPRETER)
_RINT_MAGIC = 12582912.0  # 1.5 · 2²³: x + it - it is x rounded to the nearest integer, ties to even (|x| < 2²²)


@triton.jit
def e4m3_cast(values):
    """Triton: fp32 ``values`` within ±448 (`e4m3_values`) as e4m3, rounded to nearest even (in registers).

    Under the CPU interpreter the rounding is done in fp32 first (e4m3's spacing is 2^(e - 3) for a value of
    exponent e >= -6, 2⁻⁹ below), so that the conversion only meets exact values: see ``_ROUND_IN_FP32``.
    """
    if _ROUND_IN_FP32:  # the magnitude rounded, its sign put back (a value rounding to zero keeps it: -0, as torch)
        bits = values.to(tl.int32, bitcast=True)
        exponent = tl.maximum(((bits >> 23) & 255) - 127, -6)
        spacing = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3)
        rounded = ((tl.abs(values) / spacing + _RINT_MAGIC) - _RINT_MAGIC) * spacing
        values = (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return values.to(tl.float8e4nv)


@triton.jit
def _scaled_block(X, C, cols, mask, HAS_COL_SCALE: tl.constexpr):
    """A block of a row (X points at the row) in fp32, times the column scales C when given."""
    x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_COL_SCALE:
        x = x * tl.load(C + cols, mask=mask, other=0.0)
    return x


@triton.jit
def _quantize_rows_kernel(X, C, Q, S, n_cols, stride_x, HAS_COL_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: its largest magnitude over the column blocks, then the row in e4m3."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_scaled_block(X + row * stride_x, C, cols, cols < n_cols, HAS_COL_SCALE)))
    scale = e4m3_scale(tl.max(amax, axis=0))
    tl.store(S + row, scale)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = _scaled_block(X + row * stride_x, C, cols, cols < n_cols, HAS_COL_SCALE)
        tl.store(Q + row * n_cols + cols, e4m3_values(x, scale).to(Q.dtype.element_ty), mask=cols < n_cols)


_QUANT_BLOCK = 2048


def quantize_rows_triton(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in one Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1; there the rows are
    written as fp32 and cast by torch: `fp8_rows_like`). Same arguments and results, bit for bit on the CPU."""
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    q, scale = fp8_rows_like(x2)
    n_rows, n_cols = x2.shape
    if n_rows and n_cols:
        block = min(_QUANT_BLOCK, triton.next_power_of_2(n_cols))
        _quantize_rows_kernel[(n_rows,)](
            x2, x2 if col_scale is None else col_scale.contiguous(), q, scale, n_cols, x2.stride(0),
            HAS_COL_SCALE=col_scale is not None, BLOCK=block, num_warps=num_warps_for(block),
        )  # fmt: skip
    elif n_rows:
        scale.fill_(_AMAX_FLOOR / E4M3_MAX)
    return fp8_rows_done((q, scale))


@triton.jit
def _transpose_kernel(X, Y, n_rows, n_cols, BLOCK: tl.constexpr):
    """Y[c, r] = X[r, c] for one [BLOCK, BLOCK] tile; both row-major."""
    rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tile = tl.load(X + rows[:, None] * n_cols + cols[None, :], mask=mask)
    tl.store(Y + cols[:, None] * n_rows + rows[None, :], tl.trans(tile), mask=tl.trans(mask))


_TRANSPOSE_BLOCK = 128


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """A contiguous [N, K] tensor of a 1-byte dtype (e4m3) -> its transpose [K, N], contiguous.

    On CUDA one tiled Triton kernel over the bytes; elsewhere ``x.t().contiguous()``. Why: torch copies a
    transposed e4m3 tensor element by element without vectorising; in a dense fp8 step on an H100 (Llama-3.1-8B
    dims, 8 layers, 8K tokens) those copies of the weights for the input-gradient GEMMs took 12 ms of a 173 ms step.

    Raises:
        ValueError: if x is not a contiguous 2-D tensor of 1-byte elements.
    """
    if x.dim() != 2 or not x.is_contiguous() or x.element_size() != 1:
        raise ValueError(f"transpose_bytes: expected a contiguous 2-D tensor of 1-byte values, got {tuple(x.shape)} {x.dtype}")
    if not triton_can_run(x):
        return x.t().contiguous()
    n_rows, n_cols = x.shape
    out = torch.empty(n_cols, n_rows, dtype=x.dtype, device=x.device)
    if x.numel():
        grid = (triton.cdiv(n_rows, _TRANSPOSE_BLOCK), triton.cdiv(n_cols, _TRANSPOSE_BLOCK))
        _transpose_kernel[grid](x.view(torch.uint8), out.view(torch.uint8), n_rows, n_cols, BLOCK=_TRANSPOSE_BLOCK, num_warps=8)
    return out


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen [N, K] weight in e4m3 with one fp32 scale per output channel (row): `quantize_rows`."""
    return quantize_rows(weight.detach())


class Fp8ExpertWeight(NamedTuple):
    """A frozen 3-D expert weight in e4m3 as the Triton grouped GEMM reads it (in place of a dense [E, N, C] tensor).

    W[e] ≈ values[e] · scales[e]: one fp32 scale per expert, amax(|W[e]|) / 448 (`quantize_expert_weight`).
    e4m3's relative precision (3 mantissa bits) is the same across its normal range (2⁻⁶ to 448), so one scale per
    expert loses accuracy against one per output channel only for channels more than ~2¹⁴ below the expert's
    largest value (there values reach the subnormals, then flush to zero). And a scalar per expert is the only
    weight scale that both the forward (``x W[e]ᵀ``) and the input-gradient GEMM (``dy W[e]``, whose contraction
    runs along the forward's output channels) can apply after the dot, so that the GEMM's main loop is a plain
    fp8 dot chain in both directions.

    Attributes:
        values: e4m3 [E, N, C] (N the output, C the input size of ``x W[e]ᵀ``), any strides.
        scales: fp32 [E].
        dtype: the compute dtype (what the dense weight would be: the model's dtype).
        transposed: the logical tensor is [E, C, N] (a ``transpose(1, 2)`` of [E, N, C]).
    """

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype
    transposed: bool = False

    @property
    def shape(self) -> torch.Size:
        """The logical shape: [E, N, C], or [E, C, N] when transposed."""
        return self.logical_values().shape

    def logical_values(self) -> torch.Tensor:
        """``values`` in the logical layout (a transposed view when transposed, no copy)."""
        return self.values.transpose(1, 2) if self.transposed else self.values

    def transpose(self, dim0: int, dim1: int) -> Fp8ExpertWeight:
        """The [E, C, N] <-> [E, N, C] view (no copy); only ``transpose(1, 2)``, as a dense 3-D weight is transposed here."""
        if {dim0 % 3, dim1 % 3} != {1, 2}:
            raise ValueError(f"an fp8 expert weight transposes its last two dims only, not ({dim0}, {dim1})")
        return self._replace(transposed=not self.transposed)

    def dequantize(self) -> torch.Tensor:
        """The dense logical weight ``values · scales`` (in fp32, then cast to ``dtype``)."""
        return (self.logical_values().float() * self.scales[:, None, None]).to(self.dtype)


def quantize_expert_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen expert weight [E, N, C] (any strides) -> (values [E, N, C] e4m3 contiguous, scales [E] fp32): one
    scale per expert, amax(|W[e]|) / 448 (an all-zero expert: 1e-12 / 448), each value rounded as
    `quantize_rows_reference` rounds. One expert at a time: a transient fp32 copy of one expert's weight."""
    experts, rows, cols = weight.shape
    values = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
    scales = torch.empty(experts, dtype=torch.float32, device=weight.device)
    for e in range(experts):
        w32 = weight[e].detach().float().reshape(1, rows * cols)
        scales[e] = e4m3_row_scales(w32)[0]
        values[e] = quantize_rows_reference(w32, row_scale=scales[e : e + 1])[0].view(rows, cols)
    return values, scales


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` with row-wise scales runs on ``device``: CUDA of compute capability 9.0+."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def fp8_mm_rowwise(
    aq: torch.Tensor, a_scale: torch.Tensor, bq: torch.Tensor, b_scale: torch.Tensor | None, use_scaled_mm: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(aq · a_scale[:, None]) @ (bq · b_scale[:, None])ᵀ``: aq [M, K], bq [N, K] e4m3 (bq any layout), scales
    fp32 [M] and [N] (None: ones). bf16 [M, N] through ``_scaled_mm`` (written into ``out`` when given: bf16,
    contiguous), else fp32 from the dequantised operands (copied into ``out``, in its dtype, when given)."""
    if use_scaled_mm:
        b_scale = b_scale if b_scale is not None else torch.ones(bq.shape[0], device=bq.device)
        return torch._scaled_mm(
            aq, bq.t(), scale_a=a_scale[:, None], scale_b=b_scale[None, :], out_dtype=torch.bfloat16, use_fast_accum=False,
            **({} if out is None else {"out": out}),
        )  # fmt: skip
    b = bq.float() if b_scale is None else bq.float() * b_scale[:, None]
    y = (aq.float() * a_scale[:, None]) @ b.t()
    return y if out is None else out.copy_(y)


class _Fp8Linear(torch.autograd.Function):
    """x [M, K] → x Wᵀ + b in ``out_dtype`` with W = Wq · sw[:, None] (module docstring); gradient for x only."""

    @staticmethod
    def forward(ctx, x, weight, weight_scale, bias, out_dtype, use_scaled_mm, x_rows):
        y = fp8_product(x, weight, weight_scale, bias, out_dtype, x_rows, use_scaled_mm)
        ctx.save_for_backward(weight, weight_scale)
        ctx.x_dtype, ctx.use_scaled_mm = x.dtype, use_scaled_mm
        return y

    @staticmethod
    def backward(ctx, dy):
        weight, weight_scale = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = fp8_input_grad(dy, weight, weight_scale, ctx.use_scaled_mm).to(ctx.x_dtype)
        return dx, None, None, None, None, None, None


def scaled_mm_shape(weight: torch.Tensor) -> bool:
    """Whether ``_scaled_mm`` takes a product with this [N, K] weight: N and K multiples of 16."""
    n, k = weight.shape
    return n % _GEMM_MULTIPLE == 0 and k % _GEMM_MULTIPLE == 0


def fp8_gemm_runs(device: torch.device, weight: torch.Tensor) -> bool:
    """Whether a product with this [N, K] e4m3 weight runs ``_scaled_mm`` on ``device`` (sm90+ and `scaled_mm_shape`),
    else `fp8_mm_rowwise`'s fp32 reference."""
    return scaled_mm_supported(device) and scaled_mm_shape(weight)


def fp8_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    x_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    use_scaled_mm: bool | None = None,
) -> torch.Tensor:
    """`fp8_linear`'s forward product without autograd: ``(xq Wqᵀ) · sx · sw + b`` in ``out_dtype``.

    Args:
        x: [M, K] (quantised per row unless ``x_rows`` holds its rows); weight: [N, K] e4m3; weight_scale: [N] fp32;
            bias: [N] or None (added in ``out_dtype``).
        x_rows: (q [M, K] e4m3, scale [M] fp32), `quantize_rows` of x, or None.
        use_scaled_mm: ``_scaled_mm`` (True) or the fp32 reference (False); None: as `fp8_linear` decides.

    Returns:
        [M, N] in ``out_dtype``.
    """
    if use_scaled_mm is None:
        use_scaled_mm = fp8_gemm_runs(x.device, weight)
    xq, x_scale = x_rows if x_rows is not None else quantize_rows(x)
    y = fp8_mm_rowwise(xq, x_scale, weight, weight_scale, use_scaled_mm).to(out_dtype)
    return y if bias is None else y + bias.to(out_dtype)


def fp8_input_grad(
    dy: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, use_scaled_mm: bool | None = None
) -> torch.Tensor:
    """The input gradient of `fp8_linear`, ``dy W`` with W = Wq · sw (module docstring): dy · sw quantised per row,
    times the e4m3 weight.

    Args:
        dy: [M, N] output gradient; weight: [N, K] e4m3; weight_scale: [N] fp32.
        use_scaled_mm: ``_scaled_mm`` (True) or the fp32 reference (False); None: as `fp8_linear` decides.

    Returns:
        [M, K], bf16 from ``_scaled_mm``, fp32 from the reference (the caller casts).
    """
    if use_scaled_mm is None:
        use_scaled_mm = fp8_gemm_runs(dy.device, weight)
    gq, g_scale = quantize_rows(dy, col_scale=weight_scale)
    # fp8_mm_rowwise's second operand is [K, N]: Wqᵀ, in row-major memory for _scaled_mm (its column-major [N, K])
    w_t = transpose_bytes(weight) if use_scaled_mm else weight.t()
    return fp8_mm_rowwise(gq, g_scale, w_t, None, use_scaled_mm)


def _run(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias, use_scaled_mm: bool, x_rows) -> torch.Tensor:
    if weight.dtype != E4M3 or weight_scale.shape != weight.shape[:1]:
        raise ValueError(
            f"fp8_linear: expected an e4m3 weight [N, K] and an fp32 scale [N], got {weight.dtype} {tuple(weight.shape)} "
            f"and {tuple(weight_scale.shape)}"
        )
    out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x2 = x.reshape(-1, x.shape[-1])
    if x_rows is not None and x_rows[0].shape != x2.shape:
        raise ValueError(f"fp8_linear: x_rows of {tuple(x_rows[0].shape)} for an x of {tuple(x2.shape)} rows")
    y2 = _Fp8Linear.apply(x2, weight, weight_scale, bias, out_dtype, use_scaled_mm, x_rows)
    return y2 if x.dim() == 2 else y2.view(*x.shape[:-1], weight.shape[0])


_ROWS_ATTR = "_lightning_ft_fp8_rows"  # on a kernel's output: (its version then, (q, scale))


def attach_fp8_rows(y: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Leave ``rows`` (y's fp8 rows from the kernel that wrote y: `lightning_ft.kernels.rms_norm.rms_norm`,
    `lightning_ft.kernels.swiglu.swiglu` with ``fp8_rows``) on ``y`` for `fp8_rows_of`; returns y."""
    setattr(y, _ROWS_ATTR, (y._version, rows))
    return y


def fp8_rows_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fp8 rows `attach_fp8_rows` left on this very tensor, while it is unchanged since (else None)."""
    attached = getattr(x, _ROWS_ATTR, None)
    return attached[1] if attached is not None and attached[0] == x._version else None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    x_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x Wᵀ + b`` with a frozen e4m3 weight (module docstring): ``_scaled_mm`` where it runs, else the reference.

    Args:
        x: [..., K] activations (any float dtype; quantised per row).
        weight: [N, K] e4m3 (`quantize_weight`); weight_scale: [N] fp32; bias: [N] or None (added in the output dtype).
        x_rows: x's rows already quantised, (q [M, K] e4m3, scale [M] fp32) as `quantize_rows` of x's [M, K]
            rows (a kernel's fused output, `fp8_rows_of`): no quantisation pass here; None: x is quantised.

    Returns:
        [..., N] in the autocast dtype when autocast is on, else x's dtype. Differentiable in x only.

    Raises:
        ValueError: a weight that is not e4m3, a scale that is not [N], or ``x_rows`` of another shape than x's rows.
    """
    return _run(x, weight, weight_scale, bias, fp8_gemm_runs(x.device, weight), x_rows)


def fp8_linear_reference(x, weight, weight_scale, bias=None, x_rows=None) -> torch.Tensor:
    """Plain-torch `fp8_linear` (the same arguments): the same quantised operands (x per row; dy · sw per row in
    the backward), dequantised and multiplied in fp32, then cast to the output dtype."""
    return _run(x, weight, weight_scale, bias, False, x_rows)
