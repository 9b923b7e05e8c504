"""CUDA graphs for checkpointed decoder layers: two graph launches per layer instead of its kernels one by one.

Why: at short rows the training step is bound by the host, not the GPU: a Qwen3-MoE step at 1K
tokens keeps the GPU busy a small fraction of its time (benchmarks/RESULTS.md): each
layer issues ~350 kernels through Python (HF modules, PEFT, autograd, checkpointing), and does it
three times (forward, recompute, backward). A CUDA graph replays a recorded stream of kernels with
one host call.

`apply_cuda_graphs(model)` patches every decoder layer (transformers' ``GradientCheckpointingLayer``)
so that in training, with gradients on, the layer is one checkpointed autograd function whose two
halves are CUDA graphs recorded from the layer itself:

    forward   graph F:  out = layer(x, **kwargs)                     under no_grad; x is the checkpoint
    backward  graph B:  out = layer(x, **kwargs) with grad (the recompute), then
                        dx, dθ = autograd.grad(out, (x, θ), dout)     θ = the layer's trainable weights

Per call only copies reach the device besides the replay: x (and dout) into the static inputs, the
output (and dx) out of them, the weight gradients out as fresh tensors (one multi-tensor kernel), which
autograd accumulates into ``.grad`` as usual (DDP's hooks see them; a weight the output does not
depend on gets None, as in eager). The math is the layer's own: the graphs replay the kernels the
layer ran when recorded (our fused kernels, HF's modules, PEFT's adapters; the forward recorded
under no_grad, as checkpointing's first forward needs nothing saved); the tests compare with the
eager layer.

Kept activations (`lightning_ft.strategies.kept`, selective checkpointing): the forward graph also
keeps results that are expensive to recompute, and the backward graph's recompute reuses them:

- ``keep_attention`` (on by default): each layer's attention output and log-sum-exp ([T, Hq, D]
  in bf16 plus [Hq, T] fp32 per layer and token count); the recompute skips attention's forward (the
  most expensive op of a long row after the GEMMs; see benchmarks/RESULTS.md).
- ``keep_projections`` (on by default): the outputs of the projections, the GEMMs of the layer:
  each fused LoRA linear layer the architecture's patch table lists (`lightning_ft.model.patching`,
  e.g. q/k/v/o; [T, N] plus the thin [T, R] x·Aᵀ) and each MoE layer's expert gate/up output with its
  split LoRA added ([T·top_k, 2·I] plus [T·top_k, R]; ``grouped_mm`` backend, rows not run in token chunks,
  ``moe.chunk_tokens``); the recompute skips
  those GEMMs and their LoRA products. At 8K tokens on Qwen3-30B-A3B that is 306 MiB per layer.
  Two kinds: attention's projections (``projections``) and the MLP's (``mlp``: a dense MLP's linear
  layers, the experts' gate/up), which a memory plan treats apart.

Layers keep while everything kept fits in 90% of the GPU's memory (`_ModelGraphs.allow_keep`,
asked per call in a layer's first forward, until it refuses; the calls refused recompute). The
kept tensors live outside the graphs' pool (a layer's first forward runs eagerly to allocate them,
the recorded forward copies or computes into them): the pool's memory is reused as scratch by every
graph. A layer's recordings for other signatures share its kept buffers where the shapes match
(`KeptActivations.shared`: packed rows of one token count and other document counts), so a layer
keeps one set, not one per signature. A layer whose forward ran again before its backward (two
forwards, one backward, or another signature's forward) replays its forward graph once more in
backward to restore what it keeps on the device.

Activation offloading (``activation_offload``, off by default): each layer's input, the one
tensor checkpointing keeps, waits in pinned host memory from the layer's forward to its backward
(`lightning_ft.strategies.offload`), for replayed and eager calls alike (but eager calls with
positional arguments or keyword tensors that require grad: those are checkpointed on the device).
A memory plan (`apply_memory_plan`) may offload the kept kinds too: per kind, the layers that offload it
(the last one excepted) take turns, in layer order, between two staging sets of that kind's kept buffers
(``KeptActivations.shared`` keyed by the set, not the layer). A layer's forward graph writes its sets, one per
kind it offloads (after the compute stream has waited for the copies still reading or writing them), then the sets are
copied to the layer call's own pinned host tensors on the copy stream; before the backward graph
reads them, they are copied back unless they still hold that call's values, one layer ahead, like the
inputs (`ActivationOffload.save`, `save_staged`, `load`). Those entries are restored from the host,
never by replaying the forward. Replayed calls only: eager calls keep nothing.

When graphs are recorded: per input signature (shapes, dtypes, autocast, requires_grad, the packed
batch's layout, every non-tensor keyword), the second time a layer sees it; the first call runs
eagerly (checkpointed), so a shape seen once never pays for a recording. At most
``max_signatures`` signatures per model get graphs, first come first served; calls with others run
eagerly (logged once). Static inputs are shared by every layer of a signature (x, dout, output,
dx, the keyword tensors such as RoPE's cos/sin, the device ``cu_seqlens``), keyword tensors are
copied once per forward (every layer gets the same ones), and the weight-gradient buffers are
shared by the whole model (one backward replays at a time). All graphs of a model share one memory
pool: they never run at the same time, so the pool holds about one layer's recompute and backward
working set.

Requirements (checked): ``model.attention`` auto, cudnn, varlen or sdpa (flex is not supported); with
auto/varlen, rows of flash-attention 2 alone with the same token count share graphs, recorded per
power-of-two bound on the document count (the graph's ``cu_seqlens`` padded with empty documents)
and on the longest document (`_packed_layout`; `FinetuneModule` pads packed rows to one token
count); rows with cuDNN segments and, with sdpa, every row get graphs per exact layout (the
segments' lengths, the dense mask, are in the graph); sliding windows are a layer's constant (recorded
with it); no dropout
(the recompute would draw another mask); no keyword tensor that requires grad; layers not sharded (FSDP2 gathers weights per layer at new
addresses: `FinetuneModule` skips the graphs there, with a warning). The graphs read weights at
their addresses: a layer whose parameters are replaced, move or change ``requires_grad`` is
recorded again (checked per call). Adapters switched, disabled or merged during training need
`revert_cuda_graphs` first. Evaluation (no grad, or ``eval()``) runs the layer eagerly. On the
CPU the "graphs" re-run the recorded functions (the same code path, for tests), so the CUDA-only
parts (warm-up and capture on a side stream) are covered by the ``gpu`` tests alone.

Sources: CUDA Graphs (CUDA C++ Programming Guide); ``torch.cuda.CUDAGraph`` and the pattern of
``torch.cuda.make_graphed_callables`` (static inputs, warm-up and capture on a side stream, a shared
pool); recompute-in-backward as in ``torch.utils.checkpoint`` (Chen et al., 2016).
"""

from __future__ import annotations

import functools
import itertools
import logging
import types
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

from lightning_ft.data.packing import PackedBatch
from lightning_ft.model.attention import ATTENTION_NAMES, VARLEN_FAMILY
from lightning_ft.model.attention_plan import NEVER, VARLEN_ONLY, device_cu_seqlens, min_crossover
from lightning_ft.model.patching import restore_instance_attr
from lightning_ft.strategies.kept import KINDS, KeptActivations, keeping, kinds_allowed, stored_nbytes
from lightning_ft.strategies.offload import ActivationOffload, offloaded_checkpoint
from lightning_ft.strategies.planner import Plan
from lightning_ft.strategies.recompute import checkpoint_contexts, recomputing

__all__ = [
    "GRAPH_TOKEN_MULTIPLE", "apply_cuda_graphs", "apply_memory_plan", "check_cuda_graphs", "cuda_graph_stats", "graphed_layers", "keep_max_bytes",
    "revert_cuda_graphs",
]

logger = logging.getLogger(__name__)

_STATE_ATTR = "_lightning_ft_cuda_graphs"  # on each patched layer: the model's `_ModelGraphs`
_CHECKPOINTING_ATTR = "_lightning_ft_cuda_graphs_checkpointing"  # the layer's own flag before patching
_INDEX_ATTR = "_lightning_ft_cuda_graphs_index"  # on each patched layer: its position among the decoder layers
_SCALARS = (type(None), bool, int, float, str)
_FORWARD_IDS = itertools.count(1)
GRAPH_TOKEN_MULTIPLE = 256  # graphed rows are padded to a multiple of this many tokens (`FinetuneModule.pad_for_graphs`)


class _Ungraphable(Exception):
    """A call that the graphs cannot replay; it runs eagerly."""


def _packed_layout(batch: PackedBatch, attention: str) -> tuple:
    """The layout a graph over ``batch`` is recorded for, under the ``attention`` backend.

    auto/cudnn/varlen read ``cu_seqlens`` from the device (copied into the graph's buffer per batch)
    and ``max_seqlen`` from the host: rows of flash-attention 2 alone with the same token count
    share a graph per power-of-two bound on their document count and one on their longest
    document. The graph's ``cu_seqlens`` holds the bound's count of documents: the row's, then
    empty ones (offsets repeating T, which flash-attention gives no work), and its ``max_seqlen`` is
    the bound on the longest (a larger bound only launches blocks that find no work). A row with a
    document long enough for cuDNN (`lightning_ft.model.attention_plan.min_crossover`; every row
    under cudnn) and a row of one document are recorded per exact layout: their segments' lengths
    are in the graph. The dense SDPA mask is built from the exact lengths, so those graphs are
    recorded per exact layout too.
    """
    if batch.num_docs == 1:
        return ("packed", batch.num_tokens, 1)
    if attention in VARLEN_FAMILY:
        cudnn_from = {"cudnn": 1, "varlen": NEVER}.get(attention) or min_crossover()
        if batch.max_seqlen < cudnn_from:
            docs = 1 << (batch.num_docs - 1).bit_length()
            longest = min(batch.num_tokens, 1 << (batch.max_seqlen - 1).bit_length())
            return ("packed", batch.num_tokens, docs, longest)
    return ("packed", tuple(batch.cu_seqlens.tolist()))  # a host tensor: no sync


def _bucket_cu_seqlens(cu_seqlens: torch.Tensor, docs: int) -> torch.Tensor:
    """``cu_seqlens`` ([N + 1] int32, host) grown to ``docs + 1`` offsets by empty documents at the end."""
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(docs + 1 - cu_seqlens.numel())])


def _signature(value: Any, attention: str) -> Any:
    """What a graph recorded with ``value`` as an input depends on (hashable)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            raise _Ungraphable("a keyword tensor requires grad")
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_signature(v, attention) for v in value))
    if isinstance(value, PackedBatch):
        return value.cached(("cuda_graphs_layout", attention), lambda: _packed_layout(value, attention))
    if isinstance(value, _SCALARS):
        return value
    raise _Ungraphable(f"a keyword of type {type(value).__name__}")


def _requires_grad(value: Any) -> bool:
    """Whether a keyword argument holds a tensor that requires grad."""
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_requires_grad(v) for v in value.values())
    return False


def _static_like(value: Any, device: torch.device, attention: str) -> Any:
    """A static buffer for each tensor in ``value``; for a packed batch, one that graphs can replay."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    if isinstance(value, (tuple, list)):
        return type(value)(_static_like(v, device, attention) for v in value)
    if isinstance(value, PackedBatch):
        layout = _packed_layout(value, attention)
        if len(layout) != 4:
            return replace(value, _cache={})  # the exact layout: what attention derives from it is static
        cu_seqlens = _bucket_cu_seqlens(value.cu_seqlens, layout[2])
        static = replace(value, cu_seqlens=cu_seqlens, max_seqlen=layout[3], _cache={VARLEN_ONLY: True})
        static._cache[("cu_seqlens", device)] = torch.empty_like(cu_seqlens, device=device)
        return static
    return value


def _copy_into(static: Any, source: Any, path: tuple, sources: dict[tuple, Any], device: torch.device) -> None:
    """Copy ``source``'s tensors into ``static``'s buffers, skipping those copied last time unchanged."""
    if isinstance(source, torch.Tensor):
        mark = sources.get(path)
        if mark is None or mark[0] is not source or mark[1] != source._version:
            static.copy_(source)
            sources[path] = (source, source._version)
    elif isinstance(source, (tuple, list)):
        for i, (s, v) in enumerate(zip(static, source)):
            _copy_into(s, v, (*path, i), sources, device)
    elif isinstance(source, PackedBatch) and ("cu_seqlens", device) in static._cache and sources.get(path) is not source:
        buffer = static._cache[("cu_seqlens", device)]  # the graph's count of documents: the batch's, then empty ones
        buffer.copy_(device_cu_seqlens(_bucket_cu_seqlens(source.cu_seqlens, buffer.numel() - 1), device))
        sources[path] = source


@dataclass
class _StaticInputs:
    """One signature's buffers, shared by every layer (layers run one at a time)."""

    hidden: torch.Tensor  # x, the layer input
    out: torch.Tensor
    grad_out: torch.Tensor
    grad_in: torch.Tensor
    kwargs: dict[str, Any]
    sources: dict[tuple, Any] = field(default_factory=dict)  # what each keyword buffer last copied
    warmed_up: bool = False

    def load(self, hidden: torch.Tensor, kwargs: dict[str, Any]) -> None:
        for name, value in kwargs.items():
            _copy_into(self.kwargs[name], value, (name,), self.sources, self.hidden.device)
        self.hidden.copy_(hidden)


class _EagerReplay:
    """Stands in for a CUDA graph off CUDA (tests): ``replay()`` runs the recorded function again."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@dataclass
class _LayerGraphs:
    forward: Any  # torch.cuda.CUDAGraph, or _EagerReplay off CUDA
    backward: Any
    params: list[torch.nn.Parameter]
    param_grads: list[torch.Tensor]  # static buffers the backward graph writes
    unused: list[bool]  # weights the layer's output does not depend on: their gradient is None
    fingerprint: tuple
    kept: dict[str, KeptActivations]  # per kind (`KINDS`): what the forward graph keeps for the backward graph
    entries: list[tuple]  # the kept buffer sets (`KeptActivations.kept`) the forward graph writes, maybe shared
    staged: tuple[tuple, ...] = ()  # ... of the kinds offloaded: staging buffer sets shared with other layers


def _fingerprint(layer: torch.nn.Module) -> tuple:
    return tuple((id(p), p.data_ptr(), p.requires_grad) for p in layer.parameters())


class _ModelGraphs:
    """The graphs of one model: signatures, static inputs, the shared pool and capture stream."""

    def __init__(
        self,
        max_signatures: int,
        attention: str,
        keep_attention: bool = True,
        optimizer_bytes: int = 0,
        offload: ActivationOffload | None = None,
        keep_projections: bool = True,
        keep_max_bytes: int | None = None,
    ):
        self.max_signatures = max_signatures
        self.attention = attention  # the attention backend: how packed batches are keyed (`_packed_layout`)
        self.keep = kinds_allowed(keep_attention, keep_projections)  # the kinds layers may keep
        self.keep_max_bytes = keep_max_bytes  # a cap on all that is kept (None: the memory budget alone)
        self.plan: Plan | None = None  # a memory plan: per layer, which kinds keep (`apply_memory_plan`)
        self.offload = offload  # where the layers' inputs wait for the backward (None: on the device)
        self.optimizer_bytes = optimizer_bytes  # room left for optimizer states that may not exist yet
        self.statics: dict[tuple, _StaticInputs] = {}
        self.param_grads: dict[tuple, torch.Tensor] = {}  # (index, shape, dtype, device) -> buffer; one backward at a time
        self.graphs: dict[tuple[int, tuple], _LayerGraphs] = {}  # (id(layer), signature) -> graphs
        # (id(layer), kind) -> buffers its recordings share; (("offload", s), kind) -> staging set s of an offloaded kind
        self.kept_shared: dict[tuple[Any, str], dict] = {}
        self.staging: dict[tuple[int, str], int] = {}  # (layer index, kind) -> its staging set (0 or 1) where the plan offloads it
        self.kept_writers: dict[int, int] = {}  # id(buffer set) -> the `_GraphedLayer` call whose forward wrote it last
        self.seen: dict[tuple[int, tuple], int] = {}
        self.pool = None
        self.stream: torch.cuda.Stream | None = None
        self.logged: set[str] = set()
        self.captures = 0
        self.replayed = 0  # training calls of a layer run from its graphs
        self.eager = 0  # ... and run eagerly (first sighting, over max_signatures, not graphable)
        self.recording = False  # inside `_record`: layer calls run the layer's own forward

    def log_once(self, message: str) -> None:
        if message not in self.logged:
            self.logged.add(message)
            logger.info("cuda graphs: %s", message)

    def kept_bytes(self, kind: str | None = None) -> int:
        """What the layers' recorded graphs keep, of one kind or all: each buffer set once (`KeptActivations.shared`)."""
        kinds = KINDS if kind is None else (kind,)
        return sum(stored_nbytes(store) for (_, k), store in self.kept_shared.items() if k in kinds)

    def allow_keep(self, nbytes: int, device: torch.device, kind: str = "attention", layer: int | None = None) -> bool:
        """Whether decoder layer ``layer`` may keep ``nbytes`` more of ``kind`` (`lightning_ft.strategies.kept`).

        With a memory plan (`apply_memory_plan`): only where the plan keeps or offloads ``kind`` in that layer
        (offloaded: into a staging set, `apply_memory_plan`). On CUDA: while the peak reserved so far, everything
        kept so far (staging sets included), these, and
        ``optimizer_bytes`` (two moments per trainable weight, for an optimizer that may not have
        stepped yet) fit in 90% of the GPU's memory; the peak is re-read at each request. On every
        device: while everything kept so far and these fit in ``keep_max_bytes``, when set. Layers
        that do not fit recompute instead (when the kind may keep at all).
        """
        if not self.keep[kind]:
            return False
        if self.plan is not None and layer is not None and self.plan.action(layer, kind) not in ("keep", "offload"):
            return False
        kept = self.kept_bytes() + nbytes
        if self.keep_max_bytes is not None and kept > self.keep_max_bytes:
            self.log_once(
                f"strategy.keep_max_gib={self.keep_max_bytes / 2**30:g} reached: the rest of the layers' "
                f"{kind} outputs are recomputed"
            )
            return False
        if device.type == "cuda":
            limit = 0.9 * torch.cuda.get_device_properties(device).total_memory
            if torch.cuda.max_memory_reserved(device) + kept + self.optimizer_bytes > limit:
                self.log_once(f"not enough GPU memory to keep more of the layers' {kind} outputs: the rest are recomputed")
                return False
        return True

    def graphs_for(self, layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> tuple | None:
        """The (graphs, static inputs) to replay for this call, recording them if due; None: run eagerly."""
        try:
            if not hidden.is_contiguous():
                raise _Ungraphable("a non-contiguous layer input")
            signature = (
                ("hidden", tuple(hidden.shape), hidden.dtype, hidden.device, hidden.requires_grad),
                tuple((name, _signature(value, self.attention)) for name, value in sorted(kwargs.items())),
                torch.is_autocast_enabled(hidden.device.type),
                torch.get_autocast_dtype(hidden.device.type),
            )
        except _Ungraphable as why:
            self.log_once(f"{why}: those calls run eagerly")
            return None
        key = (id(layer), signature)
        if layer.gradient_checkpointing:  # switched on again after apply_cuda_graphs: ours recomputes already
            self.log_once("gradient checkpointing was enabled again on graphed layers: switched off (the graphs recompute)")
            layer.gradient_checkpointing = False
        graphs = self.graphs.get(key)
        if graphs is not None:
            if graphs.fingerprint == _fingerprint(layer):
                return graphs, self.statics[signature]
            self.log_once("a layer's weights moved or changed requires_grad: recording its graphs again")
            del self.graphs[key]
        if not hidden.requires_grad and not any(p.requires_grad for p in layer.parameters()):
            return None  # nothing to differentiate: a checkpointed eager call costs nothing in backward
        if len(self.seen) > 10_000:  # signatures that never came back (e.g. every batch a new layout)
            self.seen.clear()
        seen = self.seen[key] = self.seen.get(key, 0) + 1
        if seen < 2:
            return None
        if signature not in self.statics and len(self.statics) >= self.max_signatures:
            self.log_once(f"{self.max_signatures} input signatures recorded (max_signatures): new ones run eagerly")
            return None
        static = self.statics.get(signature) or self._new_static(signature, hidden, kwargs)
        if self.offload is not None:  # the recording writes staging buffers that copies may still read or write
            self.offload.wait_copies(hidden.device)
        graphs = self.graphs[key] = self._record(layer, static, hidden, kwargs)
        return graphs, static

    def _new_static(self, signature: tuple, hidden: torch.Tensor, kwargs: dict[str, Any]) -> _StaticInputs:
        static = _StaticInputs(
            hidden=torch.empty_like(hidden),
            out=torch.empty_like(hidden),
            grad_out=torch.empty_like(hidden),
            grad_in=torch.empty_like(hidden),
            kwargs={name: _static_like(value, hidden.device, self.attention) for name, value in kwargs.items()},
        )
        self.statics[signature] = static
        return static

    def _record(self, layer: torch.nn.Module, static: _StaticInputs, hidden: torch.Tensor, kwargs: dict[str, Any]) -> _LayerGraphs:
        """Warm up (once per signature) and record the layer's forward and backward graphs."""
        static.load(hidden, kwargs)
        params = [p for p in layer.parameters() if p.requires_grad]
        param_grads = []
        for i, p in enumerate(params):
            slot = (i, tuple(p.shape), p.dtype, p.device)
            if slot not in self.param_grads:
                self.param_grads[slot] = torch.empty_like(p, memory_format=torch.contiguous_format)
            param_grads.append(self.param_grads[slot])
        unused = [False] * len(params)
        forward = functools.partial(type(layer).forward, layer)
        device_type = hidden.device.type
        amp = dict(
            device_type=device_type,
            dtype=torch.get_autocast_dtype(device_type),
            enabled=torch.is_autocast_enabled(device_type),
            cache_enabled=False,  # a cast cached during a recording would be stale at replay
        )
        input_grad = hidden.requires_grad

        index = getattr(layer, _INDEX_ATTR, None)
        offloaded = {kind for kind in KINDS if (index, kind) in self.staging}
        kept = {  # what they keep enters their layer's shared store, or their staging set's (and kept_bytes), as it is kept
            kind: KeptActivations(
                kind,
                functools.partial(self.allow_keep, device=hidden.device, kind=kind, layer=index),
                shared=self.kept_shared.setdefault((("offload", self.staging[index, kind]) if kind in offloaded else id(layer), kind), {}),
            )
            for kind in KINDS
        }

        def run_forward() -> None:
            with torch.no_grad(), torch.autocast(**amp), keeping(*kept.values(), recompute=False):
                static.out.copy_(forward(static.hidden, **static.kwargs))

        names = [name for name, p in layer.named_parameters() if p.requires_grad]

        def run_backward() -> None:
            # Gradients are taken for fresh leaves that share the weights' memory: the weights' own
            # AccumulateGrad nodes were made on the default stream, and the autograd engine would
            # join the capture stream to it (an error while capturing).
            x = static.hidden.detach().requires_grad_(input_grad)
            leaves = [p.detach().requires_grad_() for p in params]
            self.recording = True  # the call below reaches our patched forward: run the layer's own
            try:
                with torch.enable_grad(), torch.autocast(**amp), keeping(*kept.values(), recompute=True), recomputing():
                    out = torch.func.functional_call(layer, dict(zip(names, leaves)), (x,), static.kwargs, strict=False)
            finally:
                self.recording = False
            inputs = [x, *leaves] if input_grad else leaves
            grads = list(torch.autograd.grad(out, inputs, static.grad_out, allow_unused=True))
            if input_grad:
                static.grad_in.copy_(grads.pop(0))
            for i, (buffer, grad) in enumerate(zip(param_grads, grads)):
                unused[i] = grad is None
                if grad is not None:
                    buffer.copy_(grad)

        run_forward()  # eagerly first: the kept attention buffers are allocated outside the graphs' pool
        if hidden.is_cuda:
            graphs = self._capture(static, (run_forward, run_backward))
        else:
            graphs = [_EagerReplay(run_forward), _EagerReplay(run_backward)]
        self.captures += 1
        self.log_once(f"recording each layer's forward and backward graphs for input {tuple(hidden.shape)}")
        if self.keep["attention"] and kept["attention"].enabled is None:
            self.log_once(
                "attention outputs not kept for some layers: their attention has no kept kernel here (kept: auto, cudnn "
                "and varlen; sdpa on the CPU)"
            )
        entries = [entry for kind, keep in kept.items() if kind not in offloaded for entry in keep.kept if entry is not None]
        staged = tuple(entry for kind in offloaded for entry in kept[kind].kept if entry is not None)
        for entry in entries:  # the recording wrote them with this call's input (the replay that follows marks it)
            self.kept_writers[id(entry)] = 0
        return _LayerGraphs(graphs[0], graphs[1], params, param_grads, unused, _fingerprint(layer), kept, entries, staged)

    def _capture(self, static: _StaticInputs, fns: tuple[Callable[[], None], ...]) -> list[torch.cuda.CUDAGraph]:
        if self.stream is None:
            self.stream = torch.cuda.Stream(static.hidden.device)
            self.pool = torch.cuda.graph_pool_handle()
        self.stream.wait_stream(torch.cuda.current_stream())
        graphs = []
        with torch.cuda.stream(self.stream):
            if not static.warmed_up:  # cuBLAS/cuDNN state for this stream; Triton already ran eagerly
                # The warm-up allocates from the regular pool on this side stream, whose cached blocks
                # only this stream reuses: release the cache before (so the warm-up reuses what the
                # eager calls freed) and after (so the graphs' pool can take that memory).
                torch.cuda.empty_cache()
                for fn in fns:
                    fn()
                torch.cuda.empty_cache()
                static.warmed_up = True
            for fn in fns:
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    fn()
                finally:
                    graph.capture_end()
                graphs.append(graph)
        torch.cuda.current_stream().wait_stream(self.stream)
        return graphs


class _GraphedLayer(torch.autograd.Function):
    """A decoder layer replayed from its graphs; saves only its input (checkpointing), or offloads it and
    its offloaded kept activations (the staging buffers its forward graph writes)."""

    @staticmethod
    def forward(ctx, graphs: _LayerGraphs, static: _StaticInputs, writers: dict, kwargs: dict, offload, index: int, hidden: torch.Tensor, *params):
        ctx.offload = offload
        if offload is None:
            ctx.save_for_backward(hidden)
        else:  # before the replay: the input's copy overlaps it, and the staging buffers' last copies are waited for
            ctx.offloaded = offload.save(hidden, index, graphs.staged)
        static.load(hidden, kwargs)
        graphs.forward.replay()
        if graphs.staged:
            offload.save_staged(ctx.offloaded)
        ctx.forward_id = next(_FORWARD_IDS)
        for entry in graphs.entries:
            writers[id(entry)] = ctx.forward_id
        ctx.graphs, ctx.static, ctx.writers, ctx.kwargs = graphs, static, writers, kwargs
        return static.out.clone()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # offloaded: the input and the staging buffers back (the compute stream waits for their copies)
        (hidden,) = ctx.saved_tensors if ctx.offload is None else (ctx.offload.load(ctx.offloaded),)
        static: _StaticInputs = ctx.static
        static.load(hidden, ctx.kwargs)
        static.grad_out.copy_(grad_out)
        if any(ctx.writers.get(id(entry)) != ctx.forward_id for entry in ctx.graphs.entries):
            # the layer ran forward again since (e.g. two forwards, then one backward; maybe for
            # another signature, whose recording shares buffers): what it keeps is another input's;
            # replay this input's forward to restore it (it writes the staging buffers too, with what
            # `load` put there)
            ctx.graphs.forward.replay()
            for entry in ctx.graphs.entries:
                ctx.writers[id(entry)] = ctx.forward_id
        ctx.graphs.backward.replay()
        grad_in = static.grad_in.clone() if ctx.needs_input_grad[6] else None
        # fresh tensors (one multi-tensor kernel): the buffers are overwritten by the next layer's replay
        graphs: _LayerGraphs = ctx.graphs
        used = [g for g, unused in zip(graphs.param_grads, graphs.unused) if not unused]
        fresh = iter(torch._foreach_mul(used, 1.0) if used else [])
        grads = [None if unused else next(fresh) for unused in graphs.unused]
        return (None, None, None, None, None, None, grad_in, *grads)


def _graphed_layer_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    original = functools.partial(type(self).forward, self)
    state: _ModelGraphs = getattr(self, _STATE_ATTR)
    if state.recording or not (self.training and torch.is_grad_enabled()):
        return original(hidden_states, *args, **kwargs)
    found = state.graphs_for(self, hidden_states, kwargs) if not args else None
    index = getattr(self, _INDEX_ATTR)
    if found is not None:
        state.replayed += 1
        graphs, static = found
        return _GraphedLayer.apply(graphs, static, state.kept_writers, kwargs, state.offload, index, hidden_states, *graphs.params)
    state.eager += 1
    if state.offload is not None and (args or _requires_grad(kwargs)):  # gradients reach only the input and the weights
        state.log_once("calls with positional arguments or keyword tensors that require grad are not offloaded")
    elif state.offload is not None:
        params = [p for p in self.parameters() if p.requires_grad]
        if hidden_states.requires_grad or params:
            return offloaded_checkpoint(functools.partial(original, **kwargs), state.offload, index, hidden_states, params)
    contexts = functools.partial(checkpoint_contexts, self)
    return checkpoint(original, hidden_states, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def keep_max_bytes(keep_max_gib: float | None) -> int | None:
    """``strategy.keep_max_gib`` in bytes (None: no cap).

    Raises:
        ValueError: not a number of GiB >= 0.
    """
    if keep_max_gib is None:
        return None
    if isinstance(keep_max_gib, bool) or not isinstance(keep_max_gib, (int, float)) or not keep_max_gib >= 0:
        raise ValueError(f"strategy.keep_max_gib={keep_max_gib!r}: expected a number of GiB >= 0, or null for no cap")
    return int(keep_max_gib * 2**30)


def check_cuda_graphs(
    gradient_checkpointing: bool,
    attention: str,
    dropout: float,
    moe_backend: str | None = None,
    output_router_logits: bool = False,
) -> None:
    """Raise where the graphs cannot replay a model set up so (from the config, or the built model).

    Args:
        gradient_checkpointing: ``model.gradient_checkpointing``.
        attention: the resolved ``model.attention`` backend (``auto``, ``cudnn``, ``varlen``, ``sdpa``, ``flex``).
        dropout: the largest dropout probability in the layers (``lora.dropout``, attention dropout).
        moe_backend: ``moe.backend`` (requested, or as resolved by ``apply_moe``), if any.
        output_router_logits: the model config's flag that collects router logits for the MoE
            load-balancing loss (through forward hooks, which a replayed layer does not run).

    Raises:
        ValueError: checkpointing off, flex attention, dropout > 0, or the
            ``native_torch`` MoE backend (it reads the expert offsets back to the host once per
            layer, which a graph cannot record), or router logits to collect, naming the key to change.
    """
    if not gradient_checkpointing:
        raise ValueError("strategy.cuda_graphs=true needs model.gradient_checkpointing=true (the graphs recompute each layer)")
    if attention not in (*VARLEN_FAMILY, "sdpa"):
        raise ValueError(f"strategy.cuda_graphs=true needs model.attention=auto, cudnn, varlen or sdpa, not {attention}")
    if dropout:
        raise ValueError(
            f"strategy.cuda_graphs=true needs lora.dropout=0 and no other dropout in the layers (found p={dropout}): "
            "the backward graph's recompute would draw a different dropout mask than the forward's"
        )
    if moe_backend == "native_torch":
        raise ValueError(
            "strategy.cuda_graphs=true cannot record moe.backend=native_torch (its expert loop reads the offsets back "
            "to the host once per layer): set moe.backend=grouped_mm or triton, or strategy.cuda_graphs=false"
        )
    if output_router_logits:
        raise ValueError(
            "strategy.cuda_graphs=true cannot collect router logits for the MoE load-balancing loss (transformers "
            "collects them with Python hooks, which replayed layers do not run): set "
            "model.config.output_router_logits=false or strategy.cuda_graphs=false"
        )


def apply_cuda_graphs(
    model: torch.nn.Module,
    max_signatures: int = 8,
    keep_attention: bool = True,
    activation_offload: bool = False,
    keep_projections: bool = True,
    keep_max_gib: float | None = None,
) -> int:
    """Run every decoder layer of ``model`` (HF or PEFT-wrapped) from CUDA graphs in training.

    Replaces gradient checkpointing for those layers (each graphed layer saves only its input and
    recomputes in its backward graph). Call after LoRA, the kernels and the MoE patch: the graphs
    record whatever the layer's forward is when they are recorded.

    Args:
        model: a transformers causal LM (or a PEFT model around one) with gradient checkpointing on
            and ``model.attention`` auto, cudnn, varlen or sdpa, no dropout.
        max_signatures: how many input signatures (shapes, packed-batch layout) get graphs.
        keep_attention: let each layer's forward graph keep attention's output and log-sum-exp for
            its backward graph, whose recompute then skips attention's forward, while they fit in the
            memory budget of `_ModelGraphs.allow_keep`.
        activation_offload: keep each layer's input (the checkpoint) in pinned host memory from its
            forward to its backward, reloaded one layer ahead on a copy stream
            (`lightning_ft.strategies.offload.ActivationOffload`; the last layer's stays on the GPU),
            for graphed and eager calls alike (eager calls with positional arguments or keyword
            tensors that require grad excepted: they are checkpointed on the device).
        keep_projections: let each layer's forward graph keep the outputs of its fused LoRA linear
            layers (those the architecture's patch table lists) and of the MoE experts' gate/up
            GEMM (``grouped_mm`` backend), with their thin LoRA products, for its backward graph,
            whose recompute then skips those GEMMs, within the same budget.
        keep_max_gib: at most this many GiB kept, all kinds together, in layer order (the layers
            after the cap recompute, as past the memory budget); None: the memory budget alone.
            For a peak below what the budget allows (a shared GPU, a memory target).

    Returns:
        The number of layers patched.

    Raises:
        ValueError: no ``GradientCheckpointingLayer`` in the model, a
            negative ``keep_max_gib``, or what `check_cuda_graphs` refuses.
    """
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no transformers decoder layers (GradientCheckpointingLayer)")
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    dropouts = [m.p for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Dropout)]
    check_cuda_graphs(
        gradient_checkpointing=all(layer.gradient_checkpointing for layer in layers),
        attention={name: backend for backend, name in ATTENTION_NAMES.items()}.get(implementation, implementation),
        dropout=max([*dropouts, getattr(config, "attention_dropout", 0.0) or 0.0]),
        output_router_logits=bool(getattr(config, "output_router_logits", False)),
    )
    revert_cuda_graphs(model)
    trainable_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    state = _ModelGraphs(
        max_signatures,
        attention={name: backend for backend, name in ATTENTION_NAMES.items()}.get(implementation, "sdpa"),
        keep_attention=keep_attention,
        optimizer_bytes=2 * trainable_bytes,
        offload=ActivationOffload(len(layers)) if activation_offload else None,
        keep_projections=keep_projections,
        keep_max_bytes=keep_max_bytes(keep_max_gib),
    )
    for index, layer in enumerate(layers):
        setattr(layer, _INDEX_ATTR, index)
        setattr(layer, _CHECKPOINTING_ATTR, layer.__dict__.get("gradient_checkpointing"))
        layer.gradient_checkpointing = False  # ours recomputes; HF's must not wrap it again
        setattr(layer, _STATE_ATTR, state)
        layer.forward = types.MethodType(_graphed_layer_forward, layer)
    logger.info("cuda graphs: %d decoder layers run from graphs in training", len(layers))
    return len(layers)


def graphed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of ``model`` that `apply_cuda_graphs` patched, in the model's order ([] where none is)."""
    return [m for m in model.modules() if hasattr(m, _STATE_ATTR)]


def apply_memory_plan(model: torch.nn.Module, plan: Plan) -> None:
    """Let ``plan`` (`lightning_ft.strategies.planner.plan`) decide, per decoder layer of a model patched by
    `apply_cuda_graphs`, what its recordings do with each kind (`lightning_ft.strategies.kept.KINDS`: ``keep``,
    ``offload`` or ``recompute``) and whether its input is offloaded (``input``: ``offload``).

    Per kind, the layers that offload it, in order, take turns between two staging sets of it (the k-th
    uses set k mod 2): their forward graphs write the set, whose tensors then go to pinned host memory
    and come back before the layer's backward, one layer ahead (`ActivationOffload`). The last layer
    offloads nothing: what the plan offloads there is kept (as its input is). The graphs recorded so far
    are dropped (with their kept buffers): every layer records again, under the plan, the next time it
    runs. The keep switches, ``keep_max_gib`` and the 90% memory check still apply on top of the plan.

    Raises:
        ValueError: ``model`` is not patched, or the plan is for another number of layers.
    """
    layers = graphed_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: apply_cuda_graphs first (the memory plan drives the graphed layers)")
    if len(plan.actions) != len(layers):
        raise ValueError(f"memory plan for {len(plan.actions)} decoder layers, the model has {len(layers)}")
    state: _ModelGraphs = getattr(layers[0], _STATE_ATTR)
    state.plan = plan
    state.staging = {}
    for kind in KINDS:
        offloading = [i for i in range(len(layers) - 1) if plan.action(i, kind) == "offload"]
        state.staging.update({(layer, kind): rank % 2 for rank, layer in enumerate(offloading)})
    staging = {layer for layer, _ in state.staging}
    offloaded = plan.layers_where("input", "offload")
    state.offload = ActivationOffload(len(layers), layers=offloaded) if offloaded or staging else None
    state.graphs.clear()
    state.kept_shared.clear()
    state.kept_writers.clear()


def cuda_graph_stats(model: torch.nn.Module) -> dict[str, Any] | None:
    """How the graphed layers of ``model`` ran in training so far (None: not patched).

    Returns:
        ``replayed_layer_calls`` and ``eager_layer_calls`` (over all layers), ``signatures`` with
        graphs, ``recordings`` (layer × signature), and per kept kind (`lightning_ft.strategies.kept.KINDS`)
        the recordings alive now that keep it (``kept_<kind>_recordings``) and the bytes of the
        buffers they keep (``kept_<kind>_bytes``; a layer's recordings share theirs, offloading layers
        their staging sets'); where anything is offloaded (``activation_offload``, a memory plan),
        `ActivationOffload.stats` (counts, bytes, and the copies' GB/s and waits' ms: None off CUDA).
    """
    for module in model.modules():
        if hasattr(module, _STATE_ATTR):
            state: _ModelGraphs = getattr(module, _STATE_ATTR)
            stats = {
                "replayed_layer_calls": state.replayed,
                "eager_layer_calls": state.eager,
                "signatures": len(state.statics),
                "recordings": state.captures,
            }
            for kind in KINDS:
                stats[f"kept_{kind}_recordings"] = sum(bool(g.kept[kind].enabled) for g in state.graphs.values())
                stats[f"kept_{kind}_bytes"] = state.kept_bytes(kind)
            return {**stats, **(state.offload.stats() if state.offload is not None else {})}
    return None


def revert_cuda_graphs(model: torch.nn.Module) -> int:
    """Undo `apply_cuda_graphs` (the graphs and their memory are freed). Returns the layers reverted."""
    reverted = 0
    for layer in model.modules():
        if hasattr(layer, _STATE_ATTR):
            del layer.forward
            restore_instance_attr(layer, "gradient_checkpointing", getattr(layer, _CHECKPOINTING_ATTR))
            for name in (_STATE_ATTR, _CHECKPOINTING_ATTR, _INDEX_ATTR):
                delattr(layer, name)
            reverted += 1
    return reverted
