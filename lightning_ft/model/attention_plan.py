"""Which kernel runs which document of a packed row: cuDNN for the long ones, flash-attention 2 for packs of short ones.

On Hopper, cuDNN's fused attention (what SDPA runs for one causal sequence) is the fastest exact
kernel for a long document, well ahead of flash-attention 2, the kernel behind PyTorch's varlen
attention; but it takes one sequence per call (torch's packed cuDNN entry is not used:
`PACKED_CUDNN_TORCH`), and for short documents one launch per document loses to one varlen launch
for all of them. So a packed row is cut into segments (`plan_segments`):

    cudnn    one document of at least ``min_cudnn_tokens`` tokens, alone
    varlen   a run of consecutive shorter documents, through flash-attention 2 varlen

and the segments' kernels make one `AttentionKernel` (`segmented_kernel`) whose forward runs them
in order on slices of the packed q/k/v and concatenates their outputs, and whose backward does the
same with the gradients. The plan is built once per batch on the host from its ``cu_seqlens``
(cached on the batch, like the other attention metadata: `PackedBatch.cached`), so no layer waits
on the device; each run's own offsets reach the device in one copy.

``min_cudnn_tokens`` comes from `crossover`: for each shape class (query and key/value heads, head
dim, dtype, device) the first time a layer of that class runs, both kernels are timed (forward +
backward) on one document of each power-of-two length from 256 to 16384 tokens, and cuDNN takes
the documents from the shortest length at which it is faster there and at every longer length
(never, when it does not win at 16384). The result is cached for the process and logged once.

Sources: measured on the H200 (benchmarks/RESULTS.md, table ``attention_kernels``): cuDNN's causal
kernel fwd+bwd at ~545 TFLOP/s from 8K tokens, flash-attention 2 at ~290-330.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from lightning_ft.data.packing import PackedBatch
from lightning_ft.model.attention_kernels import (
    AttentionKernel, cudnn_causal_kernel, cudnn_runs, flash_varlen_kernel,
)  # fmt: skip

__all__ = [
    "PACKED_CUDNN_TORCH", "VARLEN_ONLY", "Segment", "batch_plan", "calibrate", "crossover", "cuda_ms", "device_cu_seqlens", "min_crossover", "plan_segments", "segmented_kernel",
]  # fmt: skip

logger = logging.getLogger(__name__)

# torch versions ("major.minor") whose packed cuDNN entry (``aten::_cudnn_attention_forward`` with
# cumulative offsets) gives exact gradients and is faster than a launch per document: none yet.
# torch 2.11 on the H200: a correct forward but dq off by up to 3.9, and 35x slower than
# flash-attention 2 varlen (tests/model/test_attention_gpu.py re-checks it on every run).
PACKED_CUDNN_TORCH: tuple[str, ...] = ()

CALIBRATION_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384)
MIN_CUDNN_TOKENS = 2  # cuDNN's frontend refuses a sequence of one token (s_q = s_kv = 1): those stay in varlen runs
NEVER = 1 << 62  # min_cudnn_tokens when cuDNN never wins (or cannot run)
_CROSSOVERS: dict[tuple, int] = {}
VARLEN_ONLY = "attention_varlen_only"  # a `PackedBatch` cache key: set, its plan is flash-attention 2 alone


@dataclass(frozen=True)
class Segment:
    """A token range [start, end) of a packed row and the kernel it runs through.

    ``kind`` is ``cudnn`` (one document) or ``varlen`` (consecutive documents); a varlen segment's
    offsets, relative to ``start``, are ``run_offsets[first:last]`` of the plan, its longest
    document ``max_seqlen`` tokens.
    """

    kind: str
    start: int
    end: int
    first: int = 0
    last: int = 0
    max_seqlen: int = 0


def plan_segments(cu_seqlens: torch.Tensor, min_cudnn_tokens: int) -> tuple[tuple[Segment, ...], torch.Tensor]:
    """Cut a packed row into cuDNN documents and flash-attention runs.

    Args:
        cu_seqlens: [N + 1] int32 cumulative document lengths, on the host (empty documents allowed).
        min_cudnn_tokens: a document of at least this many tokens (and at least `MIN_CUDNN_TOKENS`) is a
            ``cudnn`` segment.

    Returns:
        (segments in row order covering [0, T), run_offsets): ``run_offsets`` int32 on the host holds
        each varlen segment's offsets relative to its start (0 ... its length), one after another.
    """
    bounds = cu_seqlens.tolist()
    segments: list[Segment] = []
    offsets: list[int] = []
    run: list[int] = []  # the open run's document bounds (absolute)

    def close_run():
        if len(run) > 1 and run[-1] > run[0]:
            first = len(offsets)
            offsets.extend(b - run[0] for b in run)
            longest = max(b - a for a, b in zip(run[:-1], run[1:]))
            segments.append(Segment("varlen", run[0], run[-1], first, len(offsets), longest))
        run.clear()

    min_cudnn_tokens = max(min_cudnn_tokens, MIN_CUDNN_TOKENS)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end - start >= min_cudnn_tokens:
            close_run()
            segments.append(Segment("cudnn", start, end))
        else:
            if not run:
                run.append(start)
            run.append(end)
    close_run()
    return tuple(segments), torch.tensor(offsets, dtype=torch.int32)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def segmented_kernel(
    segments: tuple[Segment, ...],
    run_offsets: torch.Tensor,
    scale: float | None,
    sliding_window: int | None,
    cudnn: Callable[[float | None], AttentionKernel] | None = None,
    varlen: Callable[..., AttentionKernel] | None = None,
) -> AttentionKernel:
    """One `AttentionKernel` (layout THD) running each segment's kernel on its slice of the packed row.

    Args:
        segments, run_offsets: `plan_segments`' plan; ``run_offsets`` already on the kernels' device.
        scale: the softmax scale; sliding_window: keys with ``q - k < sliding_window`` (varlen only:
            a plan for a windowed layer has no cudnn segment).
        cudnn, varlen: the kernel factories (None: `cudnn_causal_kernel`, `flash_varlen_kernel`; tests
            pass stand-ins with their contracts).

    A plan of one segment is that segment's kernel itself. Otherwise forward and backward run the
    segments in order and concatenate along T; ``aux`` is the segments' aux lengths, then their aux
    entries one after another (flat, as kept attention stores it).
    """
    cudnn, varlen = cudnn or cudnn_causal_kernel, varlen or flash_varlen_kernel
    kernels = []
    for seg in segments:
        if seg.kind == "cudnn":
            kernels.append(cudnn(scale))
        else:
            kernels.append(varlen(run_offsets[seg.first : seg.last], seg.max_seqlen, scale, sliding_window))
    if len(kernels) == 1 and segments[0].start == 0:
        return kernels[0]
    sizes = [seg.end - seg.start for seg in segments]

    def forward(q, k, v):
        outs, counts, aux = [], [], []
        for kernel, qs, ks, vs in zip(kernels, q.split(sizes), k.split(sizes), v.split(sizes)):
            out, seg_aux = kernel.forward(qs, ks, vs)
            outs.append(out)
            counts.append(len(seg_aux))
            aux.extend(seg_aux)
        return _cat(outs), (tuple(counts), *aux)

    def unflatten(aux):
        parts, i = [], 1
        for n in aux[0]:
            parts.append(tuple(aux[i : i + n]))
            i += n
        return parts

    def backward(grad_out, q, k, v, out, aux):
        grads = [[], [], []]
        pieces = zip(kernels, unflatten(aux), *(t.split(sizes) for t in (grad_out, q, k, v, out)))
        for kernel, seg_aux, g, qs, ks, vs, os in pieces:
            for acc, grad in zip(grads, kernel.backward(g, qs, ks, vs, os, seg_aux)):
                acc.append(grad)
        return tuple(_cat(acc) for acc in grads)

    def lse(aux):
        parts = zip(kernels, unflatten(aux), sizes)
        return torch.cat([kernel.log_sum_exp(a, a[0].numel() // n, n) for kernel, a, n in parts], dim=1)

    return AttentionKernel(forward, backward, layout="THD", lse=lse)


def device_cu_seqlens(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` ([N + 1] int32) copied to ``device`` without waiting for it."""
    return cu_seqlens.to(device, non_blocking=True)


def batch_plan(batch: PackedBatch, min_cudnn_tokens: int, device: torch.device) -> tuple[tuple[Segment, ...], torch.Tensor]:
    """`plan_segments` of ``batch`` with its run offsets on ``device``, built once per batch and device.

    A batch marked `VARLEN_ONLY` (a CUDA graph's static batch recorded for any row of a bucket of
    layouts) runs every document through flash-attention 2. A plan with no cudnn segment is one varlen run over the whole row: its offsets are the batch's
    own device ``cu_seqlens`` (the buffer CUDA graphs copy each batch's offsets into).
    """

    if batch._cache.get(VARLEN_ONLY):
        min_cudnn_tokens = NEVER

    def build():
        segments, offsets = plan_segments(batch.cu_seqlens, min_cudnn_tokens)
        if all(seg.kind == "varlen" for seg in segments):
            whole = Segment("varlen", 0, batch.num_tokens, 0, batch.cu_seqlens.numel(), batch.max_seqlen)
            device_offsets = batch.cached(("cu_seqlens", device), lambda: device_cu_seqlens(batch.cu_seqlens, device))
            return (whole,), device_offsets
        return segments, device_cu_seqlens(offsets, device)

    return batch.cached(("attention_plan", min_cudnn_tokens, device), build)


def cuda_ms(step: Callable[[], object]) -> float:
    """Milliseconds of the device work ``step`` queues on the current stream, timed with CUDA events (waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time_ms(kernel: AttentionKernel, q, k, v, grad, repeats: int = 3) -> float:
    def step():
        out, aux = kernel.forward(q, k, v)
        kernel.backward(grad, q, k, v, out, aux)

    step()  # warm-up (and cuDNN's plan for this shape)
    return statistics.median(cuda_ms(step) for _ in range(repeats))


def crossover(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """The shortest document length from which cuDNN's attention beats flash-attention 2, for q/k/v's shape class.

    Measured once per (Hq, Hkv, D, dtype, device) on fresh tensors of ``CALIBRATION_LENGTHS`` tokens
    (forward + backward, median of 3 after a warm-up; synchronizes the device, once), then cached and
    logged. `NEVER` where cuDNN cannot run (`cudnn_runs`) or never wins, and without caching while
    the stream is capturing a CUDA graph (nothing can be timed then).

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D], bf16/fp16.
    """
    key = (q.shape[1], k.shape[1], q.shape[2], q.dtype, q.device)
    if key in _CROSSOVERS:
        return _CROSSOVERS[key]
    if not cudnn_runs(q):
        _CROSSOVERS[key] = NEVER
        logger.info(f"attention auto ({key[0]} q / {key[1]} kv heads of {key[2]}, {q.dtype}): flash-attention 2 for every "
                    f"document (cuDNN's attention here needs a Hopper GPU, bf16/fp16, a head dim that is a "
                    "multiple of 8 and at most 128, or 256 on sm90 with cuDNN >= 9.13)")
        return NEVER
    if torch.cuda.is_current_stream_capturing():
        return NEVER
    timings = {}
    generator = torch.Generator(q.device).manual_seed(0)  # its own: the run's generator draws nothing here
    with torch.no_grad():
        for length in CALIBRATION_LENGTHS:
            qs, ks, vs, grad = (
                torch.randn(length, *t.shape[1:], dtype=t.dtype, device=t.device, generator=generator) for t in (q, k, v, q)
            )
            offsets = torch.tensor([0, length], dtype=torch.int32, device=q.device)
            timings[length] = (
                _time_ms(cudnn_causal_kernel(None), qs, ks, vs, grad),
                _time_ms(flash_varlen_kernel(offsets, length, None, None), qs, ks, vs, grad),
            )
    wins = [length for length, (cudnn_ms, flash_ms) in timings.items() if cudnn_ms < flash_ms]
    result = NEVER
    for length in reversed(CALIBRATION_LENGTHS):  # the shortest length from which cuDNN wins at every longer one
        if length not in wins:
            break
        result = length
    _CROSSOVERS[key] = result
    shown = ", ".join(f"{n}: {c:.2f}/{f:.2f}" for n, (c, f) in timings.items())
    choice = f"cuDNN for documents of >= {result} tokens" if result != NEVER else "flash-attention 2 for every document"
    logger.info(f"attention auto ({key[0]} q / {key[1]} kv heads of {key[2]}, {q.dtype}): {choice}; "
                f"fwd+bwd ms cuDNN/flash-attention 2 by tokens: {shown}")
    return result


def calibrate(config, device: torch.device, dtype: torch.dtype) -> int | None:
    """`crossover` for the attention of a transformers ``config`` (its heads and head dim) on ``device``, at the start.

    Measured before the first step, so CUDA graphs know which rows may run cuDNN segments
    (`min_crossover`) before they record any. Returns None where the config does not say its
    attention shape (the first layer call measures it instead).
    """
    heads = getattr(config, "num_attention_heads", None)
    if not heads or device.type != "cuda":
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if getattr(config, "qk_rope_head_dim", None):  # MLA: q/k carry the rope part too; v is padded to their width
        head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    dtype = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16  # under autocast
    q, k = (torch.empty(1, h, head_dim, dtype=dtype, device=device) for h in (heads, kv_heads))
    return crossover(q, k, k)


def min_crossover() -> int:
    """The shortest `crossover` measured so far in this process (`NEVER` before any): rows with a document
    at least this long may run cuDNN segments, so CUDA graphs record them per exact layout."""
    return min(_CROSSOVERS.values(), default=NEVER)
