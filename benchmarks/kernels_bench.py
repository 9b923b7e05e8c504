"""Side-by-side timings of the fused kernels: ours vs the torch eager reference vs Liger Kernel.

    python benchmarks/kernels_bench.py --out benchmarks/kernels_bench.json        # CUDA, < 3 min on an H200
    python benchmarks/kernels_bench.py --only rope --out /tmp/rope_bench.json     # one op (comma-separated list)
    python benchmarks/kernels_bench.py --only rope --profile --out /tmp/rope.json # + profiler table per step
    python benchmarks/kernels_bench.py --smoke --out /tmp/kernels_smoke.json      # CPU check, tiny shapes

For each op, forward and forward+backward are timed with `triton.testing.do_bench` (median, ms) at
training shapes in bf16:

    rms_norm       16384 tokens x 4096 hidden, trainable weight
    swiglu         16384 tokens x 14336 intermediate
    rope           Llama-3.1-8B heads (32 q, 8 kv, head_dim 128) at 8192 tokens, q/k as HF passes them:
                   transposed views of the projections' [1, T, H*D] outputs, upstream gradients laid
                   out like the outputs ([B, T, H, D] memory, as attention's backward returns them)
    linear_ce      T=16384, vocab 151936, hidden 2048, frozen head (LoRA), 10% ignored labels
    clamped_swiglu gpt-oss-20b's experts at 8K tokens: 32768 routed rows x 2x2880 interleaved gate/up, 32 experts'
                   biases read per row, the routing weight folded in
    attention_sinks gpt-oss-20b's sink correction at 8K tokens: out [8192, 64 heads, 64] bf16, fp32 lse; the
                   reference is the same math in torch ops (one autograd Function each, so both run their own
                   backward: dy·w, out·w and the sinks' gradient)

The memory-bound ops report achieved GB/s (the bytes the op must move at least, over its time) and
that as a fraction of a measured device-to-device copy; linear_ce reports TFLOP/s and the peak
memory above its inputs, vs the materialised reference. Ratios are the reference's (or Liger's)
time over ours, so > 1 means we are faster. Liger rows appear when `liger_kernel` imports.
The fwd+bwd step also writes its ones-like upstream gradient (the outputs' size), for every impl;
those bytes are not counted, so all impls' GB/s share one numerator per op and pass.

Host time. `ms` is the eager step as a training loop runs it: do_bench starts the clock after
its 256 MB L2-clearing fill (tens of us), so host work (Python, autograd, launches) that outlasts
the fill and the kernels queued before it shows up as GPU idle time inside the measurement. An
op whose fwd+bwd moves only ~0.3 GB (rope: ~0.1 ms of GPU work) can be host-bound this way. For
such ops (`Case.device_time`) the same step is also captured in a CUDA graph and replayed:
`device ms` / `device GB/s` is the GPU work alone, and eager ms minus device ms is the host
overhead, which a model pays only when the GPU has nothing else queued.
With --smoke everything runs on the CPU under TRITON_INTERPRET=1 at tiny shapes, timed with
perf_counter, to check that the script works; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass


OPS = ("rms_norm", "swiglu", "rope", "linear_ce", "clamped_swiglu", "attention_sinks")


@dataclass
class Row:
    op: str
    impl: str  # "ours" | "reference" | "liger"
    mode: str  # "fwd" | "fwd+bwd"
    shape: str
    ms: float
    gbps: float | None = None
    device_ms: float | None = None
    device_gbps: float | None = None
    copy_fraction: float | None = None
    tflops: float | None = None
    peak_mib: float | None = None
    x_vs_reference: float | None = None
    x_vs_liger: float | None = None


@dataclass
class Case:
    """One op at one shape: how to build fresh inputs and run each implementation."""

    op: str
    shape: str
    make_inputs: Callable[[], dict]
    impls: dict[str, Callable[..., object]]  # impl name -> fn(**inputs) returning a tensor or tuple
    grad_inputs: tuple[str, ...]  # inputs that require grad (for fwd+bwd)
    bytes_fwd: int | None = None
    bytes_fwd_bwd: int | None = None
    flops_fwd: float | None = None
    flops_fwd_bwd: float | None = None
    measure_memory: bool = False
    device_time: bool = False  # also time a CUDA-graph replay of the step (no host work)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _liger():
    """Liger Kernel's functional API, or None when it is not installed."""
    try:
        from liger_kernel.transformers import functional
    except ImportError:
        return None
    return functional


def _timer(smoke: bool) -> Callable[[Callable[[], object]], float]:
    if not smoke:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def cpu_median(fn):
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_median


def _first_tensor(out):
    return out[0] if isinstance(out, tuple) else out


def _fwd_bwd_fn(fn, inputs, grad_inputs):
    """A closure running fn forward and backward with a ones-like upstream gradient."""
    import torch

    def step():
        out = fn(**inputs)
        outs = out if isinstance(out, tuple) else (out,)
        outs = [o for o in outs if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        for name in grad_inputs:
            inputs[name].grad = None

    return step


def _graph_ms(step, timer, label: str) -> float | None:
    """Device time of `step` without its host work: captured once in a CUDA graph, replays timed.

    The replay runs the same kernels on the same buffers (the graph's pool), including the backward
    and the gradient resets the eager step does. None, with a warning, if the step cannot be captured.
    """
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the default stream, as capture requires
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    except RuntimeError as err:
        print(f"warning: {label}: CUDA graph capture failed ({err}); device ms left empty")
        return None
    ms = timer(graph.replay)
    del graph
    return ms


def _peak_mib(step, device) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _copy_ceiling_gbps(device, timer, numel) -> float:
    import torch

    src = torch.empty(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _cases(device, smoke: bool) -> list[Case]:
    import torch

    from lightning_ft.kernels.fp8 import quantize_weight, scaled_mm_supported
    from lightning_ft.kernels.linear_cross_entropy import fused_linear_cross_entropy, linear_cross_entropy_reference
    from lightning_ft.kernels.rms_norm import rms_norm, rms_norm_reference
    from lightning_ft.kernels.rope import apply_rope, rope_reference
    from lightning_ft.kernels.attention_sinks import sink_backward, sink_backward_reference, sink_forward, sink_forward_reference
    from lightning_ft.kernels.clamped_swiglu import clamped_swiglu, clamped_swiglu_reference
    from lightning_ft.kernels.swiglu import swiglu, swiglu_reference

    liger = _liger() if device.type == "cuda" else None
    bf16 = torch.bfloat16
    eps = 1e-6
    cases = []

    # RMSNorm: read x, write y; backward reads dy and x, writes dx (weight traffic is negligible).
    tokens, hidden = (64, 200) if smoke else (16384, 4096)
    elem = tokens * hidden * 2

    def rms_inputs():
        return {
            "x": torch.randn(tokens, hidden, device=device, dtype=bf16, requires_grad=True),
            "w": (1 + 0.1 * torch.randn(hidden, device=device)).to(bf16).requires_grad_(),
        }

    impls = {"ours": lambda x, w: rms_norm(x, w, eps), "reference": lambda x, w: rms_norm_reference(x, w, eps)}
    if liger:
        impls["liger"] = lambda x, w: liger.liger_rms_norm(x, w, eps)
    cases.append(Case("rms_norm", f"{tokens}x{hidden} bf16", rms_inputs, impls, ("x", "w"), 2 * elem, 5 * elem))

    # SwiGLU: read gate and up, write y; backward reads dy, gate, up, writes d gate, d up.
    tokens, inter = (64, 300) if smoke else (16384, 14336)
    elem = tokens * inter * 2

    def swiglu_inputs():
        return {
            "gate": torch.randn(tokens, inter, device=device, dtype=bf16, requires_grad=True),
            "up": torch.randn(tokens, inter, device=device, dtype=bf16, requires_grad=True),
        }

    impls = {"ours": swiglu, "reference": swiglu_reference}
    if liger:
        impls["liger"] = lambda gate, up: liger.liger_swiglu(gate, up)
    cases.append(Case("swiglu", f"{tokens}x{inter} bf16", swiglu_inputs, impls, ("gate", "up"), 3 * elem, 8 * elem))

    # RoPE: q/k are transposed views of the projections' [1, T, H*D] outputs, as HF passes them, and
    # the upstream gradients (ones_like of the outputs) have the outputs' [1, T, H, D] memory, as the
    # attention backward returns them. The projections are leaves here; their AccumulateGrad takes the
    # [1, T, H*D] gradient as is, as a projection's matmul backward would. Each pass reads and writes
    # q and k once (cos/sin reads are small next to them). Liger rotates the upstream gradient in
    # place; harmless here. Host-bound at this size: timed as a CUDA graph too (device ms).
    seq_len, heads_q, heads_k, head_dim = (16, 4, 2, 32) if smoke else (8192, 32, 8, 128)
    elem = seq_len * (heads_q + heads_k) * head_dim * 2
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    cos, sin = emb.cos().to(bf16), emb.sin().to(bf16)

    def rope_inputs():
        return {
            "q_proj": torch.randn(1, seq_len, heads_q * head_dim, device=device, dtype=bf16, requires_grad=True),
            "k_proj": torch.randn(1, seq_len, heads_k * head_dim, device=device, dtype=bf16, requires_grad=True),
        }

    def heads(fn):
        def run(q_proj, k_proj):
            q = q_proj.view(1, seq_len, heads_q, head_dim).transpose(1, 2)
            k = k_proj.view(1, seq_len, heads_k, head_dim).transpose(1, 2)
            return fn(q, k, cos, sin)

        return run

    impls = {"ours": heads(apply_rope), "reference": heads(rope_reference)}
    if liger:
        impls["liger"] = heads(liger.liger_rope)
    cases.append(
        Case("rope", f"T={seq_len} Hq={heads_q} Hk={heads_k} D={head_dim} bf16", rope_inputs, impls,
             ("q_proj", "k_proj"), 2 * elem, 4 * elem, device_time=True)
    )

    # Linear cross-entropy: compute bound; forward 2NHV flops (+2NHV for d hidden in ours and Liger's
    # forward), backward 2NHV for d hidden in the reference. Counted as the math needs: 2NHV fwd, 4NHV fwd+bwd.
    tokens, hidden, vocab = (32, 64, 1000) if smoke else (16384, 2048, 151936)

    def ce_inputs():
        labels = torch.randint(0, vocab, (tokens,), device=device)
        labels[torch.rand(tokens, device=device) < 0.1] = -100
        return {
            "hidden": torch.randn(tokens, hidden, device=device, dtype=bf16, requires_grad=True),
            "weight": (torch.randn(vocab, hidden, device=device) / hidden**0.5).to(bf16),
            "labels": labels,
        }

    impls = {
        "ours": lambda hidden, weight, labels: fused_linear_cross_entropy(hidden, weight, labels)[0],
        "reference": lambda hidden, weight, labels: linear_cross_entropy_reference(hidden, weight, labels)[0],
    }
    if liger:
        impls["liger"] = lambda hidden, weight, labels: liger.liger_fused_linear_cross_entropy(
            hidden, weight, labels, reduction="sum"
        )
    if device.type == "cpu" or scaled_mm_supported(device):  # the head in e4m3 (strategy.fp8_lm_head), quantised once
        e4m3_heads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def ours_e4m3(hidden, weight, labels):
            if weight.data_ptr() not in e4m3_heads:
                e4m3_heads.clear()
                e4m3_heads[weight.data_ptr()] = quantize_weight(weight)
            w_q, w_scale = e4m3_heads[weight.data_ptr()]
            return fused_linear_cross_entropy(hidden, w_q, labels, weight_scale=w_scale)[0]

        impls["ours_e4m3"] = ours_e4m3
    flops = 2.0 * tokens * hidden * vocab
    cases.append(
        Case("linear_ce", f"T={tokens} V={vocab} H={hidden} bf16 frozen head", ce_inputs, impls, ("hidden",),
             flops_fwd=flops, flops_fwd_bwd=2 * flops, measure_memory=True)
    )
    # gpt-oss's clamped SwiGLU: as swiglu (h holds gate and up, interleaved); bias and row weight are small reads.
    rows, inter, experts = (64, 300, 4) if smoke else (32768, 2880, 32)
    elem = rows * inter * 2

    def clamped_inputs():
        return {
            "h_SF": (6 * torch.randn(rows, 2 * inter, device=device)).to(bf16).requires_grad_(),
            "row_weight": torch.rand(rows, device=device, dtype=bf16),
            "bias_EF": torch.randn(experts, 2 * inter, device=device, dtype=bf16),
            "expert_S": torch.randint(0, experts, (rows,), device=device).sort().values,
        }

    impls = {name: functools.partial(fn, alpha=1.702, limit=7.0)
             for name, fn in (("ours", clamped_swiglu), ("reference", clamped_swiglu_reference))}
    cases.append(Case("clamped_swiglu", f"{rows}x2x{inter} bf16, {experts} experts' biases", clamped_inputs, impls,
                      ("h_SF",), 3 * elem, 8 * elem))

    # Attention sinks: forward reads out, writes y; backward reads dy and out, writes dy·w and out·w.
    tokens, heads_q, head_dim = (16, 4, 64) if smoke else (8192, 64, 64)
    elem = tokens * heads_q * head_dim * 2

    def sink_op(forward, backward):
        class SinkOp(torch.autograd.Function):
            @staticmethod
            def forward(ctx, out, lse, sinks):
                ctx.save_for_backward(out, lse, sinks)
                return forward(out, lse, sinks)

            @staticmethod
            def backward(ctx, grad):
                out, lse, sinks = ctx.saved_tensors
                grad_scaled, _, grad_sinks = backward(grad, out, lse, sinks)
                return grad_scaled, None, grad_sinks

        return SinkOp.apply

    def sink_inputs():
        return {
            "out": torch.randn(tokens, heads_q, head_dim, device=device, dtype=bf16, requires_grad=True),
            "lse": 3 * torch.randn(heads_q, tokens, device=device),
            "sinks": torch.randn(heads_q, device=device, dtype=bf16, requires_grad=True),
        }

    impls = {"ours": sink_op(sink_forward, sink_backward), "reference": sink_op(sink_forward_reference, sink_backward_reference)}
    cases.append(Case("attention_sinks", f"T={tokens} H={heads_q} D={head_dim} bf16", sink_inputs, impls,
                      ("out", "sinks"), 2 * elem, 6 * elem, device_time=True))
    return cases


def _print_profile(step, label: str, device) -> None:
    """The ops (and on CUDA the kernels) of 5 steps, with their host and device time: where a step's time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    with profile(activities=activities) as prof:
        for _ in range(5):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort_by = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    print(f"\n## {label} (5 steps)\n{prof.key_averages().table(sort_by=sort_by, row_limit=25)}")


def _run_case(case: Case, device, timer, copy_gbps: float, profile: bool = False) -> list[Row]:
    import torch

    rows = []
    for mode in ("fwd", "fwd+bwd"):
        by_impl = {}
        for impl, fn in case.impls.items():
            inputs = case.make_inputs()
            if mode == "fwd":
                def step(fn=fn, inputs=inputs):
                    with torch.no_grad():
                        return fn(**inputs)
            else:
                step = _fwd_bwd_fn(fn, inputs, case.grad_inputs)
            if profile:
                _print_profile(step, f"{case.op} {impl} {mode}", device)
            peak = _peak_mib(step, device) if case.measure_memory else None
            ms = timer(step)
            graphed = case.device_time and device.type == "cuda"
            device_ms = _graph_ms(step, timer, f"{case.op} {impl} {mode}") if graphed else None
            moved = case.bytes_fwd if mode == "fwd" else case.bytes_fwd_bwd
            flops = case.flops_fwd if mode == "fwd" else case.flops_fwd_bwd
            gbps = moved / ms / 1e6 if moved else None
            by_impl[impl] = Row(
                op=case.op, impl=impl, mode=mode, shape=case.shape, ms=ms, gbps=gbps,
                device_ms=device_ms, device_gbps=moved / device_ms / 1e6 if moved and device_ms else None,
                copy_fraction=gbps / copy_gbps if gbps else None,
                tflops=flops / ms / 1e9 if flops else None, peak_mib=peak,
            )
            del inputs
        ours = by_impl["ours"]
        ours.x_vs_reference = by_impl["reference"].ms / ours.ms
        if "liger" in by_impl:
            ours.x_vs_liger = by_impl["liger"].ms / ours.ms
        rows.extend(by_impl.values())
    return rows


def _fmt(value, spec):
    return "" if value is None else format(value, spec)


def _markdown(rows: list[Row], copy_gbps: float) -> str:
    lines = [
        f"copy ceiling: {copy_gbps:.0f} GB/s",
        "",
        "| op | impl | pass | shape | ms | GB/s | of copy | device ms | device GB/s | TFLOP/s | peak MiB "
        "| x vs reference | x vs Liger |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.op} | {r.impl} | {r.mode} | {r.shape} | {r.ms:.3f} | {_fmt(r.gbps, '.0f')} | "
            f"{_fmt(r.copy_fraction, '.0%')} | {_fmt(r.device_ms, '.3f')} | {_fmt(r.device_gbps, '.0f')} | "
            f"{_fmt(r.tflops, '.0f')} | {_fmt(r.peak_mib, '.0f')} | "
            f"{_fmt(r.x_vs_reference, '.2f')} | {_fmt(r.x_vs_liger, '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--record", help="also append the rows to this micro-benchmark table (benchmarks/micro.csv; not with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; on the CPU under TRITON_INTERPRET=1")
    parser.add_argument("--only", help=f"comma-separated ops to run, of: {', '.join(OPS)} (default: all)")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of each timed step")
    args = parser.parse_args(argv)
    only = OPS if args.only is None else tuple(op.strip() for op in args.only.split(","))
    if unknown := sorted(set(only) - set(OPS)):
        parser.error(f"--only: unknown op(s) {', '.join(unknown)}; choose from {', '.join(OPS)}")

    import torch

    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs CUDA (use --smoke to check the script on the CPU)")
    if args.smoke and not torch.cuda.is_available():
        # Before triton is first imported: triton.jit reads it when the kernels are defined.
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = _timer(smoke=device.type != "cuda")
    torch.manual_seed(0)

    copy_gbps = _copy_ceiling_gbps(device, timer, 2**16 if args.smoke else 2**30)
    rows = []
    for case in _cases(device, args.smoke):
        if case.op in only:
            rows.extend(_run_case(case, device, timer, copy_gbps, args.profile))

    print(_markdown(rows, copy_gbps))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "smoke": args.smoke,
        "versions": {
            "torch": torch.__version__,
            "triton": _version("triton"),
            "transformers": _version("transformers"),
            "liger_kernel": _version("liger-kernel"),
            "python": platform.python_version(),
        },
        "only": list(only),
        "copy_ceiling_gbps": copy_gbps,
        "rows": [asdict(r) for r in rows],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")
    if args.record:  # the micro-benchmarks' results table (lightning_ft/bench/table.py, MICRO)
        from lightning_ft.bench.table import MICRO, append_rows, git_commit, micro_rows

        append_rows(args.record, micro_rows("kernels", result, git_commit()), MICRO)


if __name__ == "__main__":
    main()
