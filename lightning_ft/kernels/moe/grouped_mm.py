"""The ``grouped_mm`` MoE experts backend: torch's grouped GEMM on expert-sorted rows, LoRA added in place.

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
  wins everywhere, benchmarks/RESULTS.md "Thin expert-LoRA GEMMs"). A one-time probe
  per (device, dtype) checks that the view path is correct; if only the contiguous layout is, it
  copies and logs; if grouped_mm fails, or a size is not a multiple of 16 bytes, it runs
  ``native_torch`` and logs. Sync-free on CUDA only where torch has a native grouped kernel for the
  dtype (bf16 on sm90/sm100 in torch 2.10's sources); elsewhere torch itself loops over a host copy
  of ``offs``.

Frozen fp8 expert weights (`lightning_ft.kernels.fp8.Fp8ExpertWeight`, ``strategy.fp8``) run the same
orchestration (kept activations, the thin LoRA products and their fused gathers) with the base products on our
grouped GEMM's fp8 path instead (`_base_product`, `_base_input_grad`); NF4 and MXFP4 ones
(`lightning_ft.kernels.nf4.Nf4ExpertWeight`, `lightning_ft.kernels.mxfp4.Mxfp4Weight`: ``model.quantization=nf4``,
``mxfp4``) are dequantised whole into a shared buffer before each base product and run on grouped_mm. None of them
has LoRA slots.

Math, shapes and split LoRA: `lightning_ft.kernels.moe._common`; the plain-torch reference of the
backend is ``native_torch``, which also runs where grouped_mm cannot (not over quantised weights: refused there).

Sources: ``torch._grouped_mm`` stride rules (``GroupedMMUtils.h``).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.testing

from lightning_ft.kernels._utils import row_padded, triton_can_run
from lightning_ft.kernels.fp8 import Fp8ExpertWeight
from lightning_ft.kernels.moe._common import (
    _INTERPRET,
    ExpertBiases,
    _add_routed_bias,
    _LoRAFactors,
    _lora_args,
    _refuse_host_sync_in_capture,
    _swiglu,
)
from lightning_ft.kernels.moe.grouped_gemm import (
    _FOUR_BIT_WEIGHTS,
    _QUANTISED_WEIGHTS,
    _base_rows,
    _saved_weight,
    _weight_of,
    grouped_gemm,
    grouped_wgrad,
)
from lightning_ft.kernels.moe.native_torch import experts_native_torch
from lightning_ft.kernels.moe.routing import expert_of_rows, permute_tokens, sum_pairs, unpermute_tokens, unread_output

__all__ = ["augment_expert_weight", "grouped_mm_mode", "padded_rank"]

logger = logging.getLogger(__name__)


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

_GROUPED_MM_MODES: dict[tuple[str, int | None, torch.dtype], str] = {}

_AUGMENTED_VIEWS_OK: dict[tuple[str, int | None, torch.dtype], bool] = {}

# (product, C or N, E, R, dtype, device, power-of-two row bound) -> "grouped_mm" or "triton"
_THIN_CHOICES: dict[tuple, str] = {}

_LOGGED: set[str] = set()


def _log_once(key: str, level: int, message: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, message)


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
    sleep, the host's launch cost of the Triton candidate showed in its time, several times its
    device time, and the slower candidate was picked for some products). No L2 flush between runs
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

    Why: which is faster depends on the shape and on how it runs. On an H200 at Qwen3-30B-A3B's
    expert shapes (65 536 rows, 128 experts, R = 16, bf16), one call at a time with L2 flushed
    (``do_bench``) each kernel led for some of the products; back to back on the device, as the
    graphs replay them, Triton led all eight. So it is timed per shape, not fixed. Both compute the
    same products with fp32 accumulation, in the inputs' dtype.

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

    Apart, the gather writes the [S, D] copy and the thin GEMM reads it back (two passes over the
    [S, D] rows, where this reads them once). xa_SR is not differentiable here: `_GroupedMMLinear`, given it, differentiates A
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
    the gather and the thin GEMM apart each read or write the [S, D] rows."""

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
    LoRA term and then added it (separate ``add_`` passes over those tensors, a sizeable part of an MoE
    block's forward+backward at long rows).
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
        ctx.save_for_backward(x_SC, *_saved_weight(ctx, w_ENC), a_ERC, b_ENR, xa_SR, offsets_E)
        if not compute_output:
            return x_SC.new_empty(x_SC.shape[0], w_ENC.shape[1])
        x_aug = _padded_rows(x_SC, a_ERC.shape[1]) if w_aug is not None else None
        if x_aug is not None:  # LoRA folded into K: [x | s x A^T] [W | B]^T, one GEMM
            n_dim, c_dim = w_ENC.shape[1:]
            x_aug[:, c_dim:].copy_(xa_SR)  # x's spare columns (no version bump: x stays as saved)
            w_aug[:, :n_dim, c_dim:].copy_(b_ENR)  # B's slot, filled where it is read
            y_SN = _GROUPED_MM(x_aug, w_aug[:, :n_dim].transpose(1, 2), offs=offsets_E)  # no out=: ``store`` copies
        else:
            y_SN = _base_product(x_SC, w_ENC, offsets_E, copy_weights)
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
            dy_SN, x_SC, None, _weight_of(ctx, w_ENC), a_ERC, b_ENR, xa_SR, offsets_E, ctx.scaling, ctx.copy_weights,
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
        ctx.save_for_backward(x_TC, *_saved_weight(ctx, w_ENC), a_ERC, b_ENR, kept_xa_SR, offsets_E, token_idx_S, inv_pair_S)
        return kept_y_SN.view_as(kept_y_SN)

    @staticmethod
    def backward(ctx, dy_SN):
        x_TC, w_ENC, a_ERC, b_ENR, xa_SR, offsets_E, token_idx_S, inv_pair_S = ctx.saved_tensors
        dx_SC, dw_ENC, da_ERC, db_ENR = _grouped_mm_linear_backward(
            dy_SN, x_TC, token_idx_S, _weight_of(ctx, w_ENC), a_ERC, b_ENR, xa_SR, offsets_E, ctx.scaling, ctx.copy_weights,
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
        dx_SC = _base_input_grad(dy_SN, w_ENC, offsets_E, copy_weights)
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


def _base_product(x_SC, w_ENC, offsets_E, copy_weights) -> torch.Tensor:
    """x_SC W_e^T [S, N] on expert-sorted rows: grouped_mm over the dense weight's transposed view (in "copies" mode,
    the contiguous copy the probe found correct; an `Nf4ExpertWeight` or `Mxfp4Weight` dequantised whole into the shared
    buffer first, ``dense_in_buffer``, as the triton backend does), or for an `Fp8ExpertWeight` our grouped GEMM's fp8
    path over x's rows in e4m3 (`grouped_gemm._base_rows`: one quantisation pass)."""
    if isinstance(w_ENC, Fp8ExpertWeight):
        x_base, x_scale = _base_rows(x_SC, w_ENC)
        return grouped_gemm(x_base, w_ENC.transpose(1, 2), offsets_E, x_SC.shape[0], src_scale=x_scale)
    if isinstance(w_ENC, _FOUR_BIT_WEIGHTS):
        w_ENC = w_ENC.dense_in_buffer()
    w_ECN = w_ENC.transpose(1, 2)
    return _GROUPED_MM(x_SC, w_ECN.contiguous() if copy_weights else w_ECN, offs=offsets_E)


def _base_input_grad(dy_SN, w_ENC, offsets_E, copy_weights) -> torch.Tensor:
    """dy_SN W_e [S, C]: grouped_mm (in "copies" mode over a view of the contiguous [E, C, N]; NF4 and MXFP4
    dequantised into the shared buffer first, as in `_base_product`), or for an
    `Fp8ExpertWeight` our grouped GEMM with the e4m3 weight widened in its tiles (dy as it is: see `grouped_gemm`)."""
    if isinstance(w_ENC, Fp8ExpertWeight):
        return grouped_gemm(dy_SN, w_ENC, offsets_E, dy_SN.shape[0])
    if isinstance(w_ENC, _FOUR_BIT_WEIGHTS):
        w_ENC = w_ENC.dense_in_buffer()
    w_view = w_ENC.transpose(1, 2).contiguous().transpose(1, 2) if copy_weights else w_ENC
    return _GROUPED_MM(dy_SN, w_view, offs=offsets_E)


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
    B·A is never formed, and the sum is rounded once instead of twice. At Qwen3-30B-A3B's expert
    shapes each expert GEMM and its input gradient get faster and the training step a little
    (benchmarks/RESULTS.md). Costs R·(N + C) elements per
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
    keep, use_slots=False, biases=ExpertBiases(),
):  # fmt: skip
    """out_TD of the grouped_mm backend: the experts' outputs summed per token (`unpermute_tokens`),
    its gradient gathered into rows with the down projection's LoRA slots as spare columns, if any.

    Where Triton runs, the two gathers of [S, D] rows feed the thin LoRA product that reads them
    in the same pass: x's with gate/up's x A^T (`_PermuteThin`), the output gradient's with down's
    dy B (`_UnpermuteThin`). ``biases`` (gpt-oss): the gate/up bias is added inside the fused activation
    (`_swiglu`), the down bias times the routing weight to the tokens' summed outputs (`_add_routed_bias`; the
    down input already holds the weight), so a kept h (the GEMM's output) serves the recompute as it is."""
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
    expert_S = expert_of_rows(offsets_E, routing.token_idx_S.numel()) if any(b is not None for b in biases) else None
    bias_rows = (biases.gate_up_EF, expert_S) if biases.gate_up_EF is not None else None
    a_SI = _swiglu(h_SF, act_fn, weight_S, pad_out=down_pad, pad_grad=gate_up_pad, h_copy=h_copy, bias_rows=bias_rows)
    handoff = _ThinHandoff() if fuse_thin and down[0] is not None else None
    y_SD, _ = _linear_grouped_mm(
        a_SI, w_down_EDI, offsets_E, down, copy_weights, output_needed, down_aug, handoff=handoff
    )
    if handoff is None:
        out_TD = unpermute_tokens(y_SD, routing, output_needed=output_needed, grad_pad=down_pad)
    else:
        out_TD = _UnpermuteThin.apply(
            y_SD, down[1], down[2], routing.token_idx_S, routing.inv_pair_S, offsets_E, routing.top_k, output_needed,
            down_pad, handoff,
        )  # fmt: skip
    if biases.down_ED is not None:  # a_SI holds the routing weight; the bias term is added per token
        out_TD = _add_routed_bias(out_TD, biases.down_ED, weight_S, routing, expert_S, output_needed)
    return out_TD


def experts_grouped_mm(
    x_TD, routing, weight_S, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down, output_needed, keep=None,
    biases=ExpertBiases(),
) -> torch.Tensor:
    """out_TD of the grouped_mm backend (`_experts_grouped_mm`), or of native_torch where grouped_mm
    cannot run (logged once). ``keep`` keeps the gate/up GEMM's output, before any bias (gpt-oss's is added in
    the activation, on the forward and on the recompute alike)."""
    dtype = x_TD.dtype
    mode = grouped_mm_mode(x_TD.device, dtype)
    sizes = (w_gate_up_EFD.shape[1], w_gate_up_EFD.shape[2], w_down_EDI.shape[2])
    dense = tuple(w for w in (w_gate_up_EFD, w_down_EDI) if not isinstance(w, _QUANTISED_WEIGHTS))
    if mode == "unsupported" or not _grouped_mm_aligned(dtype, sizes, dense):
        if len(dense) < 2:  # native_torch computes over dense weights only
            raise ValueError(
                f"fp8, NF4 or MXFP4 experts of sizes {sizes} at {dtype} on {x_TD.device.type}: grouped_mm cannot run them here "
                f"(mode {mode}, sizes must be multiples of 16 bytes): set moe.backend=triton"
            )
        _log_once(
            f"grouped_mm-fallback-{x_TD.device.type}-{dtype}-{sizes}",
            logging.WARNING,
            f"grouped_mm cannot run experts of sizes {sizes} at {dtype} on {x_TD.device.type} (mode {mode}, "
            "sizes must be multiples of 16 bytes); running the native_torch loop (one host sync per layer). "
            "Use moe.backend=triton to stay sync-free.",
        )
        y_SD = experts_native_torch(
            permute_tokens(x_TD, routing), routing, weight_S, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down,
            biases,
        )
        return unpermute_tokens(y_SD, routing)
    if dtype != torch.bfloat16:  # torch's grouped_mm loops over a host copy of the offsets there
        _refuse_host_sync_in_capture(x_TD, f"grouped_mm has no sync-free kernel for {dtype} (bf16 only)")
    use_slots = _augmented_views_ok(x_TD.device, dtype)
    return _experts_grouped_mm(
        x_TD, routing, weight_S, w_gate_up_EFD, w_down_EDI, act_fn, lora_gate_up, lora_down, mode == "copies", output_needed,
        keep, use_slots, biases,
    )
