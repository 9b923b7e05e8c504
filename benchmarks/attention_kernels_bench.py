"""Packed attention kernels alone: each backend against cuDNN run per document, on long and mixed rows.

    python benchmarks/attention_kernels_bench.py --out attention_kernels.json --record benchmarks/micro.csv  # CUDA, ~2 min on an H200
    python benchmarks/attention_kernels_bench.py --smoke --out /tmp/attention_kernels_smoke.json          # CPU check, tiny shapes

One forward + backward of attention over one packed row, Llama-3.1-8B's heads (32 query / 8
key-value heads of 128), bf16, causal, q/k/v laid out as transformers passes them; median of
``--steps`` after ``--warmup``, each between CUDA events. Providers:

    cudnn_alone   each document through SDPA with only its cuDNN backend, one call each: the rate the
                  issue's targets are stated against (the ``×`` column: its time over the row's)
    auto, cudnn, varlen, flex   `lightning_ft.model.attention` as the model runs it (auto measures its
                  crossover first, outside the timing)

TFLOP/s counts the causal half of each document's score matrix: forward 4·(L²/2)·Hq·D, backward 2.5×
forward. Layouts: single documents of 8K to 64K tokens, rows of equal long documents, a long
document among short ones, and an 8K row of GSM8K-length documents (where flash-attention 2 wins).
With --smoke everything runs on the CPU with tiny shapes and the sdpa backend alone, to check the
script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def layouts(smoke: bool) -> dict[str, list[int]]:
    if smoke:
        return {"1x96": [96], "mixed": [40, 3, 17, 1]}
    rng = random.Random(0)
    return {
        "1x8K": [8192], "1x16K": [16384], "1x32K": [32768], "1x64K": [65536],
        "4x16K": [16384] * 4, "2x32K": [32768] * 2, "30K+20K+15K": [30000, 20000, 15536],
        "40K+70 short": [40000] + [rng.randint(100, 600) for _ in range(70)],
        "8K of 150-400": [rng.randint(150, 400) for _ in range(28)],
    }


def flops(lengths: list[int]) -> float:
    return sum(4 * n * n / 2 * HEADS * HEAD_DIM for n in lengths) * 3.5


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--record", help="also append the rows to this micro-benchmark table (benchmarks/micro.csv; not with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to check the script")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_ft.data.packing import collate_packed
    from lightning_ft.model import attention
    from lightning_ft.model.attention_plan import cuda_ms

    device = torch.device("cpu" if args.smoke else "cuda")
    providers = ["sdpa"] if args.smoke else ["cudnn_alone", "auto", "cudnn", "varlen", "flex"]

    def cudnn_alone(q, k, v, batch, scale, window):
        bounds = batch.cu_seqlens.tolist()
        outs = []
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for a, b in zip(bounds[:-1], bounds[1:]):
                outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True))
        return torch.cat(outs, dim=2).transpose(1, 2)

    attend = {
        "cudnn_alone": cudnn_alone, "sdpa": attention.sdpa_attention, "flex": attention.flex_attention,
        **{p: functools.partial(attention.varlen_attention, policy=p) for p in attention.VARLEN_FAMILY},
    }  # fmt: skip

    def timed(step) -> float:
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            if device.type == "cuda":
                times.append(cuda_ms(step))
            else:
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    heads = (4, 2, 16) if args.smoke else (HEADS, KV_HEADS, HEAD_DIM)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows = []
    for name, lengths in layouts(args.smoke).items():
        T = sum(lengths)
        batch = collate_packed([([0] * n, [0] * n) for n in lengths]).to(device, non_blocking=True)
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(1, T, h, heads[2], generator=g, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
                   for h in (heads[0], heads[1], heads[1]))
        grad = torch.randn(1, T, heads[0], heads[2], generator=g, device=device, dtype=dtype)
        for provider in providers:
            def step():
                q.grad = k.grad = v.grad = None
                attend[provider](q, k, v, batch, None, None).backward(grad)

            try:
                ms = timed(step)
            except (RuntimeError, ValueError) as err:  # out of memory, a kernel that does not take the shape
                rows.append({"layout": name, "tokens": T, "docs": len(lengths), "provider": provider, "skipped": repr(err)[:200]})
                continue
            rows.append({"layout": name, "tokens": T, "docs": len(lengths), "provider": provider, "ms": round(ms, 3),
                         "tflops": round(flops(lengths) / ms / 1e9, 1)})
            print(json.dumps(rows[-1]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    from lightning_ft.model import attention_plan

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": args.smoke, "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "command": " ".join(["python", "benchmarks/attention_kernels_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "versions": {"torch": torch.__version__}, "heads": heads, "auto_cudnn_from_tokens": attention_plan.min_crossover(),
        "rows": rows,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.record and not args.smoke:
        from lightning_ft.bench.table import MICRO, append_rows, git_commit, micro_rows

        append_rows(args.record, micro_rows("attention_kernels", result, git_commit()), MICRO)


if __name__ == "__main__":
    main()
