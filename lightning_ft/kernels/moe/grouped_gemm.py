"""Grouped expert GEMMs with split LoRA: three backends behind one function, `moe_experts`.

Shape suffixes: T tokens, K top_k, E experts, S = T*K routed (token, expert) pairs in expert-sorted
order (see `routing.py`), D hidden size, I expert intermediate size, F = 2*I (gate and up rows
stacked, transformers' ``is_concatenated`` layout), R LoRA rank; for a single projection C is the
contracted (input) size and N the output size. Weights follow transformers v5: ``gate_up_proj``
w_gate_up_EFD [E, F, D] and ``down_proj`` w_down_EDI [E, D, I], i.e. [E, N, C] (``nn.Linear``-like).

Math of one expert e on its rows x_e (all backends; act is the experts' ``act_fn``, SiLU here):

    h_e   = x_e W1_e^T + s1 (x_e A1_e^T) B1_e^T          [n_e, F]   (gate_up, + split LoRA)
    a_e   = act(h_e[:, :I]) * h_e[:, I:]                  [n_e, I]
    y_e   = a_e W2_e^T + s2 (a_e A2_e^T) B2_e^T           [n_e, D]   (down, + split LoRA)
    out_t = sum_k topk_weight[t, k] * y[(t, k)]           [T, D]

The down projection and its LoRA are linear, so ``native_torch`` and ``grouped_mm`` scale a_e by
the routing weight inside the SwiGLU kernel (one pass over [S, I]) instead of y by it (two passes
over the larger [S, D] forward, more backward); the ``triton`` backend scales in its epilogue.

Split LoRA never forms B·A: the two thin GEMMs per projection reuse the base GEMM's grouping
(offsets). A_e [R, C] and B_e [N, R] are read straight from PEFT's ``target_parameters`` tensors
(`ExpertLoRA`), so gradients land in PEFT's parameters and the adapter file stays PEFT's.

Gradients (every backend; the triton backend computes them in its own kernels), per projection
with input X and output gradient dH; the routing weights are folded into the down projection's dH
(``triton``) or, equivalently, into its input X (``native_torch``, ``grouped_mm``):

    dX_e = dH_e W_e + s (dH_e B_e) A_e          dW_e = dH_e^T X_e       (full fine-tuning only)
    dA_e = s (dH_e B_e)^T X_e                   dB_e = s dH_e^T (X_e A_e^T)
    d topk_weight[(t, k)] = <dOut_t, y_(t,k)> = <dOut_t (W2_e + s B2_e A2_e), a_(t,k)>   (router input)

Backends (what they do on each device):

* ``native_torch``: a Python loop over experts slicing the sorted rows by ``offsets_E``. It reads
  the offsets back to the host once per call (one device-to-host sync per MoE layer forward, none in
  backward); it is the plain-torch reference of this math and the fallback on any device.
* ``grouped_mm``: ``torch.nn.functional.grouped_mm`` (or ``torch._grouped_mm``) on the sorted rows,
  with the frozen expert weights passed as transposed views (no per-step copy); the thin
  ``(x A_e^T) B_e^T`` LoRA term (and its input-gradient twin) is added into the base GEMM's output
  in place by our Triton kernel (``grouped_gemm(accumulate_into=...)``), not written and added, or,
  where the frozen weights carry LoRA slots (`augment_expert_weight`, ``moe.lora_slots``), joins the
  base GEMM along K (forward and input gradient: one GEMM each, no [S, N] pass). Where Triton
  runs, gate/up's ``x A_e^T`` is computed by the pass that gathers x into expert order and down's
  ``dy B_e`` by the pass that gathers the output gradient (`_PermuteThin`, `_UnpermuteThin`: the
  [S, D] rows are read once, not written and read back). The other thin LoRA products (``x A_e^T``,
  ``dy B_e``, dA_e, dB_e) run on grouped_mm or our Triton
  kernels, whichever was faster for the shape when first timed on CUDA (`_thin_product`: neither
  wins everywhere on the H200, benchmarks/RESULTS.md "Thin expert-LoRA GEMMs"). A one-time probe
  per (device, dtype) checks that the view path is correct; if only the contiguous layout is, it
  copies and logs; if grouped_mm fails, or a size is not a multiple of 16 bytes, it runs
  ``native_torch`` and logs. Sync-free on CUDA only where torch has a native grouped kernel for the
  dtype (bf16 on sm90/sm100 in torch 2.10's sources); elsewhere torch itself loops over a host copy
  of ``offs``.
* ``triton``: our grouped GEMM kernels. The gather x[token_idx] is fused into the first GEMM's loads,
  the routing-weight multiply and un-permute store into the second GEMM's epilogue (the final sum
  over K is a deterministic reduction, no atomics), split LoRA is added in the epilogue of the base
  GEMM (its thin [S, R] middle comes from one more launch of the same kernel), and the backward runs
  on the same kernels plus a ragged per-expert weight-gradient kernel. Neither the gathered [S, D]
  input nor the [S, D] expert outputs are kept for backward. Each program maps its row tile to an
  expert from the device offsets (the grid is the host bound ceil(S / BLOCK_M) + min(E, S) - 1 row
  tiles; idle ones skip the loop), so it is sync-free. Autotuned once per (sizes, dtypes, flags) key
  and cached by Triton (on disk where supported). On the CPU only under ``TRITON_INTERPRET=1``
  (how the tests run it).

Every backend runs with autocast off, in the expert weights' dtype (inputs and LoRA factors are cast
to it): train with bf16 weights (``bf16-true``) to avoid casting the [E, ...] weights each step.

Sources: transformers ``integrations/moe.py`` (``grouped_mm_experts_forward``, the eager experts
loop) and ``models/qwen3_moe``; PEFT 0.21 ``tuners/lora/layer.py`` (``ParamWrapper`` layout);
``torch._grouped_mm`` stride rules (``GroupedMMUtils.h``); the Triton matmul tutorial for tiling.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

from lightning_ft.kernels._utils import row_padded, triton_can_run
from lightning_ft.kernels.moe.lora_layout import expert_major_lora_b
from lightning_ft.kernels.moe.routing import ExpertRouting, permute_tokens, sum_pairs, unpermute_tokens, unread_output
from lightning_ft.kernels.swiglu import swiglu_concat

__all__ = [
    "BACKENDS",
    "ExpertLoRA",
    "augment_expert_weight",
    "grouped_gemm",
    "grouped_mm_mode",
    "grouped_wgrad",
    "moe_experts",
    "padded_rank",
    "select_backend",
]

logger = logging.getLogger(__name__)

BACKENDS = ("native_torch", "grouped_mm", "triton")

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_GROUPED_MM_MODES: dict[tuple[str, int | None, torch.dtype], str] = {}
_AUGMENTED_VIEWS_OK: dict[tuple[str, int | None, torch.dtype], bool] = {}
# (product, C or N, E, R, dtype, device, power-of-two row bound) -> "grouped_mm" or "triton"
_THIN_CHOICES: dict[tuple, str] = {}
_LOGGED: set[str] = set()


def _log_once(key: str, level: int, message: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, message)


class ExpertLoRA(NamedTuple):
    """PEFT's LoRA on one 3-D expert weight [E, N, C] (``LoraConfig(target_parameters=...)``).

    PEFT 0.21's ``ParamWrapper`` keeps two ``nn.Linear`` layers for all experts at once; expert e's
    factors are A_e [R, C] and B_e [N, R], and its weight delta is ``scaling * B_e @ A_e``:

    Attributes:
        lora_A: [E*R, C] (``lora_A[adapter].weight``); row ``e*R + j`` is row j of A_e.
        lora_B: [N, R*E] (``lora_B[adapter].weight``); column ``j*E + e`` is column j of B_e.
        scaling: ``alpha / R`` (``alpha / sqrt(R)`` with rsLoRA), PEFT's ``scaling[adapter]``.
        num_experts: E.
    """

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float
    num_experts: int

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(a_ERC, b_ENR, scaling)`` in ``dtype``, both contiguous, differentiable w.r.t. PEFT's tensors.

        a_ERC is a view of ``lora_A`` (a cast copy when dtype differs). PEFT's B interleaves the
        experts (column ``j*E + e``), so b_ENR is always one copy that casts and lays each expert's
        [N, R] out contiguously (`expert_major_lora_b`, one Triton pass): the grouped GEMMs then
        read it, or its transposed view, coalesced, with no further copy.
        """
        num_experts = self.num_experts
        a_ERC = self.lora_A.view(num_experts, -1, self.lora_A.shape[-1])
        return a_ERC.to(dtype), expert_major_lora_b(self.lora_B, num_experts, dtype), self.scaling


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


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
    """Fit BLOCK_N / BLOCK_C to the problem; thin LoRA GEMMs (N = R) try only the first two configs."""
    n_cap = _cap(named_args["N"])
    return _clamped(configs[:2] if n_cap <= 32 else configs, {"BLOCK_N": n_cap, "BLOCK_C": _cap(named_args["C"])})


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
def _grouped_gemm_body(
    src_ptr, src_idx_ptr, w_ptr, out_ptr, out_idx_ptr, row_scale_ptr, mid_ptr, lora_b_ptr, offsets_ptr, acc_ptr,
    gathered_ptr,
    N, C, R, E, scaling, alpha,
    stride_src_m, stride_src_c,
    stride_g_m, stride_g_c,
    stride_w_e, stride_w_c, stride_w_n,
    stride_out_m, stride_out_n,
    stride_acc_m, stride_acc_n,
    stride_mid_m, stride_mid_r,
    stride_lb_e, stride_lb_r, stride_lb_n,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_LORA: tl.constexpr,
    ACCUMULATE: tl.constexpr, STORE_GATHERED: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out[orow(p)] (+)= alpha * scale[p] * (src[irow(p)] @ w[e(p)] + scaling * mid[p] @ lora_b[e(p)]).

    p runs over expert-sorted rows; irow(p) = src_idx[p] if GATHER else p; orow(p) = out_idx[p] if
    SCATTER else p; scale = row_scale if ROW_SCALE else 1; w is [E, C, N], lora_b [E, R, N], mid
    [S, R]; fp32 accumulation, stored in out's dtype; ACCUMULATE adds acc[orow(p)] first (in fp32;
    acc is out itself for an in-place sum). STORE_GATHERED also writes the src rows it loads to
    gathered[p] (the column tiles of pid_n == 0: each row once).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
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
    if GATHER:
        src_rows = tl.load(src_idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        src_rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_C)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * stride_w_e
    num_k_tiles = tl.where(active, tl.cdiv(C, BLOCK_C), 0)
    for k_tile in range(0, num_k_tiles):
        k = k_tile * BLOCK_C + ks
        k_mask = k < C
        a = tl.load(
            src_ptr + src_rows[:, None] * stride_src_m + k[None, :] * stride_src_c,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if STORE_GATHERED:
            if pid_n == 0:
                tl.store(
                    gathered_ptr + rows.to(tl.int64)[:, None] * stride_g_m + k[None, :] * stride_g_c,
                    a,
                    mask=row_mask[:, None] & k_mask[None, :],
                )
        b = tl.load(
            w_base + k[:, None] * stride_w_c + cols[None, :] * stride_w_n,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if DOT_UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    if HAS_LORA:
        r = tl.arange(0, BLOCK_R)
        r_mask = r < R
        mid = tl.load(
            mid_ptr + rows.to(tl.int64)[:, None] * stride_mid_m + r[None, :] * stride_mid_r,
            mask=row_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        lora_b = tl.load(
            lora_b_ptr + expert * stride_lb_e + r[:, None] * stride_lb_r + cols[None, :] * stride_lb_n,
            mask=r_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if DOT_UPCAST:
            mid = mid.to(tl.float32)
            lora_b = lora_b.to(tl.float32)
        acc += scaling * tl.dot(mid, lora_b, input_precision=INPUT_PRECISION)

    if ROW_SCALE:
        scale = tl.load(row_scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    acc = acc * alpha
    if SCATTER:
        out_rows = tl.load(out_idx_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        out_rows = rows.to(tl.int64)
    out_ptrs = out_ptr + out_rows[:, None] * stride_out_m + cols[None, :] * stride_out_n
    out_mask = row_mask[:, None] & col_mask[None, :]
    if ACCUMULATE:
        acc_ptrs = acc_ptr + out_rows[:, None] * stride_acc_m + cols[None, :] * stride_acc_n
        acc += tl.load(acc_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


_GEMM_AUTOTUNE = dict(
    configs=_configs(
        ("BLOCK_M", "BLOCK_N", "BLOCK_C"),
        gpu=[
            (64, 128, 64, 4, 3),
            (128, 64, 64, 4, 4),
            (128, 128, 64, 8, 3),
            (64, 64, 64, 4, 4),
        ],
        interpret=(16, 64, 64),
    ),
    key=["N", "C", "GATHER", "SCATTER", "ROW_SCALE", "HAS_LORA", "ACCUMULATE", "STORE_GATHERED"],
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
        gpu=[
            (64, 64, 64, 4, 3),
            (128, 64, 32, 4, 3),
            (64, 128, 32, 4, 3),
        ],
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
        if L_GATHER:
            l_rows = tl.load(l_idx_ptr + s, mask=s_mask, other=0).to(tl.int64)
        else:
            l_rows = s.to(tl.int64)
        if R_GATHER:
            r_rows = tl.load(r_idx_ptr + s, mask=s_mask, other=0).to(tl.int64)
        else:
            r_rows = s.to(tl.int64)
        lhs = tl.load(
            l_ptr + l_rows[:, None] * stride_l_s + ms[None, :] * stride_l_m,
            mask=s_mask[:, None] & m_mask[None, :],
            other=0.0,
        )
        if ROW_SCALE:
            scale = tl.load(row_scale_ptr + s, mask=s_mask, other=0.0).to(tl.float32)
            lhs = (lhs.to(tl.float32) * scale[:, None]).to(l_ptr.dtype.element_ty)
        rhs = tl.load(
            r_ptr + r_rows[:, None] * stride_r_s + ns[None, :] * stride_r_n,
            mask=s_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if DOT_UPCAST:
            lhs = lhs.to(tl.float32)
            rhs = rhs.to(tl.float32)
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
    w_ECN: torch.Tensor,
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
) -> torch.Tensor:
    """Triton grouped GEMM over expert-sorted rows, with optional fused gather, LoRA, scale, scatter.

    ``out[orow(p)] = alpha * row_scale[p] * (src[irow(p)] @ w_ECN[e] + scaling * lora_mid[p] @ lora_b_ERN[e])``
    for the S = ``num_rows`` sorted rows p, e the expert owning row p (from ``offsets_E``),
    ``irow(p) = src_idx_S[p]`` (else p) and ``orow(p) = out_idx_S[p]`` (else p). With
    ``accumulate_into`` the result is added into that tensor in place (``out += ...``, one read and
    one write of it: how a thin LoRA GEMM joins a base output without an [S, N] temporary); with
    ``out`` as well, ``out = accumulate_into + ...`` (the same traffic, into another tensor).

    Args:
        src: [rows, C] input, any strides; read at rows ``src_idx_S`` when given.
        w_ECN: [E, C, N] weights, any strides (pass ``w_ENC.transpose(1, 2)``: no copy).
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

    Returns:
        [S, N] tensor in ``src``'s dtype (fp32 accumulation): ``out``, else ``accumulate_into``
        when given.

    Raises:
        ValueError: on mismatched sizes or dtypes.
    """
    num_experts, c_dim, n_dim = w_ECN.shape
    if src.shape[-1] != c_dim or src.dtype != w_ECN.dtype:
        raise ValueError(
            f"src {tuple(src.shape)} {src.dtype} does not match w_ECN {tuple(w_ECN.shape)} {w_ECN.dtype}"
        )
    has_lora = lora_mid_SR is not None
    if has_lora and (lora_b_ERN is None or lora_mid_SR.shape[1] != lora_b_ERN.shape[1]):
        raise ValueError("lora_mid_SR [S, R] and lora_b_ERN [E, R, N] must be given together with equal R")
    for name, given, cols in (("accumulate_into", accumulate_into, n_dim), ("out", out, n_dim), ("gathered_out", gathered_out, c_dim)):
        if given is not None and (given.shape != (num_rows, cols) or given.dtype != src.dtype):
            raise ValueError(f"{name} {tuple(given.shape)} {given.dtype} is not [{num_rows}, {cols}] {src.dtype}")
    if out is not None and accumulate_into is None:
        raise ValueError("grouped_gemm: out= is for accumulate_into's sum only")
    if out is None and accumulate_into is None:
        out = torch.empty(num_rows, n_dim, device=src.device, dtype=src.dtype)
    elif out is None:
        out = accumulate_into  # in place
    acc = accumulate_into if accumulate_into is not None else out
    rank = lora_mid_SR.shape[1] if has_lora else 0
    mid = lora_mid_SR if has_lora else src
    lora_b = lora_b_ERN if has_lora else w_ECN
    gathered = gathered_out if gathered_out is not None else src

    def grid(meta):
        # Σ_e ceil(n_e / BLOCK_M) <= ceil(S / BLOCK_M) + min(E, S) - 1: a host-side bound, no sync.
        max_tiles = triton.cdiv(num_rows, meta["BLOCK_M"]) + min(num_experts, num_rows) - 1
        return max(1, max_tiles), triton.cdiv(n_dim, meta["BLOCK_N"])

    kernel = _grouped_gemm_kernel if accumulate_into is None else _grouped_gemm_accumulate_kernel
    kernel[grid](
        src, src_idx_S if src_idx_S is not None else offsets_E, w_ECN, out,
        out_idx_S if out_idx_S is not None else offsets_E,
        row_scale_S if row_scale_S is not None else src, mid, lora_b, offsets_E, acc, gathered,
        n_dim, c_dim, rank, num_experts, float(scaling), float(alpha),
        src.stride(0), src.stride(1),
        gathered.stride(0), gathered.stride(1),
        w_ECN.stride(0), w_ECN.stride(1), w_ECN.stride(2),
        out.stride(0), out.stride(1),
        acc.stride(0), acc.stride(1),
        mid.stride(0), mid.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        GATHER=src_idx_S is not None, SCATTER=out_idx_S is not None, ROW_SCALE=row_scale_S is not None,
        HAS_LORA=has_lora, ACCUMULATE=accumulate_into is not None, STORE_GATHERED=gathered_out is not None,
        **_dot_options(src.dtype),
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


class _GatherGroupedLinear(torch.autograd.Function):
    """h_SN = x[token_idx_S] W_e^T + s (x[token_idx_S] A_e^T) B_e^T, the gather fused into the loads.

    Saves x_TC (not the gathered [S, C] copy) and the thin xa_SR = x A_e^T for the LoRA B gradient.
    """

    @staticmethod
    def forward(ctx, x_TC, w_ENC, lora_a_ERC, lora_b_ENR, scaling, token_idx_S, pair_idx_S, offsets_E, top_k):
        num_rows = token_idx_S.numel()
        xa_SR = None
        lora_b_ERN = None
        if lora_a_ERC is not None:
            xa_SR = grouped_gemm(
                x_TC, lora_a_ERC.transpose(1, 2), offsets_E, num_rows, src_idx_S=token_idx_S
            )
            lora_b_ERN = lora_b_ENR.transpose(1, 2)
        h_SN = grouped_gemm(
            x_TC, w_ENC.transpose(1, 2), offsets_E, num_rows, src_idx_S=token_idx_S,
            lora_mid_SR=xa_SR, lora_b_ERN=lora_b_ERN, scaling=scaling,
        )
        ctx.save_for_backward(x_TC, w_ENC, lora_a_ERC, lora_b_ENR, xa_SR, token_idx_S, pair_idx_S, offsets_E)
        ctx.scaling = scaling
        ctx.top_k = top_k
        return h_SN

    @staticmethod
    def backward(ctx, dh_SN):
        x_TC, w_ENC, lora_a_ERC, lora_b_ENR, xa_SR, token_idx_S, pair_idx_S, offsets_E = ctx.saved_tensors
        needs_x, needs_w, needs_a, needs_b = ctx.needs_input_grad[:4]
        num_rows = token_idx_S.numel()
        mid_SR = None
        if lora_a_ERC is not None and (needs_x or needs_a):
            mid_SR = grouped_gemm(dh_SN, lora_b_ENR, offsets_E, num_rows)  # dH B_e: [S, R]
        dx_TC = dw_ENC = da_ERC = db_ENR = None
        if needs_w:  # full fine-tuning of the experts
            dw_ENC = grouped_wgrad(dh_SN, x_TC, offsets_E, rhs_idx_S=token_idx_S)
        if needs_x:
            dx_pairs = grouped_gemm(
                dh_SN, w_ENC, offsets_E, num_rows, out_idx_S=pair_idx_S,
                lora_mid_SR=mid_SR, lora_b_ERN=lora_a_ERC if mid_SR is not None else None, scaling=ctx.scaling,
            )
            dx_TC = dx_pairs.view(-1, ctx.top_k, dx_pairs.shape[-1]).sum(dim=1)
        if needs_a:
            da_ERC = grouped_wgrad(mid_SR, x_TC, offsets_E, rhs_idx_S=token_idx_S, scaling=ctx.scaling)
        if needs_b:
            db_ENR = grouped_wgrad(dh_SN, xa_SR, offsets_E, scaling=ctx.scaling)
        return dx_TC, dw_ENC, da_ERC, db_ENR, None, None, None, None, None


class _ScatterGroupedLinear(torch.autograd.Function):
    """out_TN = Σ_k w_(t,k) (a W_e^T + s (a A_e^T) B_e^T)[(t, k)]; weight and un-permute in the epilogue.

    The epilogue stores each weighted row at its (t, k) position; the sum over K is a plain
    deterministic reduction. Backward: u = dOut[token] W2eff_e gives both d a = w u and
    d w = <u, a> (the router-input gradient) without keeping the [S, N] expert outputs.
    """

    @staticmethod
    def forward(
        ctx, a_SC, weight_S, w_ENC, lora_a_ERC, lora_b_ENR, scaling, token_idx_S, pair_idx_S, offsets_E, top_k,
        output_needed,
    ):
        num_rows = a_SC.shape[0]
        aa_SR = None
        lora_b_ERN = None
        if lora_a_ERC is not None:
            aa_SR = grouped_gemm(a_SC, lora_a_ERC.transpose(1, 2), offsets_E, num_rows)
            lora_b_ERN = lora_b_ENR.transpose(1, 2)
        ctx.save_for_backward(a_SC, weight_S, w_ENC, lora_a_ERC, lora_b_ENR, aa_SR, token_idx_S, offsets_E)
        ctx.scaling = scaling
        if not output_needed:  # a recompute whose output value is discarded: the backward never reads it
            return unread_output(a_SC, num_rows // top_k, w_ENC.shape[1])
        y_pairs = grouped_gemm(
            a_SC, w_ENC.transpose(1, 2), offsets_E, num_rows, out_idx_S=pair_idx_S, row_scale_S=weight_S,
            lora_mid_SR=aa_SR, lora_b_ERN=lora_b_ERN, scaling=scaling,
        )
        return y_pairs.view(-1, top_k, y_pairs.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx, dout_TN):
        a_SC, weight_S, w_ENC, lora_a_ERC, lora_b_ENR, aa_SR, token_idx_S, offsets_E = ctx.saved_tensors
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
            u_SC = grouped_gemm(
                dout_TN, w_ENC, offsets_E, num_rows, src_idx_S=token_idx_S,
                lora_mid_SR=gb_SR, lora_b_ERN=lora_a_ERC if gb_SR is not None else None, scaling=ctx.scaling,
            )
            if needs_weight:
                d_weight = (u_SC.float() * a_SC.float()).sum(dim=-1).to(weight_S.dtype)
            if needs_a:
                d_a = u_SC * weight_S[:, None]
        if needs_la:
            da_ERC = grouped_wgrad(gb_SR, a_SC, offsets_E, row_scale_S=weight_S, scaling=ctx.scaling)
        if needs_lb:
            db_ENR = grouped_wgrad(
                dout_TN, aa_SR, offsets_E, lhs_idx_S=token_idx_S, row_scale_S=weight_S, scaling=ctx.scaling
            )
        return d_a, d_weight, dw_ENC, da_ERC, db_ENR, None, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# torch.grouped_mm: availability, the one-time view probe, alignment
# --------------------------------------------------------------------------------------------------


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> tuple[str, bool]:
    """Forward and input-gradient of a tiny grouped_mm (one expert empty) against fp32 matmuls: the
    mode, and whether the views of a LoRA-augmented weight (`augment_expert_weight`: rows of spare
    columns) are computed correctly too."""
    if _GROUPED_MM is None:
        return "unsupported", False
    gen = torch.Generator().manual_seed(0)
    num_experts, c_dim, n_dim = 3, 32, 48
    x = torch.randn(16, c_dim, generator=gen, device="cpu").to(device, dtype).requires_grad_()
    w_ENC = torch.randn(num_experts, n_dim, c_dim, generator=gen, device="cpu").to(device, dtype)
    grad = torch.randn(16, n_dim, generator=gen, device="cpu").to(device, dtype)
    offsets = torch.tensor([5, 5, 16], device=device, dtype=torch.int32)  # expert 1 gets no rows
    xf, wf, gf = x.detach().float(), w_ENC.float(), grad.float()
    ref_y = torch.cat([xf[:5] @ wf[0].T, xf[5:] @ wf[2].T])
    ref_dx = torch.cat([gf[:5] @ wf[0], gf[5:] @ wf[2]])
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 1e-1}

    def correct(w_ECN: torch.Tensor) -> bool:
        x.grad = None
        y = _GROUPED_MM(x, w_ECN, offs=offsets)
        y.backward(grad)
        return torch.allclose(y.float(), ref_y, **tol) and torch.allclose(x.grad.float(), ref_dx, **tol)

    try:
        if correct(w_ENC.transpose(1, 2)):
            augmented = F.pad(w_ENC, (0, 8, 0, 8))[:, :n_dim, :c_dim]  # an augmented weight's strides
            try:
                return "views", correct(augmented.transpose(1, 2))
            except (RuntimeError, NotImplementedError) as error:
                logger.info("grouped_mm probe of padded views on %s %s failed: %s", device, dtype, error)
                return "views", False
        if correct(w_ENC.transpose(1, 2).contiguous()):
            return "copies", False
    except (RuntimeError, NotImplementedError) as error:
        logger.info("grouped_mm probe on %s %s failed: %s", device, dtype, error)
    return "unsupported", False


def grouped_mm_mode(device: torch.device, dtype: torch.dtype) -> str:
    """How `moe_experts` runs grouped_mm on ``device`` at ``dtype``, probed once and cached.

    Returns:
        ``"views"`` (frozen weights passed as transposed views, no copy), ``"copies"`` (the view path
        gave wrong results on this torch, so weights are copied contiguous each call), or
        ``"unsupported"`` (no grouped_mm, or it raised: the native_torch loop runs instead).
    """
    key = (device.type, device.index, dtype)
    if key not in _GROUPED_MM_MODES:
        # The first call may come from inside a checkpointed layer: identity saved-tensor hooks keep
        # the probe's own saved tensors out of the checkpoint's forward/recompute bookkeeping. It may
        # also come from generation under inference_mode, where the probe's backward could not run
        # (and "unsupported" would stay cached for training).
        with (
            torch.inference_mode(False), torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ):
            mode, _AUGMENTED_VIEWS_OK[key] = _probe_grouped_mm(device, dtype)
        _GROUPED_MM_MODES[key] = mode
        level = logging.INFO if mode == "views" else logging.WARNING
        augmented = "" if mode != "views" or _AUGMENTED_VIEWS_OK[key] else " (not the LoRA-augmented weights' views: LoRA added apart)"
        logger.log(level, "grouped_mm on %s %s (torch %s): %s%s", device, dtype, torch.__version__, mode, augmented)
    return _GROUPED_MM_MODES[key]


def _grouped_mm_aligned(dtype: torch.dtype, sizes: tuple[int, ...], tensors: tuple[torch.Tensor, ...]) -> bool:
    # grouped_mm needs 16-byte aligned data pointers and row strides (GroupedMMUtils.h).
    align = 16 * 8 // torch.finfo(dtype).bits
    return all(size % align == 0 for size in sizes) and all(t.data_ptr() % 16 == 0 for t in tensors)


def select_backend(requested: str) -> str:
    """Resolve ``moe.backend`` to a backend name, checking it can run here.

    ``auto`` is ``grouped_mm`` when CUDA is present with a native grouped kernel (sm90/sm100) and the
    bf16 probe passes, else ``native_torch``.

    Raises:
        ValueError: for an unknown name.
        RuntimeError: ``grouped_mm`` on a torch without it; ``triton`` without CUDA or
            ``TRITON_INTERPRET=1``.
    """
    if requested == "auto":
        if (
            _GROUPED_MM is not None
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] in (9, 10)
            and grouped_mm_mode(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16) != "unsupported"
        ):
            return "grouped_mm"
        return "native_torch"
    if requested not in BACKENDS:
        raise ValueError(f"unknown MoE backend {requested!r}; choose one of {('auto', *BACKENDS)}")
    if requested == "grouped_mm" and _GROUPED_MM is None:
        raise RuntimeError(f"torch {torch.__version__} has no grouped_mm; set moe.backend=triton or native_torch")
    if requested == "triton" and not (torch.cuda.is_available() or _INTERPRET):
        raise RuntimeError("moe.backend=triton needs CUDA (or TRITON_INTERPRET=1 on the CPU); use native_torch")
    return requested


# --------------------------------------------------------------------------------------------------
# The three backends
# --------------------------------------------------------------------------------------------------

_LoRAFactors = tuple[torch.Tensor, torch.Tensor, float]


# torch's SiLU module and transformers' ``SiLUActivation`` (its ACT2FN["silu"] in v5.2x; nn.SiLU before)
_SILU_NAMES = {"SiLU", "SiLUActivation"}


def _swiglu(
    h_SF: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    weight_S: torch.Tensor | None = None,
    pad_out: int = 0,
    pad_grad: int = 0,
    h_copy: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(gate) * up (* routing weight per row) of h = [gate | up]; SiLU (every Qwen3-MoE) takes the
    fused `swiglu_concat` kernel, which folds the weight in (see its docstring for why), pads the
    output's and the gradient's rows as asked (other activations: contiguous) and writes h into
    ``h_copy`` as it reads it (other activations: a copy)."""
    if type(act_fn).__name__ in _SILU_NAMES and triton_can_run(h_SF):
        return swiglu_concat(h_SF, weight_S, pad_out=pad_out, pad_grad=pad_grad, h_copy=h_copy)
    if h_copy is not None:
        h_copy.copy_(h_SF)
    gate_SI, up_SI = h_SF.chunk(2, dim=-1)
    y_SI = act_fn(gate_SI) * up_SI
    return y_SI if weight_S is None else y_SI * weight_S[:, None]


def _linear_native(x: torch.Tensor, w_NC: torch.Tensor, lora: _LoRAFactors | None, expert: int) -> torch.Tensor:
    y = x @ w_NC.T
    if lora is not None:
        a_ERC, b_ENR, scaling = lora
        y = y + scaling * ((x @ a_ERC[expert].T) @ b_ENR[expert].T)
    return y


def _refuse_host_sync_in_capture(x: torch.Tensor, why: str) -> None:
    """Raise a clear error where a CUDA graph is being recorded and the path about to run syncs."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the MoE experts cannot be recorded in a CUDA graph: {why}; "
            "set moe.backend=triton (sync-free for every dtype and size) or model.cuda_graphs=false"
        )


def _experts_native(x_SD, routing, weight_S, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down):
    # Note: the one host sync of this backend (offsets read back once per call); backward has none.
    _refuse_host_sync_in_capture(x_SD, "the native_torch expert loop reads the offsets back to the host")
    ends = routing.offsets_E.tolist()
    outputs, start = [], 0
    for expert, end in enumerate(ends):
        if end > start:
            h = _linear_native(x_SD[start:end], w_gate_up_EFD[expert], lora_gate_up, expert)
            a = _swiglu(h, act_fn, weight_S[start:end])
            outputs.append(_linear_native(a, w_down_EDI[expert], lora_down, expert))
        start = end
    if not outputs:  # no rows at all: an empty output still attached to the graph (weight_S is [0])
        return x_SD.new_zeros(0, w_down_EDI.shape[1]) + weight_S[:, None]
    return torch.cat(outputs)


def _add_thin_grouped(out_SN, mid_SR, b_ERN, offsets_E, dest_SN=None):
    """``out_SN += mid_SR @ b_ERN[e]`` per expert-sorted row, in place (or into ``dest_SN``, out_SN
    unchanged): the Triton kernel reads ``out`` and writes the sum once (elsewhere a grouped_mm
    temporary and an ``add``, two more [S, N] passes). Returns the sum."""
    if triton_can_run(out_SN) and out_SN.dtype != torch.float64:
        return grouped_gemm(mid_SR, b_ERN, offsets_E, out_SN.shape[0], accumulate_into=out_SN, out=dest_SN)
    thin = _GROUPED_MM(mid_SR, b_ERN.contiguous(), offs=offsets_E)
    return out_SN.add_(thin) if dest_SN is None else torch.add(out_SN, thin, out=dest_SN)


def _time_ms(fn: Callable[[], torch.Tensor], repeats: int = 10) -> float:
    """Mean device ms of ``fn`` over ``repeats`` back-to-back runs on the current stream (CUDA events).

    The runs are queued behind a ~5 ms device sleep, so they run back to back on the device
    whatever their launch cost on the host: the graphs replay them that way (timed without the
    sleep, the host's launch cost of the Triton candidate showed in its time, e.g. 149 µs
    against 56 on the device for gate_up's dyb, and the slower candidate was picked for 3 of the 8
    products on the H200). No L2 flush between runs
    (``triton.testing.do_bench`` allocates a 256 MB buffer per call for that, in the first step's
    backward: a higher memory peak); each product reads an [S, C] or [S, N] operand far larger
    than the L2 cache at the sizes where the choice matters.
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)  # cycles: ~5 ms at the H200's 1.98 GHz
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def _thin_product(
    kind: str,
    rows_S: torch.Tensor,
    a_ERC: torch.Tensor,
    grouped_mm_fn: Callable[[], torch.Tensor],
    triton_fn: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """One thin LoRA product of `_GroupedMMLinear` (``kind``: xa, dyb, dA or dB; dA-gathered: dA reading
    x as [T, C] tokens through the routing, `_KeptGroupedMMLinear`) on grouped_mm or our Triton
    kernels, whichever ran faster the first time this shape was seen on this device.

    Why: which is faster depends on the shape and on how it runs. On the H200 at 65 536 rows, 128
    experts, R = 16, bf16 (Qwen3-30B-A3B's experts), one call at a time with L2 flushed
    (``do_bench``) Triton led for gate_up's four products and down's dB and grouped_mm for down's
    xa, dyb and dA (session 11); back to back on the device, as the graphs replay them, Triton led
    all eight (session 12: gate_up xa 72 µs against 98, dyb 56 against 88; down xa 30 against 49,
    dB 71 against 124; results/2026-12-01-h200-s12/thin_choices.txt). So it is timed per shape, not
    fixed. Both compute the same products with fp32 accumulation, in the inputs' dtype.

    The key is the product, the wide size of ``rows_S`` ([S, C] or [S, N]), E and R from ``a_ERC``,
    dtype, device, and S rounded up to a power of two (packed batches vary S; one timing per bucket).
    The first call with a key runs each candidate once (Triton autotunes then), times both
    (`_time_ms`: it synchronises), caches and logs the faster, and returns its result. Off CUDA,
    under ``TRITON_INTERPRET=1`` and for fp64 (which our kernels do not take) grouped_mm runs,
    untimed. Note: nothing is timed while a CUDA graph is being recorded (timing syncs): an uncached
    key then runs grouped_mm. The graphs record a shape only after running it eagerly, so its keys
    are cached by then; ``dA-gathered``, which only a recompute of kept activations meets, is timed
    in the recording's warm-up (its backward runs eagerly once per signature).
    """
    device, dtype = rows_S.device, rows_S.dtype
    if device.type != "cuda" or _INTERPRET or dtype == torch.float64:
        return grouped_mm_fn()
    num_experts, rank = a_ERC.shape[:2]
    width, rows_bound = rows_S.shape[1], triton.next_power_of_2(rows_S.shape[0])
    key = (kind, width, num_experts, rank, dtype, device, rows_bound)
    candidates = {"grouped_mm": grouped_mm_fn, "triton": triton_fn}  # in this order: a tie keeps grouped_mm
    choice = _THIN_CHOICES.get(key)
    if choice is not None:
        return candidates[choice]()
    if torch.cuda.is_current_stream_capturing():
        return grouped_mm_fn()
    results = {name: fn() for name, fn in candidates.items()}  # warm-up: compiles and autotunes
    times_ms = {name: _time_ms(fn) for name, fn in candidates.items()}
    choice = _THIN_CHOICES[key] = min(times_ms, key=times_ms.get)
    _log_once(
        f"thin-{key}",
        logging.INFO,
        f"MoE LoRA {kind} (size {width}, E {num_experts}, R {rank}, {dtype}, rows <= {rows_bound}) on {device}: "
        f"grouped_mm {times_ms['grouped_mm'] * 1e3:.1f} us, triton {times_ms['triton'] * 1e3:.1f} us; using {choice}",
    )
    return results[choice]


class _PermuteThin(torch.autograd.Function):
    """`permute_tokens` with the projection's thin LoRA middle: x_SD = x_TD[token_idx_S] and
    xa_SR = s x_SD A_e^T [S, R] from one Triton pass (`grouped_gemm(gathered_out=...)`).

    Apart, the gather writes the [S, D] copy and the thin GEMM reads it back (H200, 65 536 rows of
    2048 bf16, Qwen3-30B-A3B at 8K tokens: 134 + 86 µs per layer in the forward graph, session 19's
    profile). xa_SR is not differentiable here: `_GroupedMMLinear`, given it, differentiates A
    itself. The backward is `permute_tokens`'s (each token's K pair gradients summed).
    """

    @staticmethod
    def forward(ctx, x_TD, a_ERC, scaling, token_idx_S, inv_pair_S, offsets_E, top_k, pad):
        ctx.save_for_backward(inv_pair_S)
        ctx.top_k = top_k
        num_rows = token_idx_S.numel()
        x_SD = row_padded(num_rows, x_TD.shape[1], pad, x_TD)
        xa_SR = grouped_gemm(
            x_TD, a_ERC.transpose(1, 2), offsets_E, num_rows, src_idx_S=token_idx_S, gathered_out=x_SD, alpha=scaling
        )
        # one call (a second replaces the first); x_SD too where x needs no gradient: else A's
        # requires_grad would make the projection compute an input gradient nobody reads
        ctx.mark_non_differentiable(xa_SR, *(() if ctx.needs_input_grad[0] else (x_SD,)))
        return x_SD, xa_SR

    @staticmethod
    def backward(ctx, grad_SD, _grad_xa):
        (inv_pair_S,) = ctx.saved_tensors
        return sum_pairs(grad_SD, inv_pair_S, ctx.top_k), None, None, None, None, None, None, None


class _ThinHandoff:
    """s dy B_e [S, R] that `_UnpermuteThin`'s backward computed for one dy [S, D], until the down
    projection's backward (`_GroupedMMLinear`) takes it. ``take`` hands it over only for that dy (the
    same address, shape, strides and version: anything else, e.g. a sum of gradients, also one
    autograd accumulated in place, gets None and computes its own), once."""

    __slots__ = ("key", "dyb_SR")

    def __init__(self):
        self.key = self.dyb_SR = None

    @staticmethod
    def _key(t: torch.Tensor) -> tuple:
        return t.data_ptr(), tuple(t.shape), t.stride(), t._version

    def put(self, dy_SD: torch.Tensor, dyb_SR: torch.Tensor) -> None:
        self.key, self.dyb_SR = self._key(dy_SD), dyb_SR

    def take(self, dy_SD: torch.Tensor) -> torch.Tensor | None:
        dyb_SR = self.dyb_SR if self.key == self._key(dy_SD) else None
        self.key = self.dyb_SR = None
        return dyb_SR


class _UnpermuteThin(torch.autograd.Function):
    """`unpermute_tokens` whose backward (the gather of the output gradient into expert-sorted rows)
    also computes the down projection's thin s dy B_e [S, R] from the rows it loads, one Triton pass
    (`grouped_gemm(gathered_out=...)`), and leaves it in ``handoff`` for that projection's backward:
    at 8K tokens of Qwen3-30B-A3B the gather and the thin GEMM apart cost 137 + 87 µs per layer
    (session 19's profile), each reading or writing the [S, D] rows."""

    @staticmethod
    def forward(ctx, y_SD, b_ENR, scaling, token_idx_S, inv_pair_S, offsets_E, top_k, output_needed, grad_pad, handoff):
        ctx.save_for_backward(b_ENR, token_idx_S, offsets_E)
        ctx.scaling, ctx.grad_pad, ctx.handoff = scaling, grad_pad, handoff
        if not output_needed:
            return unread_output(y_SD, inv_pair_S.numel() // top_k, y_SD.shape[-1])
        return sum_pairs(y_SD, inv_pair_S, top_k)

    @staticmethod
    def backward(ctx, grad_TD):
        b_ENR, token_idx_S, offsets_E = ctx.saved_tensors
        num_rows = token_idx_S.numel()
        grad_SD = row_padded(num_rows, grad_TD.shape[1], ctx.grad_pad, grad_TD)
        dyb_SR = grouped_gemm(
            grad_TD, b_ENR, offsets_E, num_rows, src_idx_S=token_idx_S, gathered_out=grad_SD, alpha=ctx.scaling
        )
        ctx.handoff.put(grad_SD, dyb_SR)
        return grad_SD, None, None, None, None, None, None, None, None, None


class _GroupedMMLinear(torch.autograd.Function):
    """y_SN = x W_e^T (+ s (x A_e^T) B_e^T) on expert-sorted rows: grouped_mm, the LoRA added in place.

    Forward: the base runs on ``grouped_mm`` and the thin ``xa = s x A_e^T`` [S, R] on grouped_mm or
    our Triton kernel (`_thin_product`, timed once per shape); ``xa B_e^T`` is added into the base
    output by `_add_thin_grouped`. Backward (`_grouped_mm_linear_backward`), the same way: ``dx = dy
    W_e`` on grouped_mm with ``(s dy B_e) A_e`` added into it in place (``s dy B_e``, ``dA_e = (s dy
    B_e)^T x`` and ``dB_e = dy^T xa`` through `_thin_product`) and (full fine-tuning) ``dW_e = dy^T
    x``: each [S, N] or [S, C] tensor is written once, where autograd over separate ops wrote each
    LoRA term and then added it (profiled at 8K tokens of Qwen3-30B-A3B: 0.62 ms of ``add_`` in a
    5.0 ms MoE block forward+backward).
    With LoRA slots in the weight (``w_aug``, `augment_expert_weight`), an x [S, C] in rows with R
    spare columns and a dy in such rows, the LoRA term joins the base GEMM instead: xa goes into x's
    spare columns and y is one GEMM against [W | B]; s dy B goes into dy's and dx is one GEMM against
    [W ; A] (each factor copied into its slot right before the GEMM that reads it). Passing
    ``w_aug`` asserts that x's spare columns, and those of the dy that arrives in such rows, belong
    to this call (`_experts_grouped_mm` made them: `row_padded`, the SwiGLU kernel).
    Saves x [S, C] and xa [S, R]. With ``compute_output=False`` (a recompute whose output value is
    discarded) y is left unwritten: the backward does not read it. Kept activations: ``store`` (a
    forward) is called with ``(y, xa)``, y computed into ``dest_y_SN`` when given (the keep's
    buffer: no copy; the plain path only, the slotted GEMM has no ``out=``); the recompute of such
    a forward is `_KeptGroupedMMLinear`.
    """

    @staticmethod
    def forward(
        ctx, x_SC, w_ENC, a_ERC, b_ENR, scaling, offsets_E, copy_weights, compute_output, store, dest_y_SN, w_aug,
        xa_SR=None, handoff=None,
    ):  # fmt: skip
        ctx.scaling = scaling
        ctx.copy_weights = copy_weights
        ctx.w_aug = w_aug
        ctx.handoff = handoff
        if a_ERC is not None and xa_SR is None:
            xa_SR = _thin_product(
                "xa", x_SC, a_ERC,
                lambda: _GROUPED_MM(x_SC, a_ERC.transpose(1, 2), offs=offsets_E),
                lambda: grouped_gemm(x_SC, a_ERC.transpose(1, 2), offsets_E, x_SC.shape[0]),
            ).mul_(scaling)
        ctx.save_for_backward(x_SC, w_ENC, a_ERC, b_ENR, xa_SR, offsets_E)
        if not compute_output:
            return x_SC.new_empty(x_SC.shape[0], w_ENC.shape[1])
        x_aug = _padded_rows(x_SC, a_ERC.shape[1]) if w_aug is not None else None
        if x_aug is not None:  # LoRA folded into K: [x | s x A^T] [W | B]^T, one GEMM
            n_dim, c_dim = w_ENC.shape[1:]
            x_aug[:, c_dim:].copy_(xa_SR)  # x's spare columns (no version bump: x stays as saved)
            w_aug[:, :n_dim, c_dim:].copy_(b_ENR)  # B's slot, filled where it is read
            y_SN = _GROUPED_MM(x_aug, w_aug[:, :n_dim].transpose(1, 2), offs=offsets_E)  # no out=: ``store`` copies
        else:
            w_ECN = w_ENC.transpose(1, 2)
            y_SN = _GROUPED_MM(x_SC, w_ECN.contiguous() if copy_weights else w_ECN, offs=offsets_E)
            if xa_SR is not None:  # B as [E, R, N]: a view (the Triton kernel takes any strides)
                y_SN = _add_thin_grouped(y_SN, xa_SR, b_ENR.transpose(1, 2), offsets_E, dest_SN=dest_y_SN)
        if store is not None:
            store((y_SN, xa_SR))
        return y_SN

    @staticmethod
    def backward(ctx, dy_SN):
        x_SC, w_ENC, a_ERC, b_ENR, xa_SR, offsets_E = ctx.saved_tensors
        dyb_SR = ctx.handoff.take(dy_SN) if ctx.handoff is not None else None
        grads = _grouped_mm_linear_backward(
            dy_SN, x_SC, None, w_ENC, a_ERC, b_ENR, xa_SR, offsets_E, ctx.scaling, ctx.copy_weights,
            ctx.needs_input_grad[:4], ctx.w_aug, dyb_SR,
        )  # fmt: skip
        return *grads, None, None, None, None, None, None, None, None, None


class _KeptGroupedMMLinear(torch.autograd.Function):
    """The recompute of a `_GroupedMMLinear` forward whose ``(y, xa)`` were kept: returns the kept y,
    computes nothing, and differentiates as `_GroupedMMLinear` does (the same kernels on the same
    values), but reads x from the layer's [T, C] tokens at ``token_idx_S`` instead of a permuted
    [S, C] copy: the recompute gathers nothing (at 8K tokens of Qwen3-30B-A3B a 256 MiB copy, one
    index_select per layer and step), the autograd graph saves [T, C], and the backward returns the
    tokens' gradient, each token's K pair rows summed (`routing.sum_pairs`, as the permute's own
    backward sums them). Only the LoRA A gradient (and dW, full fine-tuning) reads x: through the
    Triton weight-gradient kernel's fused gather where `_thin_product` timed it faster (its own key,
    ``dA-gathered``, so on CUDA that one gradient may come from the other kernel than the forward
    path's and differ in fp32 summation order; bit for bit where both take the same), else on a
    gathered copy.
    """

    @staticmethod
    def forward(
        ctx, x_TC, w_ENC, a_ERC, b_ENR, scaling, offsets_E, copy_weights, kept_y_SN, kept_xa_SR, token_idx_S,
        inv_pair_S, top_k, w_aug,
    ):  # fmt: skip
        ctx.scaling, ctx.copy_weights, ctx.top_k, ctx.w_aug = scaling, copy_weights, top_k, w_aug
        ctx.save_for_backward(x_TC, w_ENC, a_ERC, b_ENR, kept_xa_SR, offsets_E, token_idx_S, inv_pair_S)
        return kept_y_SN.view_as(kept_y_SN)

    @staticmethod
    def backward(ctx, dy_SN):
        x_TC, w_ENC, a_ERC, b_ENR, xa_SR, offsets_E, token_idx_S, inv_pair_S = ctx.saved_tensors
        dx_SC, dw_ENC, da_ERC, db_ENR = _grouped_mm_linear_backward(
            dy_SN, x_TC, token_idx_S, w_ENC, a_ERC, b_ENR, xa_SR, offsets_E, ctx.scaling, ctx.copy_weights,
            ctx.needs_input_grad[:4], ctx.w_aug,
        )  # fmt: skip
        dx_TC = sum_pairs(dx_SC, inv_pair_S, ctx.top_k) if dx_SC is not None else None
        return dx_TC, dw_ENC, da_ERC, db_ENR, None, None, None, None, None, None, None, None, None


def _grouped_mm_linear_backward(
    dy_SN, x, token_idx_S, w_ENC, a_ERC, b_ENR, xa_SR, offsets_E, scaling, copy_weights, needs, w_aug=None,
    dyb_SR=None,
):  # fmt: skip
    """(dx_SC, dW_ENC, dA_ERC, dB_ENR) of `_GroupedMMLinear` (None where ``needs`` says no); x is the
    [S, C] sorted rows, or [T, C] read at rows ``token_idx_S`` (dx is [S, C] either way). With the
    weight's LoRA slots ``w_aug`` and dy in padded rows, dx is one GEMM: [dy | s dy B] [W ; A].
    ``dyb_SR``: s dy B_e already computed (`_UnpermuteThin`'s backward), else computed here."""
    needs_x, needs_w, needs_a, needs_b = needs
    dy_aug = _padded_rows(dy_SN, a_ERC.shape[1]) if w_aug is not None and needs_x else None
    dy_SN = dy_SN if dy_aug is not None else dy_SN.contiguous()
    dx_SC = dw_ENC = da_ERC = db_ENR = None
    gathered = token_idx_S is not None
    # x in sorted-row order, gathered at most once (LoRA A on grouped_mm and dW may both read it)
    x_SC = functools.cache(lambda: x.index_select(0, token_idx_S) if gathered else x)

    if needs_x and dy_aug is None:
        # in "copies" mode, the layout the probe found correct: a view of the contiguous [E, C, N]
        w_view = w_ENC.transpose(1, 2).contiguous().transpose(1, 2) if copy_weights else w_ENC
        dx_SC = _GROUPED_MM(dy_SN, w_view, offs=offsets_E)
    if a_ERC is not None and (needs_x or needs_a):
        if dyb_SR is None:
            dyb_SR = _thin_product(  # s dy B_e: [S, R]
                "dyb", dy_SN, a_ERC,
                lambda: _GROUPED_MM(dy_SN, b_ENR, offs=offsets_E),
                lambda: grouped_gemm(dy_SN, b_ENR, offsets_E, dy_SN.shape[0]),
            ).mul_(scaling)
        if dy_aug is not None:  # one GEMM over [dy | s dy B] against [W ; A]
            n_dim, c_dim = w_ENC.shape[1:]
            dy_aug[:, n_dim:].copy_(dyb_SR)
            # A's slot, filled where it is read: another forward through this weight (another
            # adapter) may have used the slots since this backward's forward
            w_aug[:, n_dim:, :c_dim].copy_(a_ERC)
            dx_SC = _GROUPED_MM(dy_aug, w_aug[:, :, :c_dim], offs=offsets_E)
        elif needs_x:
            _add_thin_grouped(dx_SC, dyb_SR, a_ERC, offsets_E)
        if needs_a:
            da_ERC = _thin_product(
                "dA-gathered" if gathered else "dA", x, a_ERC,
                lambda: _GROUPED_MM(dyb_SR.t(), x_SC(), offs=offsets_E),
                lambda: grouped_wgrad(dyb_SR, x, offsets_E, rhs_idx_S=token_idx_S),
            )
    if needs_b:
        db_ENR = _thin_product(
            "dB", dy_SN, a_ERC,
            lambda: _GROUPED_MM(dy_SN.t(), xa_SR, offs=offsets_E),
            lambda: grouped_wgrad(dy_SN, xa_SR, offsets_E),
        )
    if needs_w:  # full fine-tuning of the experts
        dw_ENC = _GROUPED_MM(dy_SN.t(), x_SC(), offs=offsets_E)
    return dx_SC, dw_ENC, da_ERC, db_ENR


def padded_rank(rank: int, dtype: torch.dtype) -> int:
    """The LoRA rank the ``grouped_mm`` backend runs: R rounded up to 16-byte rows of the thin [S, R]
    middle in ``dtype`` (grouped_mm's stride rule; the padded terms are zero factors: exact)."""
    return rank + -rank % (16 * 8 // torch.finfo(dtype).bits)


def _padded_lora(lora: _LoRAFactors | None, dtype: torch.dtype) -> tuple:
    """``(a_ERC, b_ENR, scaling)`` with R padded by zero factors to 16-byte rows of the thin [S, R]
    middle (grouped_mm's stride rule; exact: the padded terms are zero)."""
    a_ERC, b_ENR, scaling = _lora_args(lora)
    if lora is not None:
        pad = padded_rank(a_ERC.shape[1], dtype) - a_ERC.shape[1]
        if pad:
            a_ERC = F.pad(a_ERC, (0, 0, 0, pad))
            b_ENR = F.pad(b_ENR, (0, pad))
    return a_ERC, b_ENR, scaling


_LORA_SLOTS_ATTR = "_lightning_ft_lora_slots"


def augment_expert_weight(weight_ENC: torch.nn.Parameter, rank: int) -> bool:
    """Lay a frozen [E, N, C] expert weight out inside an [E, N + R, C + R] tensor, in place.

    The weight becomes the ``[:, :N, :C]`` view; the spare columns ``[:, :N, C:]`` and rows
    ``[:, N:, :C]`` are slots where the ``grouped_mm`` backend copies the expert's LoRA B [N, R] and
    A [R, C] (in the weight's dtype) right before the GEMM that reads them. The split LoRA then
    joins the base GEMM along K: the forward is one GEMM ``[x | s x Aᵀ] [W | B]ᵀ`` (the thin [S, R]
    middle written into spare columns of x's rows) and the input gradient one GEMM
    ``[dy | s dy B] [W ; A]``, where otherwise a Triton pass reads and writes the [S, N] output (the
    [S, C] input gradient) to add the LoRA term.
    B·A is never formed, and the sum is rounded once instead of twice. Measured on the H200 at
    65 536 rows, 128 experts, R = 16 (Qwen3-30B-A3B at 8K tokens, µs per layer, the GEMMs alone):
    gate/up forward 833 → 732, its input gradient 954 → 840; down 590 → 442 and 513 → 482; the
    12-layer step 1–2% faster (benchmarks/RESULTS.md, session 16). Costs R·(N + C) elements per
    expert: 26 MB per Qwen3-30B-A3B layer in bf16 (``moe.lora_slots=false`` for the least memory).

    Args:
        weight_ENC: the experts' ``gate_up_proj`` or ``down_proj`` parameter (frozen).
        rank: R, the LoRA rank padded as the backend pads it (`padded_rank`).

    Returns:
        True when laid out; False (nothing done) when the weight already has slots of this rank or
        when the one-time probe found grouped_mm's results on such views wrong on this device and
        dtype (`grouped_mm_mode`): every path then keeps reading a contiguous weight.

    Raises:
        ValueError: the weight is trainable (the backend takes the slots of frozen weights only: a
            trained weight's gradient dW is another GEMM) or not 3-D.
    """
    if weight_ENC.requires_grad or weight_ENC.dim() != 3:
        raise ValueError(f"augment_expert_weight: expected a frozen [E, N, C] weight, got {tuple(weight_ENC.shape)} "
                         f"requires_grad={weight_ENC.requires_grad}")
    if _lora_slots(weight_ENC, rank) is not None or not _augmented_views_ok(weight_ENC.device, weight_ENC.dtype):
        return False
    num_experts, n_dim, c_dim = weight_ENC.shape
    augmented = weight_ENC.new_zeros(num_experts, n_dim + rank, c_dim + rank)
    augmented[:, :n_dim, :c_dim] = weight_ENC.data
    weight_ENC.data = augmented[:, :n_dim, :c_dim]
    setattr(weight_ENC, _LORA_SLOTS_ATTR, rank)
    return True


def _augmented_views_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether grouped_mm runs on transposed views here and the probe found augmented weights' views correct."""
    return grouped_mm_mode(device, dtype) == "views" and _AUGMENTED_VIEWS_OK.get((device.type, device.index, dtype), False)


def _lora_slots(w_ENC: torch.Tensor, rank: int | None) -> torch.Tensor | None:
    """The [E, N + R, C + R] tensor around ``w_ENC`` (`augment_expert_weight`) when its slots fit the
    padded LoRA rank R and the layout still holds (a moved or reassigned weight falls back)."""
    if rank is None or getattr(w_ENC, _LORA_SLOTS_ATTR, None) != rank or w_ENC.requires_grad:
        return None
    num_experts, n_dim, c_dim = w_ENC.shape
    stride = ((n_dim + rank) * (c_dim + rank), c_dim + rank, 1)
    fits = w_ENC.untyped_storage().nbytes() >= num_experts * stride[0] * w_ENC.element_size()
    if w_ENC.stride() != stride or w_ENC.storage_offset() != 0 or not fits:
        return None
    # .data: the slots' writes leave the weight's version counter alone (autograd saved the weight)
    return w_ENC.data.as_strided((num_experts, n_dim + rank, c_dim + rank), stride, 0)


def _padded_rows(t_SC: torch.Tensor, pad: int) -> torch.Tensor | None:
    """[S, C + pad] over ``t_SC`` when it is a view of rows with ``pad`` spare columns (`row_padded`), else None."""
    rows, cols = t_SC.shape
    if rows == 0 or t_SC.stride() != (cols + pad, 1):
        return None
    if t_SC.untyped_storage().nbytes() < (t_SC.storage_offset() + rows * (cols + pad)) * t_SC.element_size():
        return None
    return t_SC.data.as_strided((rows, cols + pad), (cols + pad, 1))  # spare-column writes: no version bump


def _linear_grouped_mm(
    x_SC, w_ENC, offsets_E, padded_lora: tuple, copy_weights, compute_output, w_aug, keep=None, xa_SR=None, handoff=None
):  # fmt: skip
    """`_GroupedMMLinear` on sorted rows (``padded_lora`` from `_padded_lora`); ``keep`` (a forward's,
    not a recompute's) is offered (y, xa); ``xa_SR`` (`_PermuteThin`) and ``handoff``
    (`_UnpermuteThin`) bring thin products computed elsewhere. Returns y and the kept buffer the
    caller must copy y into (`_swiglu`'s ``h_copy``), or None."""
    store = keep.store if keep is not None else None
    buffers = keep.buffers() if keep is not None else None  # a later forward: y lands in the buffer
    dest_y_SN = buffers[0] if buffers is not None else None
    pending = None
    if dest_y_SN is not None and w_aug is not None and _padded_rows(x_SC, padded_lora[0].shape[1]) is not None:
        # the slotted GEMM has no out=: its consumer writes y into the buffer as it reads it
        # (one [S, N] write instead of a copy's read and write), and the keep is offered the buffer
        pending, dest_y_SN = dest_y_SN, None
        store = functools.partial(_store_pending, keep.store, pending)
    y_SN = _GroupedMMLinear.apply(
        x_SC, w_ENC, *padded_lora, offsets_E, copy_weights, compute_output, store, dest_y_SN, w_aug, xa_SR, handoff,
    )
    return y_SN, pending


def _store_pending(store: Callable, pending_y_SN: torch.Tensor, values: tuple) -> None:
    store((pending_y_SN, *values[1:]))


def _experts_grouped_mm(
    x_TD, routing, weight_S, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down, copy_weights, output_needed,
    keep, use_slots=False,
):  # fmt: skip
    """out_TD of the grouped_mm backend: the experts' outputs summed per token (`unpermute_tokens`),
    its gradient gathered into rows with the down projection's LoRA slots as spare columns, if any.

    Where Triton runs, the two gathers of [S, D] rows feed the thin LoRA product that reads them
    in the same pass: x's with gate/up's x A^T (`_PermuteThin`), the output gradient's with down's
    dy B (`_UnpermuteThin`)."""
    offsets_E = routing.offsets_E
    fuse_thin = triton_can_run(x_TD) and x_TD.dtype != torch.float64  # our kernels add in fp32
    gate_up, down = _padded_lora(lora_gate_up, x_TD.dtype), _padded_lora(lora_down, x_TD.dtype)
    def slots(weight, a_ERC):
        return _lora_slots(weight, a_ERC.shape[1]) if use_slots and a_ERC is not None else None

    gate_up_aug, down_aug = slots(w_gate_up_EFD, gate_up[0]), slots(w_down_EDI, down[0])
    gate_up_pad = gate_up[0].shape[1] if gate_up_aug is not None else 0
    down_pad = down[0].shape[1] if down_aug is not None else 0
    kept = keep.take() if keep is not None and keep.recompute else None  # None: computed
    if kept is not None:  # the recompute of a forward that kept gate/up: no GEMM, no [S, D] gather
        kept_h_SF, kept_xa_SR = kept
        h_copy = None
        h_SF = _KeptGroupedMMLinear.apply(
            x_TD, w_gate_up_EFD, *gate_up, offsets_E, copy_weights, kept_h_SF, kept_xa_SR,
            routing.token_idx_S, routing.inv_pair_S, routing.top_k, gate_up_aug,
        )  # fmt: skip
    else:
        forward_keep = keep if keep is not None and not keep.recompute else None
        xa_SR = None
        if fuse_thin and gate_up[0] is not None:
            x_SD, xa_SR = _PermuteThin.apply(
                x_TD, gate_up[0], gate_up[2], routing.token_idx_S, routing.inv_pair_S, offsets_E, routing.top_k,
                gate_up_pad,
            )  # fmt: skip
        else:
            x_SD = permute_tokens(x_TD, routing, pad=gate_up_pad)
        h_SF, h_copy = _linear_grouped_mm(
            x_SD, w_gate_up_EFD, offsets_E, gate_up, copy_weights, True, gate_up_aug, forward_keep, xa_SR
        )
    a_SI = _swiglu(h_SF, act_fn, weight_S, pad_out=down_pad, pad_grad=gate_up_pad, h_copy=h_copy)
    handoff = _ThinHandoff() if fuse_thin and down[0] is not None else None
    y_SD, _ = _linear_grouped_mm(
        a_SI, w_down_EDI, offsets_E, down, copy_weights, output_needed, down_aug, handoff=handoff
    )
    if handoff is None:
        return unpermute_tokens(y_SD, routing, output_needed=output_needed, grad_pad=down_pad)
    return _UnpermuteThin.apply(
        y_SD, down[1], down[2], routing.token_idx_S, routing.inv_pair_S, offsets_E, routing.top_k, output_needed,
        down_pad, handoff,
    )  # fmt: skip


def _lora_args(lora: _LoRAFactors | None) -> tuple:
    return (None, None, 1.0) if lora is None else lora


def _experts_triton(
    x_TD, weight_S, routing, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down, output_needed
):
    h_SF = _GatherGroupedLinear.apply(
        x_TD, w_gate_up_EFD, *_lora_args(lora_gate_up),
        routing.token_idx_S, routing.pair_idx_S, routing.offsets_E, routing.top_k,
    )
    return _ScatterGroupedLinear.apply(
        _swiglu(h_SF, act_fn), weight_S, w_down_EDI, *_lora_args(lora_down),
        routing.token_idx_S, routing.pair_idx_S, routing.offsets_E, routing.top_k, output_needed,
    )


def moe_experts(
    x_TD: torch.Tensor,
    topk_weight_TK: torch.Tensor,
    routing: ExpertRouting,
    w_gate_up_EFD: torch.Tensor,
    w_down_EDI: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    gate_up_lora: ExpertLoRA | None = None,
    down_lora: ExpertLoRA | None = None,
    backend: str = "grouped_mm",
    output_needed: bool = True,
    keep=None,
) -> torch.Tensor:
    """The routed experts of one MoE layer: gated MLP per (token, expert) pair, weighted sum over k.

    Args:
        x_TD: [T, D] hidden states.
        topk_weight_TK: [T, K] routing weights (differentiable: the router-input gradient flows).
        routing: `ExpertRouting` from ``sort_by_expert(topk_idx_TK, E)``.
        w_gate_up_EFD: [E, 2I, D] gate and up weights (frozen or not).
        w_down_EDI: [E, D, I] down weights.
        act_fn: the gate activation (transformers' ``experts.act_fn``).
        gate_up_lora / down_lora: PEFT's split LoRA of each projection, or None.
        backend: ``native_torch``, ``grouped_mm`` or ``triton`` (see the module docstring).
        output_needed: False when the caller discards the output's value and only differentiates
            through it (a checkpointed layer's recompute, where the MoE output only feeds the
            layer's residual sum): ``grouped_mm`` and ``triton`` then skip the down projection and
            the un-permute, whose backward needs neither, and return zeros attached to the graph.
        keep: kept activations (`lightning_ft.strategies.kept.KeptActivations`, or anything with its
            ``recompute``, ``store``, ``buffers`` and ``take``), ``grouped_mm`` only: a forward
            computes into the ``buffers`` of the call, if any (with LoRA slots the SwiGLU kernel
            writes h there as it reads it: the slotted GEMM has no ``out=``), and offers the gate/up
            output h [S, 2I] (split LoRA added) and the thin LoRA product s·x Aᵀ [S, R] (None
            without LoRA) to ``store``; the recompute of that forward, on the same inputs, takes
            them back and skips the gate/up GEMM, its LoRA and the [S, D] gather of x,
            differentiating through them as if it had run them (the values are the forward's
            exactly: the same kernels on the same inputs; `_KeptGroupedMMLinear`). Other backends
            neither store nor take.

    Returns:
        [T, D] in ``x_TD``'s dtype; computed in the weights' dtype with autocast off.

    Raises:
        ValueError: for an unknown backend.
        RuntimeError: ``triton`` on CPU tensors without ``TRITON_INTERPRET=1``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; choose one of {BACKENDS}")
    if backend == "triton" and x_TD.device.type != "cuda" and not _INTERPRET:
        raise RuntimeError(
            f"the triton MoE backend got {x_TD.device.type} tensors; it runs on CUDA (or the CPU under "
            "TRITON_INTERPRET=1): move the model to the GPU or use native_torch"
        )
    dtype = w_gate_up_EFD.dtype
    with torch.autocast(x_TD.device.type, enabled=False):
        x = x_TD.to(dtype)
        weight_S = topk_weight_TK.to(dtype).reshape(-1).index_select(0, routing.pair_idx_S)
        lora_gate_up = gate_up_lora.factors(dtype) if gate_up_lora is not None else None
        lora_down = down_lora.factors(dtype) if down_lora is not None else None
        weights = (w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down)
        # grouped_mm and native_torch: the routing weight scales each pair's down-projection input
        # (inside the SwiGLU kernel)
        if backend == "triton":
            out_TD = _experts_triton(x, weight_S, routing, *weights, output_needed)
        elif backend == "grouped_mm":
            out_TD = _run_grouped_mm(x, routing, weight_S, *weights, output_needed, keep)
        else:
            out_TD = unpermute_tokens(_experts_native(permute_tokens(x, routing), routing, weight_S, *weights), routing)
    return out_TD.to(x_TD.dtype)


def _run_grouped_mm(
    x_TD, routing, weight_S, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down, output_needed, keep=None
) -> torch.Tensor:
    """out_TD of the grouped_mm backend (`_experts_grouped_mm`), or of native_torch where grouped_mm
    cannot run (logged once)."""
    dtype = x_TD.dtype
    mode = grouped_mm_mode(x_TD.device, dtype)
    sizes = (w_gate_up_EFD.shape[1], w_gate_up_EFD.shape[2], w_down_EDI.shape[2])
    if mode == "unsupported" or not _grouped_mm_aligned(dtype, sizes, (w_gate_up_EFD, w_down_EDI)):
        _log_once(
            f"grouped_mm-fallback-{x_TD.device.type}-{dtype}-{sizes}",
            logging.WARNING,
            f"grouped_mm cannot run experts of sizes {sizes} at {dtype} on {x_TD.device.type} (mode {mode}, "
            "sizes must be multiples of 16 bytes); running the native_torch loop (one host sync per layer). "
            "Use moe.backend=triton to stay sync-free.",
        )
        y_SD = _experts_native(
            permute_tokens(x_TD, routing), routing, weight_S, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down
        )
        return unpermute_tokens(y_SD, routing)
    if dtype != torch.bfloat16:  # torch's grouped_mm loops over a host copy of the offsets there
        _refuse_host_sync_in_capture(x_TD, f"grouped_mm has no sync-free kernel for {dtype} (bf16 only)")
    use_slots = _augmented_views_ok(x_TD.device, dtype)
    return _experts_grouped_mm(
        x_TD, routing, weight_S, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down, mode == "copies", output_needed,
        keep, use_slots,
    )
