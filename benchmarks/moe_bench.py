"""One Qwen3-MoE sparse block, bf16, LoRA on the experts: stock HF + PEFT against our backends.

Rows, per token count (default 1K/4K/8K/32K tokens on the Qwen3-30B-A3B layer shape: hidden 2048,
expert intermediate 768, 128 experts, top-8, LoRA r16 alpha 32 on ``gate_up_proj`` and
``down_proj``):

* ``hf_peft``: transformers' ``grouped_mm`` experts implementation with PEFT ``target_parameters``
  LoRA (PEFT adds the materialised B·A to every expert weight each forward);
* ``native_torch``, ``grouped_mm``, ``triton``: `lightning_ft.model.moe.apply_moe` on the same
  block (split LoRA on PEFT's own tensors);
* ``triton_fp8``: ``triton`` on a copy of the block whose frozen experts are in e4m3
  (`lightning_ft.model.moe.convert_experts_to_fp8`, what ``strategy.fp8=true`` does; Hopper on CUDA);
* ``routing_sort`` / ``routing_where``: routing alone (top-k, then dispatch to expert order and the
  weighted combine back, no expert math) with our stable sort + searchsorted offsets against the
  per-expert ``torch.where`` loop of transformers' eager MoE blocks.

Each row has forward and forward+backward time (``triton.testing.do_bench`` median; on the CPU a
plain median of a few runs) and the peak memory a forward+backward adds on top of the weights.
Prints a markdown table and writes JSON to ``--out``.

Usage:
    python benchmarks/moe_bench.py --out benchmarks/moe_bench.json          # CUDA, < 3 min on H200
    python benchmarks/moe_bench.py --smoke --out /tmp/moe_smoke.json         # tiny shapes, CPU
    python benchmarks/moe_bench.py --tokens 65536 --out moe_64k.json          # other token counts
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time

SHAPE = {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8}
SMOKE_SHAPE = {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
TOKENS = [1024, 4096, 8192, 32768]
SMOKE_TOKENS = [64, 128]
LORA_RANK, LORA_ALPHA = 16, 32


def _build_block(shape: dict, device, dtype):
    """A Qwen3MoeSparseMoeBlock with random weights and PEFT LoRA (non-zero B) on its experts."""
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(**shape, norm_topk_prob=True, experts_implementation="grouped_mm")
    torch.manual_seed(0)
    with torch.device(device):
        block = Qwen3MoeSparseMoeBlock(config).to(dtype).requires_grad_(False)
    std = config.initializer_range
    for param in block.parameters():
        torch.nn.init.normal_(param, std=std)
    lora = LoraConfig(
        r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=[],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    block = inject_adapter_in_model(lora, block)
    for name, param in block.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=std)
    return block


def _timer(device: str):
    """``time_ms(fn) -> median ms``: do_bench on CUDA, a plain median on the CPU."""
    if device == "cuda":
        import triton.testing

        return lambda fn, grad_to_none: triton.testing.do_bench(
            fn, warmup=10, rep=40, grad_to_none=grad_to_none, return_mode="median"
        )

    def time_ms(fn, grad_to_none):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return time_ms


def _peak_mib(fn, device: str) -> float | None:
    import torch

    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _routing_fns(num_experts: int, top_k: int):
    """Routing alone: (our sort + searchsorted dispatch, transformers' eager per-expert where loop)."""
    import torch

    from lightning_ft.kernels.moe import permute_tokens, sort_by_expert, topk_routing, unpermute_tokens

    def routing_sort(x, logits):
        weight, idx = topk_routing(logits, top_k, True)
        routing = sort_by_expert(idx, num_experts)
        x_sorted = permute_tokens(x, routing)
        weight_S = weight.reshape(-1).index_select(0, routing.pair_idx_S)
        return unpermute_tokens(x_sorted * weight_S[:, None], routing)

    def routing_where(x, logits):
        weight, idx = topk_routing(logits, top_k, True)
        out = torch.zeros_like(x)
        expert_mask = torch.nn.functional.one_hot(idx, num_experts).permute(2, 1, 0)  # [E, K, T]
        for expert in range(num_experts):
            k_pos, token = torch.where(expert_mask[expert])
            out = out.index_add(0, token, x[token] * weight[token, k_pos, None])
        return out

    return {"routing_sort": routing_sort, "routing_where": routing_where}


def run(smoke: bool, token_counts: list[int] | None = None) -> dict:
    """Time every row at each token count (default: `TOKENS`, or `SMOKE_TOKENS` with ``smoke``)."""
    import peft
    import torch
    import transformers
    import triton

    from lightning_ft.model.moe import apply_moe, convert_experts_to_fp8, revert_moe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not smoke and device != "cuda":
        raise SystemExit("moe_bench needs CUDA for the full shape; use --smoke on the CPU")
    shape = SMOKE_SHAPE if smoke else SHAPE
    token_counts = token_counts or (SMOKE_TOKENS if smoke else TOKENS)
    dtype = torch.bfloat16
    time_ms = _timer(device)
    block = _build_block(shape, device, dtype)
    block_fp8 = copy.deepcopy(block)
    apply_moe(block_fp8, "triton")
    convert_experts_to_fp8(block_fp8)
    backends = ["native_torch", "grouped_mm", "triton"]
    rows = []
    started = time.perf_counter()
    for tokens in token_counts:
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(1, tokens, shape["hidden_size"], device=device, dtype=dtype, generator=gen)
        x.requires_grad_(True)
        grad = torch.randn_like(x)
        for impl in ["hf_peft", *backends, "triton_fp8"]:
            target = block_fp8 if impl == "triton_fp8" else block
            if impl in backends:
                apply_moe(block, impl)
            fwd = lambda: target(x)  # noqa: E731
            fwd_bwd = lambda: target(x).backward(grad)  # noqa: E731
            fwd_bwd()  # probe, autotune, compile
            rows.append({
                "tokens": tokens,
                "impl": impl,
                "fwd_ms": time_ms(fwd, None),
                "fwd_bwd_ms": time_ms(fwd_bwd, [x, *(p for p in target.parameters() if p.requires_grad)]),
                "peak_mib": _peak_mib(fwd_bwd, device),
            })
            if impl in backends:
                revert_moe(block)
            print(f"  {tokens:>6} tokens {impl:<14} done at {time.perf_counter() - started:6.1f} s", flush=True)
        logits = torch.randn(tokens, shape["num_experts"], device=device, dtype=dtype, generator=gen)
        x2d = x.detach().view(tokens, -1).requires_grad_(True)
        grad2d = grad.view(tokens, -1)
        for impl, fn in _routing_fns(shape["num_experts"], shape["num_experts_per_tok"]).items():
            fn(x2d, logits).backward(grad2d)
            rows.append({
                "tokens": tokens,
                "impl": impl,
                "fwd_ms": time_ms(lambda: fn(x2d, logits), None),
                "fwd_bwd_ms": time_ms(lambda: fn(x2d, logits).backward(grad2d), [x2d]),
                "peak_mib": _peak_mib(lambda: fn(x2d, logits).backward(grad2d), device),
            })
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__,
        },
        "dtype": "bfloat16",
        "shape": shape | {"lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA},
        "smoke": smoke,
        "rows": rows,
    }


def markdown(results: dict) -> str:
    """The results as a markdown table, with the speed-up of each row over ``hf_peft``."""
    hf = {r["tokens"]: r for r in results["rows"] if r["impl"] == "hf_peft"}
    lines = [
        f"MoE block, {results['device']}, {results['dtype']}, {results['shape']}, {results['versions']}",
        "",
        "| tokens | impl | fwd ms | fwd+bwd ms | fwd+bwd speed-up vs hf_peft | peak MiB |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        ratio = hf[r["tokens"]]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
        speedup = "" if r["impl"].startswith("routing") else f"{ratio:.2f}x"
        peak = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(
            f"| {r['tokens']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {speedup} | {peak} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--record", help="also append the rows to this micro-benchmark table (benchmarks/micro.csv; not with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU")
    parser.add_argument("--tokens", type=lambda v: [int(t) for t in v.split(",")], help="e.g. 4096,65536")
    args = parser.parse_args()
    if args.smoke:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton
    results = run(args.smoke, args.tokens)
    print(markdown(results))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    if args.record:  # the micro-benchmarks' results table (lightning_ft/bench/table.py, MICRO)
        from lightning_ft.bench.table import MICRO, append_rows, git_commit, micro_rows

        append_rows(args.record, micro_rows("moe", results, git_commit()), MICRO)


if __name__ == "__main__":
    main()
