"""The ``triton`` MoE experts backend: our grouped GEMM kernels with split LoRA in the epilogue.

* ``triton``: our grouped GEMM kernels. The gather x[token_idx] is fused into the first GEMM's loads,
  the routing-weight multiply and un-permute store into the second GEMM's epilogue (the final sum
  over K is a deterministic reduction, no atomics), split LoRA is added in the epilogue of the base
  GEMM (its thin [S, R] middle comes from one more launch of the same kernel), and the backward runs
  on the same kernels plus a ragged per-expert weight-gradient kernel. Neither the gathered [S, D]
  input nor the [S, D] expert outputs are kept for backward. Each program maps its row tile to an
  expert from the device offsets (the grid is the host bound ceil(S / BLOCK_M) + min(E, S) - 1 row
  tiles times the column tiles, column tiles fastest; idle ones skip the loop), so it is sync-free. Autotuned once per (sizes, dtypes, flags) key
  and cached by Triton (on disk where supported). On the CPU only under ``TRITON_INTERPRET=1``
  (how the tests run it).

`grouped_gemm` and `grouped_wgrad` are also the thin LoRA products of the ``grouped_mm`` backend
(`lightning_ft.kernels.moe.grouped_mm`) and its fused gathers. Math, shapes and split LoRA:
`lightning_ft.kernels.moe._common`; the plain-torch reference of the backend is ``native_torch``, those of
the two launchers `grouped_gemm_reference` and `grouped_wgrad_reference`.

fp8 experts (an `lightning_ft.kernels.fp8.Fp8ExpertWeight`, ``strategy.fp8``): in the forward the callers quantise
the GEMM's input once per row (`lightning_ft.kernels.fp8.quantize_rows`) and the same kernel runs a plain e4m3 dot
chain, the row and per-expert weight scales applied in the epilogue; the input gradients pass their rows as they are
and the kernel widens the e4m3 weight tiles to bf16 (see `grouped_gemm`); split LoRA, the thin launches and the
weight gradients stay in the activations' dtype. MXFP4 and NF4 experts (`lightning_ft.kernels.mxfp4.Mxfp4Weight`,
`lightning_ft.kernels.nf4.Nf4ExpertWeight`): dequantised whole into the reused 4-bit buffer before each launch
(their ``dense_in_buffer``), then read as a dense weight.

Sources: the Triton matmul tutorial for tiling (and its fp8 variant: e4m3 operands, fp32 accumulator); row-wise
("per-token") activation scales as in NVIDIA Transformer Engine and torchao's float8 training, applied after
the dot with a per-tensor (here per-expert) weight scale.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from lightning_ft.kernels.fp8 import E4M3, Fp8ExpertWeight, quantize_rows
from lightning_ft.kernels.moe._common import _INTERPRET, ExpertBiases, _lora_args, _swiglu
from lightning_ft.kernels.moe.routing import unread_output
from lightning_ft.kernels.mxfp4 import Mxfp4Weight
from lightning_ft.kernels.nf4 import Nf4ExpertWeight

__all__ = ["grouped_gemm", "grouped_gemm_reference", "grouped_wgrad", "grouped_wgrad_reference"]

#: the 4-bit expert weights, dequantised whole into the reused buffer before each GEMM (``dense_in_buffer``)
_FOUR_BIT_WEIGHTS = (Mxfp4Weight, Nf4ExpertWeight)
#: the frozen quantised expert weights (not tensors: kept on the autograd ctx; the reference dequantises them)
_QUANTISED_WEIGHTS = (*_FOUR_BIT_WEIGHTS, Fp8ExpertWeight)


def _clamped(configs, caps: dict[str, int]) -> list:
    """``configs`` with each named block size capped (thin dims are R or small), duplicates removed."""
    seen, clamped = set(), []
    for config in configs:
        meta = {name: min(size, caps.get(name, size)) for name, size in config.kwargs.items()}
        key = (tuple(sorted(meta.items())), config.num_warps, config.num_stages)
        if key not in seen:
            seen.add(key)
            clamped.append(triton.Config(meta, num_warps=config.num_warps, num_stages=config.num_stages))
    return clamped


def _cap(size: int) -> int:
    return max(16, triton.next_power_of_2(size))  # tl.dot needs every block dim >= 16


def _prune_gemm_configs(configs, named_args, **kwargs):
    """Fit BLOCK_N / BLOCK_C to the problem; thin LoRA GEMMs (N = R) try only the first two configs; the configs
    with BLOCK_C = 128 are the e4m3 x e4m3 path's only (half the bytes per tile), whose ``tl.dot`` needs BLOCK_C >= 32."""
    n_cap = _cap(named_args["N"])
    if kwargs.get("FP8_SRC"):
        c_cap = max(32, _cap(named_args["C"]))
    else:
        c_cap, configs = _cap(named_args["C"]), [c for c in configs if c.kwargs["BLOCK_C"] <= 64]
    return _clamped(configs[:2] if n_cap <= 32 else configs, {"BLOCK_N": n_cap, "BLOCK_C": c_cap})


def _prune_wgrad_configs(configs, named_args, **kwargs):
    """Fit BLOCK_M / BLOCK_N to the problem (one of them is R for LoRA gradients)."""
    return _clamped(configs, {"BLOCK_M": _cap(named_args["M"]), "BLOCK_N": _cap(named_args["N"])})


def _configs(names: tuple[str, str, str], gpu: list[tuple[int, ...]], interpret: tuple[int, int, int]) -> list:
    """Autotune configs from (block sizes..., num_warps, num_stages) rows; one small config when interpreted."""
    if _INTERPRET:
        return [triton.Config(dict(zip(names, interpret)), num_warps=4, num_stages=1)]
    return [triton.Config(dict(zip(names, (a, b, c))), num_warps=w, num_stages=s) for a, b, c, w, s in gpu]


# Autotune choices persist on disk where this Triton can (``cache_results``), else per process.
_AUTOTUNE_KW = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


@triton.jit
def _load_tile(ptr, rows, cols, stride_row, stride_col, row_mask, col_mask):
    """The [rows, cols] tile at ``ptr + rows * stride_row + cols * stride_col``, zeros outside the masks."""
    return tl.load(
        ptr + rows[:, None] * stride_row + cols[None, :] * stride_col,
        mask=row_mask[:, None] & col_mask[None, :],
        other=0.0,
    )


@triton.jit
def _row_index(idx_ptr, rows, mask, GATHER: tl.constexpr):
    """The int64 rows to address: ``idx[rows]`` (0 outside ``mask``) with GATHER, else ``rows``."""
    if GATHER:
        index = tl.load(idx_ptr + rows, mask=mask, other=0).to(tl.int64)
    else:
        index = rows.to(tl.int64)
    return index


@triton.jit
def _dot_operands(a, b, DOT_UPCAST: tl.constexpr):
    """``a`` and ``b`` as ``tl.dot`` takes them: upcast to fp32 where `_dot_options` says so."""
    if DOT_UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def _grouped_gemm_body(
    src_ptr, src_idx_ptr, w_ptr, out_ptr, out_idx_ptr, row_scale_ptr, mid_ptr, lora_b_ptr, offsets_ptr, acc_ptr,
    gathered_ptr, bias_ptr, w_scales_ptr, src_scale_ptr,
    N, C, R, E, scaling, alpha,
    stride_src_m, stride_src_c,
    stride_g_m, stride_g_c,
    stride_w_e, stride_w_c, stride_w_n,
    stride_out_m, stride_out_n,
    stride_acc_m, stride_acc_n,
    stride_mid_m, stride_mid_r,
    stride_lb_e, stride_lb_r, stride_lb_n,
    stride_bias_e, stride_bias_n,
    stride_ws_e,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACCUMULATE: tl.constexpr, STORE_GATHERED: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    FP8: tl.constexpr, FP8_SRC: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out[orow(p)] (+)= alpha * scale[p] * (src[irow(p)] @ w[e(p)] + scaling * mid[p] @ lora_b[e(p)] + bias[e(p)]).

    bias [E, N] with HAS_BIAS (else no term); p runs over expert-sorted rows; irow(p) = src_idx[p] if GATHER else p; orow(p) = out_idx[p] if
    SCATTER else p; scale = row_scale if ROW_SCALE else 1; w is [E, C, N], lora_b [E, R, N], mid
    [S, R]; fp32 accumulation, stored in out's dtype; ACCUMULATE adds acc[orow(p)] first (in fp32;
    acc is out itself for an in-place sum). STORE_GATHERED also writes the src rows it loads to
    gathered[p] (the column tiles of pid_n == 0: each row once). FP8: w is e4m3
    (w_ptr any strides) and the epilogue multiplies the accumulator by the expert's fp32 scale (w_scales_ptr [E],
    stride stride_ws_e) before LoRA and bias; with FP8_SRC src is e4m3 too, the main loop a plain fp8 dot chain into
    the fp32 accumulator, and the epilogue's factor also src_scale[irow(p)] (fp32, one per src row); without it
    each B tile is widened to src's dtype in registers (exact) and the dot runs in that dtype.
    """
    # Column tiles fastest: the programs in flight cover a few row tiles and all their column tiles, so each row
    # tile (and its expert's weight) is read from DRAM about once and then from L2.
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_n_tiles
    pid_n = tl.program_id(0) % num_n_tiles
    # Row tile -> (expert, rows) from the device offsets, no host sync: expert e owns
    # ceil(n_e / BLOCK_M) consecutive tiles; tiles past the last expert's are idle (expert >= E).
    e = tl.arange(0, BLOCK_E)
    in_range = e < E
    ends = tl.load(offsets_ptr + e, mask=in_range, other=0)
    starts = tl.load(offsets_ptr + e - 1, mask=in_range & (e > 0), other=0)
    n_tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(n_tiles, axis=0)
    expert = tl.sum((tiles_end <= pid_m).to(tl.int32), axis=0)
    is_expert = e == expert
    first_tile = tl.sum(tl.where(is_expert, tiles_end - n_tiles, 0), axis=0)
    row_start = tl.sum(tl.where(is_expert, starts, 0), axis=0) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(is_expert, ends, 0), axis=0)
    active = expert < E
    expert = tl.minimum(expert, E - 1).to(tl.int64)

    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    src_rows = _row_index(src_idx_ptr, rows, row_mask, GATHER)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_C)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_w_e
    ws_base = w_scales_ptr + expert * stride_ws_e
    num_k_tiles = tl.where(active, tl.cdiv(C, BLOCK_C), 0)
    for k_tile in range(0, num_k_tiles):
        k = k_tile * BLOCK_C + ks
        k_mask = k < C
        a = _load_tile(src_ptr, src_rows, k, stride_src_m, stride_src_c, row_mask, k_mask)
        if STORE_GATHERED:
            if pid_n == 0:
                tl.store(
                    gathered_ptr + rows.to(tl.int64)[:, None] * stride_g_m + k[None, :] * stride_g_c,
                    a,
                    mask=row_mask[:, None] & k_mask[None, :],
                )
        b = _load_tile(w_base, k, cols, stride_w_c, stride_w_n, k_mask, col_mask)
        if FP8_SRC:  # e4m3 x e4m3 over one K tile, added to the fp32 accumulator (the interpreter multiplies exactly)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_C)
        else:
            if FP8:
                b = b.to(src_ptr.dtype.element_ty)  # e4m3 widened: exact in bf16, fp16 and fp32
            a, b = _dot_operands(a, b, DOT_UPCAST)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    if FP8_SRC:
        src_scale = tl.load(src_scale_ptr + src_rows, mask=row_mask, other=0.0)
        acc = acc * (src_scale * tl.load(ws_base))[:, None]
    elif FP8:
        acc = acc * tl.load(ws_base)

    if HAS_LORA:
        r = tl.arange(0, BLOCK_R)
        r_mask = r < R
        mid = _load_tile(mid_ptr, rows.to(tl.int64), r, stride_mid_m, stride_mid_r, row_mask, r_mask)
        lora_b = _load_tile(lora_b_ptr + expert * stride_lb_e, r, cols, stride_lb_r, stride_lb_n, r_mask, col_mask)
        mid, lora_b = _dot_operands(mid, lora_b, DOT_UPCAST)
        acc += scaling * tl.dot(mid, lora_b, input_precision=INPUT_PRECISION)

    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias_e + cols * stride_bias_n, mask=col_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]

    if ROW_SCALE:
        scale = tl.load(row_scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    acc = acc * alpha
    out_rows = _row_index(out_idx_ptr, rows, row_mask, SCATTER)
    out_ptrs = out_ptr + out_rows[:, None] * stride_out_m + cols[None, :] * stride_out_n
    out_mask = row_mask[:, None] & col_mask[None, :]
    if ACCUMULATE:
        acc_ptrs = acc_ptr + out_rows[:, None] * stride_acc_m + cols[None, :] * stride_acc_n
        acc += tl.load(acc_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


_GEMM_AUTOTUNE = dict(
    configs=_configs(
        ("BLOCK_M", "BLOCK_N", "BLOCK_C"),
        gpu=[(64, 128, 64, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4), (128, 256, 64, 8, 3),
             (128, 128, 128, 8, 3), (64, 128, 128, 4, 3), (128, 256, 128, 8, 3)],  # BLOCK_C = 128: fp8 only
        interpret=(16, 64, 64),
    ),
    key=["N", "C", "GATHER", "SCATTER", "ROW_SCALE", "HAS_LORA", "HAS_BIAS", "ACCUMULATE", "STORE_GATHERED", "FP8",
         "FP8_SRC"],
    prune_configs_by={"early_config_prune": _prune_gemm_configs},
    **_AUTOTUNE_KW,
)


_grouped_gemm_kernel = triton.autotune(**_GEMM_AUTOTUNE)(_grouped_gemm_body)


# Tuning runs every config on the real arguments: an accumulating call must find its output as it
# was before each run (restore_value clones it around each timing, so only these calls pay for it).
_grouped_gemm_accumulate_kernel = triton.autotune(**_GEMM_AUTOTUNE, restore_value=["out_ptr"])(_grouped_gemm_body)


@triton.autotune(
    configs=_configs(
        ("BLOCK_M", "BLOCK_N", "BLOCK_S"),
        gpu=[(64, 64, 64, 4, 3), (128, 64, 32, 4, 3), (64, 128, 32, 4, 3)],
        interpret=(16, 64, 64),
    ),
    key=["M", "N", "L_GATHER", "R_GATHER", "ROW_SCALE"],
    prune_configs_by={"early_config_prune": _prune_wgrad_configs},
    **_AUTOTUNE_KW,
)
@triton.jit
def _grouped_wgrad_kernel(
    l_ptr, l_idx_ptr, r_ptr, r_idx_ptr, row_scale_ptr, out_ptr, offsets_ptr,
    M, N, scaling,
    stride_l_s, stride_l_m,
    stride_r_s, stride_r_n,
    stride_out_e, stride_out_m, stride_out_n,
    L_GATHER: tl.constexpr, R_GATHER: tl.constexpr, ROW_SCALE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """out[e] = scaling * sum over expert e's rows p of scale[p] * l[lrow(p)]^T r[rrow(p)].

    One program per (expert, output tile); the loop runs over the expert's ragged row range read
    from the device offsets, so an expert with no rows stores zeros. fp32 accumulation.
    """
    expert = tl.program_id(0)
    pid = tl.program_id(1)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    end = tl.load(offsets_ptr + expert)
    start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)

    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = ms < M
    n_mask = ns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < end
        l_rows = _row_index(l_idx_ptr, s, s_mask, L_GATHER)
        r_rows = _row_index(r_idx_ptr, s, s_mask, R_GATHER)
        lhs = _load_tile(l_ptr, l_rows, ms, stride_l_s, stride_l_m, s_mask, m_mask)
        if ROW_SCALE:
            scale = tl.load(row_scale_ptr + s, mask=s_mask, other=0.0).to(tl.float32)
            lhs = (lhs.to(tl.float32) * scale[:, None]).to(l_ptr.dtype.element_ty)
        rhs = _load_tile(r_ptr, r_rows, ns, stride_r_s, stride_r_n, s_mask, n_mask)
        lhs, rhs = _dot_operands(lhs, rhs, DOT_UPCAST)
        acc = tl.dot(tl.trans(lhs), rhs, acc, input_precision=INPUT_PRECISION)
    tl.store(
        out_ptr + expert * stride_out_e + ms[:, None] * stride_out_m + ns[None, :] * stride_out_n,
        (acc * scaling).to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def _dot_options(dtype: torch.dtype) -> dict:
    """``INPUT_PRECISION`` and ``DOT_UPCAST`` for the kernels' ``tl.dot`` at ``dtype``.

    fp32 stays fp32 ("ieee"): tf32 would break the fp32 equality with the eager reference. Note: the
    Triton CPU interpreter multiplies bf16/fp16 ``tl.dot`` operands as raw integers (garbage, seen
    with triton 3.9), so under ``TRITON_INTERPRET=1`` half operands are upcast to fp32 first; the
    products of two half values are exact in fp32, so this is the GPU's half MMA with fp32
    accumulation.
    """
    upcast = _INTERPRET and dtype != torch.float32
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return {"INPUT_PRECISION": precision, "DOT_UPCAST": upcast}


def grouped_gemm(
    src: torch.Tensor,
    w_ECN: torch.Tensor | Mxfp4Weight | Nf4ExpertWeight | Fp8ExpertWeight,
    offsets_E: torch.Tensor,
    num_rows: int,
    *,
    src_idx_S: torch.Tensor | None = None,
    out_idx_S: torch.Tensor | None = None,
    row_scale_S: torch.Tensor | None = None,
    lora_mid_SR: torch.Tensor | None = None,
    lora_b_ERN: torch.Tensor | None = None,
    scaling: float = 1.0,
    accumulate_into: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    gathered_out: torch.Tensor | None = None,
    alpha: float = 1.0,
    bias_EN: torch.Tensor | None = None,
    src_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton grouped GEMM over expert-sorted rows, with optional fused gather, LoRA, bias, scale, scatter.

    ``out[orow(p)] = alpha * row_scale[p] * (src[irow(p)] @ w_ECN[e] + scaling * lora_mid[p] @ lora_b_ERN[e] + bias_EN[e])``
    (with an `Fp8ExpertWeight`, ``src[irow(p)] @ w_ECN[e]`` is ``(srcq[irow(p)] @ Wq[e]) * src_scale[irow(p)] * sw[e]``
    for an e4m3 src, ``(src[irow(p)] @ Wq[e]) * sw[e]`` for one in the weight's dtype)
    for the S = ``num_rows`` sorted rows p, e the expert owning row p (from ``offsets_E``),
    ``irow(p) = src_idx_S[p]`` (else p) and ``orow(p) = out_idx_S[p]`` (else p). With
    ``accumulate_into`` the result is added into that tensor in place (``out += ...``, one read and
    one write of it: how a thin LoRA GEMM joins a base output without an [S, N] temporary); with
    ``out`` as well, ``out = accumulate_into + ...`` (the same traffic, into another tensor).

    Args:
        src: [rows, C] input, any strides; read at rows ``src_idx_S`` when given. In the weight's dtype; with an
            `Fp8ExpertWeight` also e4m3 (`lightning_ft.kernels.fp8.quantize_rows` of the input, its scales in
            ``src_scale``).
        w_ECN: [E, C, N] weights, any strides (pass ``w_ENC.transpose(1, 2)``: no copy); or an
            `lightning_ft.kernels.mxfp4.Mxfp4Weight` or `lightning_ft.kernels.nf4.Nf4ExpertWeight` of that logical
            shape (either orientation; its ``dtype`` is the compute dtype), dequantised whole into the reused buffer
            first (``dense_in_buffer``: a transposed one as a transposed view) and then read as the dense weight, so
            bitwise the call with its ``dequantize()``; or an
            `lightning_ft.kernels.fp8.Fp8ExpertWeight` of that logical shape (either orientation): the fp8 path
            below.
        offsets_E: [E] int32 cumulative row ends; ``offsets_E[-1] == num_rows``.
        num_rows: S, the number of sorted rows (a host int from the tensors' shapes).
        src_idx_S: [S] int64 source row of each sorted row (the fused gather).
        out_idx_S: [S] int64 output row of each sorted row (the fused scatter, a permutation).
        row_scale_S: [S] per-row factor applied in the epilogue (routing weights).
        lora_mid_SR / lora_b_ERN: [S, R] and [E, R, N] LoRA terms added in the epilogue.
        scaling: LoRA scaling.
        accumulate_into: [S, N] tensor in ``src``'s dtype to add the result into (returned).
        out: [S, N] tensor in ``src``'s dtype to store into, with ``accumulate_into`` only.
        gathered_out: [S, C] tensor in ``src``'s dtype (any strides) that also receives the rows
            as loaded, ``gathered_out[p] = src[irow(p)]``: a thin GEMM that gathers its input
            writes the gathered copy a wide GEMM needs in the same pass (one read of the rows
            instead of the copy's write and re-read).
        alpha: factor on the whole product (in fp32, before the store).
        bias_EN: [E, N] per-expert bias (any strides and float dtype, read in fp32), added before
            ``row_scale`` and ``alpha``.
        src_scale: [rows] fp32, the row scales of an e4m3 ``src`` (read at ``irow(p)``, as src's rows); with an
            e4m3 src only, and then required.

    fp8 path (an `Fp8ExpertWeight`: e4m3 values, one fp32 scale per expert). With a src in the weight's dtype each
    B tile is widened to it in registers (exact) and the dot runs in that dtype, the expert's scale applied in the
    epilogue: fp8 storage, 16-bit compute. That is the input gradient's path: its contraction runs along the
    weight's contiguous dim, so the B tiles are not K-major, which Hopper's fp8 MMA needs; at the Qwen3-30B-A3B
    expert shape on an H100 that e4m3 x e4m3 product ran at 251 TFLOP/s against 532 for bf16. With an e4m3 src it
    arrives quantised per row
    (`lightning_ft.kernels.fp8.quantize_rows`, once per GEMM, by the caller: re-quantising each A tile in registers
    costs a pass per N tile and about twice the fp8 MMA's time per element on Hopper), and the main loop is a plain
    e4m3 dot chain into the fp32 accumulator; the epilogue multiplies each row by ``src_scale[irow(p)] * sw[e]``
    before LoRA, bias and routing weights, which stay in the weight's ``dtype`` (the output's too). The
    contraction may run along the weight's N or C (forward or input gradient alike: the weight's scale is a
    scalar per expert). Hopper's fp8 MMA accumulates in reduced precision, and Triton's default on sm90 keeps it
    along the whole K chain: on an H100 a Qwen3-MoE training step's LoRA gradients then moved up to 22% from the
    bf16 experts' (9% with fp32 sums per K tile). So each K tile (BLOCK_C, 64 or 128) is summed into the fp32
    accumulator (``max_num_imprecise_acc=BLOCK_C``), as DeepSeek-V3 promotes every 128.
    Errors: see `lightning_ft.kernels.fp8.Fp8ExpertWeight` and the tests
    (tests/kernels/moe/test_grouped_gemm_fp8.py). BLOCK_C >= 32 (fp8 ``tl.dot``).

    Returns:
        [S, N] tensor in the weight's dtype (``w_ECN.dtype``; fp32 accumulation): ``out``, else
        ``accumulate_into`` when given.

    Raises:
        ValueError: on mismatched sizes or dtypes; an `Fp8ExpertWeight` with an e4m3 ``src`` without its [rows] fp32
            ``src_scale``, a ``src_scale`` without one, or ``gathered_out`` with it (the gathered copy is for the
            thin LoRA GEMMs, in the weight's dtype).
    """
    num_experts, c_dim, n_dim = w_ECN.shape
    dtype, fp8 = w_ECN.dtype, isinstance(w_ECN, Fp8ExpertWeight)
    fp8_src = fp8 and src.dtype == E4M3
    if src.shape[-1] != c_dim or src.dtype not in ((E4M3, dtype) if fp8 else (dtype,)):
        raise ValueError(
            f"src {tuple(src.shape)} {src.dtype} does not match w_ECN {tuple(w_ECN.shape)} {dtype}"
            + (f" (an Fp8ExpertWeight takes e4m3 rows, quantize_rows, or {dtype} rows)" if fp8 else "")
        )
    if fp8_src and (src_scale is None or src_scale.shape != src.shape[:1] or src_scale.dtype != torch.float32):
        got = "none" if src_scale is None else f"{tuple(src_scale.shape)} {src_scale.dtype}"
        raise ValueError(
            f"grouped_gemm: an Fp8ExpertWeight needs src_scale [{src.shape[0]}] fp32 (quantize_rows), got {got}"
        )
    if src_scale is not None and not fp8_src:
        raise ValueError("grouped_gemm: src_scale is for an e4m3 src with an Fp8ExpertWeight only")
    if fp8_src and gathered_out is not None:
        raise ValueError("grouped_gemm: gathered_out copies the rows for the LoRA GEMMs; it takes no e4m3 src")
    has_lora = lora_mid_SR is not None
    if has_lora and (lora_b_ERN is None or lora_mid_SR.shape[1] != lora_b_ERN.shape[1]):
        raise ValueError("lora_mid_SR [S, R] and lora_b_ERN [E, R, N] must be given together with equal R")
    for name, given, cols in (("accumulate_into", accumulate_into, n_dim), ("out", out, n_dim), ("gathered_out", gathered_out, c_dim)):
        if given is not None and (given.shape != (num_rows, cols) or given.dtype != dtype):
            raise ValueError(f"{name} {tuple(given.shape)} {given.dtype} is not [{num_rows}, {cols}] {dtype}")
    if out is not None and accumulate_into is None:
        raise ValueError("grouped_gemm: out= is for accumulate_into's sum only")
    if out is None and accumulate_into is None:
        out = torch.empty(num_rows, n_dim, device=src.device, dtype=dtype)
    elif out is None:
        out = accumulate_into  # in place
    acc = accumulate_into if accumulate_into is not None else out
    rank = lora_mid_SR.shape[1] if has_lora else 0
    mid = lora_mid_SR if has_lora else src
    if isinstance(w_ECN, _FOUR_BIT_WEIGHTS):
        # dequantised whole into the reused buffer, then the dense GEMM: on an H100 (Qwen3-30B-A3B × 12 layers, 8K
        # tokens) an NF4 step took 238 ms this way against 3,215 ms with a per-element decode in the B-tile loads; an
        # MXFP4 decode in the tile loads ran at about 100 TFLOP/s, a fifth of this kernel on dense bf16
        w_ECN = w_ECN.dense_in_buffer()
    w, w_scales = w_ECN, w_ECN  # a dense weight's scale pointer is not read: any tensor
    if fp8:
        w, w_scales = w_ECN.logical_values(), w_ECN.scales
    w_strides = (w.stride(0), w.stride(1), w.stride(2))
    lora_b = lora_b_ERN if has_lora else src[None]
    gathered = gathered_out if gathered_out is not None else src
    bias = bias_EN if bias_EN is not None else src
    if bias_EN is not None and bias_EN.shape != (num_experts, n_dim):
        raise ValueError(f"bias_EN {tuple(bias_EN.shape)} is not [{num_experts}, {n_dim}]")

    def grid(meta):
        # Σ_e ceil(n_e / BLOCK_M) <= ceil(S / BLOCK_M) + min(E, S) - 1: a host-side bound, no sync.
        max_tiles = triton.cdiv(num_rows, meta["BLOCK_M"]) + min(num_experts, num_rows) - 1
        return (triton.cdiv(n_dim, meta["BLOCK_N"]) * max(1, max_tiles),)

    kernel = _grouped_gemm_kernel if accumulate_into is None else _grouped_gemm_accumulate_kernel
    kernel[grid](
        src, src_idx_S if src_idx_S is not None else offsets_E, w, out,
        out_idx_S if out_idx_S is not None else offsets_E,
        row_scale_S if row_scale_S is not None else src, mid, lora_b, offsets_E, acc, gathered, bias, w_scales,
        src_scale if src_scale is not None else src,
        n_dim, c_dim, rank, num_experts, float(scaling), float(alpha),
        src.stride(0), src.stride(1),
        gathered.stride(0), gathered.stride(1),
        *w_strides,
        out.stride(0), out.stride(1),
        acc.stride(0), acc.stride(1),
        mid.stride(0), mid.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        bias.stride(0), bias.stride(-1),
        w_scales.stride(0),
        GATHER=src_idx_S is not None, SCATTER=out_idx_S is not None, ROW_SCALE=row_scale_S is not None,
        HAS_LORA=has_lora, HAS_BIAS=bias_EN is not None, ACCUMULATE=accumulate_into is not None, STORE_GATHERED=gathered_out is not None,
        **_dot_options(dtype), FP8=fp8, FP8_SRC=fp8_src,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_R=max(16, triton.next_power_of_2(rank)),
    )
    return out


def grouped_wgrad(
    lhs_SM: torch.Tensor,
    rhs_SN: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    lhs_idx_S: torch.Tensor | None = None,
    rhs_idx_S: torch.Tensor | None = None,
    row_scale_S: torch.Tensor | None = None,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Per-expert ragged sum ``out[e] = scaling * Σ_{p in e} scale[p] lhs[lrow(p)]^T rhs[rrow(p)]``.

    Args:
        lhs_SM: [rows, M], read at rows ``lhs_idx_S[p]`` (else p).
        rhs_SN: [rows, N], read at rows ``rhs_idx_S[p]`` (else p).
        offsets_E: [E] int32 cumulative row ends of the sorted rows p.
        row_scale_S: [S] factor applied to lhs rows (routing weights).
        scaling: overall factor (LoRA scaling).

    Returns:
        [E, M, N] in ``lhs_SM``'s dtype (fp32 accumulation); zeros for experts with no rows.

    Raises:
        ValueError: if the dtypes differ.
    """
    if lhs_SM.dtype != rhs_SN.dtype:
        raise ValueError(f"lhs {lhs_SM.dtype} and rhs {rhs_SN.dtype} must share a dtype")
    num_experts = offsets_E.numel()
    m_dim, n_dim = lhs_SM.shape[1], rhs_SN.shape[1]
    out = torch.empty(num_experts, m_dim, n_dim, device=lhs_SM.device, dtype=lhs_SM.dtype)

    def grid(meta):
        return num_experts, triton.cdiv(m_dim, meta["BLOCK_M"]) * triton.cdiv(n_dim, meta["BLOCK_N"])

    _grouped_wgrad_kernel[grid](
        lhs_SM, lhs_idx_S if lhs_idx_S is not None else offsets_E,
        rhs_SN, rhs_idx_S if rhs_idx_S is not None else offsets_E,
        row_scale_S if row_scale_S is not None else lhs_SM, out, offsets_E,
        m_dim, n_dim, float(scaling),
        lhs_SM.stride(0), lhs_SM.stride(1),
        rhs_SN.stride(0), rhs_SN.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        L_GATHER=lhs_idx_S is not None, R_GATHER=rhs_idx_S is not None, ROW_SCALE=row_scale_S is not None,
        **_dot_options(lhs_SM.dtype),
    )
    return out


def grouped_gemm_reference(
    src: torch.Tensor, w_ECN: torch.Tensor, offsets_E: torch.Tensor, num_rows: int, *,
    src_idx_S: torch.Tensor | None = None, out_idx_S: torch.Tensor | None = None,
    row_scale_S: torch.Tensor | None = None, lora_mid_SR: torch.Tensor | None = None,
    lora_b_ERN: torch.Tensor | None = None, scaling: float = 1.0,
    accumulate_into: torch.Tensor | None = None, alpha: float = 1.0, bias_EN: torch.Tensor | None = None,
    src_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch reference of `grouped_gemm` (same arguments but ``out`` and ``gathered_out``):
    each sorted row p times its expert's weight, in fp32, returned in the weight's dtype (an `Mxfp4Weight` or
    `Nf4ExpertWeight` dequantised first; an `Fp8ExpertWeight` with its e4m3 ``src`` and ``src_scale`` as the
    kernel computes it: `_fp8_rows_product`)."""
    ends = offsets_E.long().cpu()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    expert_S = torch.repeat_interleave(torch.arange(counts.numel()), counts).to(src.device)
    src_rows_S = src_idx_S if src_idx_S is not None else torch.arange(num_rows, device=src.device)
    rows_SC = src.float()[src_rows_S]  # (e4m3 rows widened first: exact)
    if isinstance(w_ECN, Fp8ExpertWeight):
        per_row = _fp8_rows_product(rows_SC, None if src_scale is None else src_scale[src_rows_S], w_ECN, expert_S)
    else:
        dense = w_ECN.dequantize() if isinstance(w_ECN, _QUANTISED_WEIGHTS) else w_ECN
        per_row = torch.einsum("sc,scn->sn", rows_SC, dense.float()[expert_S])
    if lora_mid_SR is not None:
        per_row = per_row + scaling * torch.einsum("sr,srn->sn", lora_mid_SR.float(), lora_b_ERN.float()[expert_S])
    if bias_EN is not None:
        per_row = per_row + bias_EN.float()[expert_S]
    if row_scale_S is not None:
        per_row = per_row * row_scale_S.float()[:, None]
    out = torch.empty_like(per_row)
    out[out_idx_S if out_idx_S is not None else slice(None)] = per_row * alpha
    if accumulate_into is not None:
        out = out + accumulate_into.float()
    return out.to(w_ECN.dtype)


def _fp8_rows_product(rows_SC, row_scale_S, w_ECN: Fp8ExpertWeight, expert_S) -> torch.Tensor:
    """fp32 [S, N]: the fp8 path of `grouped_gemm` in torch ops: the rows (fp32: e4m3 or bf16 ones widened) times
    the expert's e4m3 values (as fp32), summed in fp32, times the row's scale (None: an unquantised src, no row
    scale) and the expert's scale."""
    product = torch.einsum("sc,scn->sn", rows_SC, w_ECN.logical_values().float()[expert_S])
    scale = w_ECN.scales[expert_S] if row_scale_S is None else row_scale_S * w_ECN.scales[expert_S]
    return product * scale[:, None]


def grouped_wgrad_reference(
    lhs_SM: torch.Tensor, rhs_SN: torch.Tensor, offsets_E: torch.Tensor, *,
    lhs_idx_S: torch.Tensor | None = None, rhs_idx_S: torch.Tensor | None = None,
    row_scale_S: torch.Tensor | None = None, scaling: float = 1.0,
) -> torch.Tensor:
    """Plain-torch reference of `grouped_wgrad`: per expert, ``scaling * Σ scale[p] lhs[lrow(p)]^T
    rhs[rrow(p)]`` over its rows, in fp32, returned in ``lhs_SM``'s dtype ([E, M, N]; zeros for an
    expert with no rows)."""
    ends = offsets_E.long().cpu().tolist()
    out = []
    for start, end in zip([0, *ends[:-1]], ends):
        rows = torch.arange(start, end, device=lhs_SM.device)
        lhs = lhs_SM[lhs_idx_S[rows] if lhs_idx_S is not None else rows].float()
        if row_scale_S is not None:
            lhs = lhs * row_scale_S[rows].float()[:, None]
        out.append(scaling * lhs.T @ rhs_SN[rhs_idx_S[rows] if rhs_idx_S is not None else rows].float())
    return torch.stack(out).to(lhs_SM.dtype)


def _bias_grad(dy, offsets_E, num_rows, src_idx_S=None, row_scale_S=None):
    """[E, N]: Σ over expert e's sorted rows p of scale[p] dy[irow(p)] (a per-expert bias's gradient),
    as the weight-gradient kernel with a column of ones: fp32 accumulation, deterministic."""
    ones_S1 = dy.new_ones(num_rows, 1)
    return grouped_wgrad(ones_S1, dy, offsets_E, rhs_idx_S=src_idx_S, row_scale_S=row_scale_S)[:, 0]


def _saved_weight(ctx, w_ENC) -> tuple:
    """What to put in ``save_for_backward`` for the weight: itself, or None for a quantised expert weight
    (`_QUANTISED_WEIGHTS`: frozen tensors, kept on ``ctx``; ``save_for_backward`` takes tensors only)."""
    ctx.quantised_weight = w_ENC if isinstance(w_ENC, _QUANTISED_WEIGHTS) else None
    return (None,) if ctx.quantised_weight is not None else (w_ENC,)


def _weight_of(ctx, saved):
    """The weight `_saved_weight` kept."""
    return ctx.quantised_weight if ctx.quantised_weight is not None else saved


def _base_rows(src: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(src, src_scale) for the forward base product's `grouped_gemm` with weight ``w``: for an `Fp8ExpertWeight`,
    src's rows in e4m3 and their fp32 scales (`lightning_ft.kernels.fp8.quantize_rows`: one pass over src per GEMM,
    a transient copy; the LoRA products and weight gradients keep reading src), else (src, None). The input
    gradients pass their bf16 rows as they are: the kernel widens the e4m3 weight (its B tiles are not K-major
    there, which the e4m3 x e4m3 MMA needs to run fast; see `grouped_gemm`)."""
    return quantize_rows(src) if isinstance(w, Fp8ExpertWeight) else (src, None)


class _GatherGroupedLinear(torch.autograd.Function):
    """h_SN = x[token_idx_S] W_e^T + s (x[token_idx_S] A_e^T) B_e^T (+ b_e), the gather fused into the loads.

    Saves x_TC (not the gathered [S, C] copy) and the thin xa_SR = x A_e^T for the LoRA B gradient.
    """

    @staticmethod
    def forward(ctx, x_TC, w_ENC, lora_a_ERC, lora_b_ENR, scaling, token_idx_S, pair_idx_S, offsets_E, top_k, bias_EN):
        num_rows = token_idx_S.numel()
        xa_SR = None
        lora_b_ERN = None
        if lora_a_ERC is not None:
            xa_SR = grouped_gemm(
                x_TC, lora_a_ERC.transpose(1, 2), offsets_E, num_rows, src_idx_S=token_idx_S
            )
            lora_b_ERN = lora_b_ENR.transpose(1, 2)
        x_base, x_scale = _base_rows(x_TC, w_ENC)
        h_SN = grouped_gemm(
            x_base, w_ENC.transpose(1, 2), offsets_E, num_rows, src_idx_S=token_idx_S,
            lora_mid_SR=xa_SR, lora_b_ERN=lora_b_ERN, scaling=scaling, bias_EN=bias_EN, src_scale=x_scale,
        )
        ctx.save_for_backward(x_TC, *_saved_weight(ctx, w_ENC), lora_a_ERC, lora_b_ENR, xa_SR, token_idx_S, pair_idx_S, offsets_E)
        ctx.scaling = scaling
        ctx.top_k = top_k
        return h_SN

    @staticmethod
    def backward(ctx, dh_SN):
        x_TC, w_ENC, lora_a_ERC, lora_b_ENR, xa_SR, token_idx_S, pair_idx_S, offsets_E = ctx.saved_tensors
        w_ENC = _weight_of(ctx, w_ENC)
        needs_x, needs_w, needs_a, needs_b = ctx.needs_input_grad[:4]
        num_rows = token_idx_S.numel()
        mid_SR = None
        if lora_a_ERC is not None and (needs_x or needs_a):
            mid_SR = grouped_gemm(dh_SN, lora_b_ENR, offsets_E, num_rows)  # dH B_e: [S, R]
        dx_TC = dw_ENC = da_ERC = db_ENR = None
        if needs_w:  # full fine-tuning of the experts
            dw_ENC = grouped_wgrad(dh_SN, x_TC, offsets_E, rhs_idx_S=token_idx_S)
        if needs_x:
            dx_pairs = grouped_gemm(  # an fp8 weight widened in the kernel: see `_base_rows`
                dh_SN, w_ENC, offsets_E, num_rows, out_idx_S=pair_idx_S,
                lora_mid_SR=mid_SR, lora_b_ERN=lora_a_ERC if mid_SR is not None else None, scaling=ctx.scaling,
            )
            dx_TC = dx_pairs.view(-1, ctx.top_k, dx_pairs.shape[-1]).sum(dim=1)
        if needs_a:
            da_ERC = grouped_wgrad(mid_SR, x_TC, offsets_E, rhs_idx_S=token_idx_S, scaling=ctx.scaling)
        if needs_b:
            db_ENR = grouped_wgrad(dh_SN, xa_SR, offsets_E, scaling=ctx.scaling)
        d_bias = _bias_grad(dh_SN, offsets_E, num_rows) if ctx.needs_input_grad[9] else None
        return dx_TC, dw_ENC, da_ERC, db_ENR, None, None, None, None, None, d_bias


class _ScatterGroupedLinear(torch.autograd.Function):
    """out_TN = Σ_k w_(t,k) (a W_e^T + s (a A_e^T) B_e^T (+ b_e))[(t, k)]; weight and un-permute in the epilogue.

    The epilogue stores each weighted row at its (t, k) position; the sum over K is a plain
    deterministic reduction. Backward: u = dOut[token] W2eff_e gives both d a = w u and
    d w = <u, a> (+ <dOut[token], b_e>: the router-input gradient) without keeping the [S, N]
    expert outputs.
    """

    @staticmethod
    def forward(
        ctx, a_SC, weight_S, w_ENC, lora_a_ERC, lora_b_ENR, scaling, token_idx_S, pair_idx_S, offsets_E, top_k,
        output_needed, bias_EN,
    ):
        num_rows = a_SC.shape[0]
        aa_SR = None
        lora_b_ERN = None
        if lora_a_ERC is not None:
            aa_SR = grouped_gemm(a_SC, lora_a_ERC.transpose(1, 2), offsets_E, num_rows)
            lora_b_ERN = lora_b_ENR.transpose(1, 2)
        ctx.save_for_backward(a_SC, weight_S, *_saved_weight(ctx, w_ENC), lora_a_ERC, lora_b_ENR, aa_SR, token_idx_S, offsets_E, bias_EN)
        ctx.scaling = scaling
        if not output_needed:  # a recompute whose output value is discarded: the backward never reads it
            return unread_output(a_SC, num_rows // top_k, w_ENC.shape[1])
        a_base, a_scale = _base_rows(a_SC, w_ENC)
        y_pairs = grouped_gemm(
            a_base, w_ENC.transpose(1, 2), offsets_E, num_rows, out_idx_S=pair_idx_S, row_scale_S=weight_S,
            lora_mid_SR=aa_SR, lora_b_ERN=lora_b_ERN, scaling=scaling, bias_EN=bias_EN, src_scale=a_scale,
        )
        return y_pairs.view(-1, top_k, y_pairs.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx, dout_TN):
        a_SC, weight_S, w_ENC, lora_a_ERC, lora_b_ENR, aa_SR, token_idx_S, offsets_E, bias_EN = ctx.saved_tensors
        w_ENC = _weight_of(ctx, w_ENC)
        needs_a, needs_weight, needs_w, needs_la, needs_lb = ctx.needs_input_grad[:5]
        num_rows = a_SC.shape[0]
        gb_SR = None
        if lora_a_ERC is not None and (needs_a or needs_weight or needs_la):
            # dOut[token] B_e: [S, R]
            gb_SR = grouped_gemm(dout_TN, lora_b_ENR, offsets_E, num_rows, src_idx_S=token_idx_S)
        d_a = d_weight = dw_ENC = da_ERC = db_ENR = None
        if needs_w:  # full fine-tuning of the experts
            dw_ENC = grouped_wgrad(dout_TN, a_SC, offsets_E, lhs_idx_S=token_idx_S, row_scale_S=weight_S)
        if needs_a or needs_weight:
            u_SC = grouped_gemm(  # an fp8 weight widened in the kernel: see `_base_rows`
                dout_TN, w_ENC, offsets_E, num_rows, src_idx_S=token_idx_S,
                lora_mid_SR=gb_SR, lora_b_ERN=lora_a_ERC if gb_SR is not None else None, scaling=ctx.scaling,
            )
            if needs_weight:
                d_weight = (u_SC.float() * a_SC.float()).sum(dim=-1)
                if bias_EN is not None:  # <dOut[token], b_e> per row: a GEMM against b as [E, N, 1]
                    d_weight += grouped_gemm(
                        dout_TN, bias_EN.to(dout_TN.dtype)[:, :, None], offsets_E, num_rows, src_idx_S=token_idx_S
                    )[:, 0].float()
                d_weight = d_weight.to(weight_S.dtype)
            if needs_a:
                d_a = u_SC * weight_S[:, None]
        if needs_la:
            da_ERC = grouped_wgrad(gb_SR, a_SC, offsets_E, row_scale_S=weight_S, scaling=ctx.scaling)
        if needs_lb:
            db_ENR = grouped_wgrad(
                dout_TN, aa_SR, offsets_E, lhs_idx_S=token_idx_S, row_scale_S=weight_S, scaling=ctx.scaling
            )
        d_bias = None
        if ctx.needs_input_grad[11]:
            d_bias = _bias_grad(dout_TN, offsets_E, num_rows, src_idx_S=token_idx_S, row_scale_S=weight_S)
        return d_a, d_weight, dw_ENC, da_ERC, db_ENR, None, None, None, None, None, None, d_bias


def experts_triton(
    x_TD, weight_S, routing, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down, output_needed,
    biases=ExpertBiases(),
):  # fmt: skip
    """out_TD of the triton backend: the token rows x_TD [T, D] gathered by ``routing`` into the gate/up
    grouped GEMM, SwiGLU, then the down grouped GEMM scaled by weight_S [S] and summed back per token
    (split LoRA and ``biases`` in both GEMMs' epilogues); with ``output_needed=False`` the down GEMM and
    the un-permute are skipped."""
    h_SF = _GatherGroupedLinear.apply(
        x_TD, w_gate_up_EFD, *_lora_args(lora_gate_up),
        routing.token_idx_S, routing.pair_idx_S, routing.offsets_E, routing.top_k, biases.gate_up_EF,
    )
    return _ScatterGroupedLinear.apply(
        _swiglu(h_SF, act_fn), weight_S, w_down_EDI, *_lora_args(lora_down),
        routing.token_idx_S, routing.pair_idx_S, routing.offsets_E, routing.top_k, output_needed, biases.down_ED,
    )
