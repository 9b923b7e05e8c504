"""The 4-bit base's hot path alone: NF4 dequantisation, and a QLoRA linear against the bf16 LoRA linear.

    python benchmarks/qlora_bench.py --out qlora.json --record benchmarks/micro.csv   # CUDA, ~1 min on an H100
    python benchmarks/qlora_bench.py --smoke --out /tmp/qlora_smoke.json             # CPU check, tiny shapes

Qwen3-14B's projections (q/o 5120x5120, k/v 1024x5120, gate/up 17408x5120, down 5120x17408), bf16, LoRA r16,
NF4 with double quantisation (bitsandbytes' ``quantize_4bit``); median ms of `triton.testing.do_bench`:

    dequant       one weight to bf16: ours (`lightning_ft.kernels.nf4`, into the reused buffer) and bitsandbytes'
                  ``dequantize_4bit``; GB/s counts the bytes read (n/2 + n/64) and written (2n)
    linear        forward + backward at ``--tokens`` (2048 and 8192) of `lightning_ft.kernels.lora.lora_linear`
                  on the bf16 weight (``bf16``), `lightning_ft.kernels.qlora.qlora_linear` (``nf4``; two
                  dequantisations per step) and PEFT's ``lora.bnb.Linear4bit`` over bitsandbytes (``peft_bnb``);
                  ``× bf16`` is the bf16 time over the row's (> 1: faster than bf16); TFLOP/s counts the base's two GEMMs

With --smoke everything runs on the CPU with tiny shapes (Triton under TRITON_INTERPRET=1 if set, else the
references), to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

SHAPES = {"q_proj": (5120, 5120), "k_proj": (1024, 5120), "gate_proj": (17408, 5120), "down_proj": (5120, 17408)}
SMOKE_SHAPES = {"q_proj": (96, 64), "down_proj": (64, 160)}
RANK = 16


def _timer(device):
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)

    def cpu_ms(fn, steps=3):
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return cpu_ms


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON result")
    parser.add_argument("--tokens", default="2048,8192", help="comma-separated token counts of the linear rows")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    parser.add_argument("--record", help="also append the rows to this micro-benchmark table (benchmarks/micro.csv; not with --smoke)")
    args = parser.parse_args(argv)

    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF
    import torch
    from peft import LoraConfig, get_peft_model

    from lightning_ft.kernels.lora import lora_linear
    from lightning_ft.kernels.nf4 import Quant4bitWeight, dequantize_4bit
    from lightning_ft.kernels.qlora import qlora_linear

    device = torch.device("cpu" if args.smoke else "cuda")
    timed = _timer(device)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    token_counts = [16] if args.smoke else [int(t) for t in args.tokens.split(",")]
    dtype = torch.bfloat16
    rows = []
    for name, (n_out, n_in) in shapes.items():
        weight = torch.randn(n_out, n_in, device=device, dtype=dtype) * 0.02
        packed, state = bnbF.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        w4 = Quant4bitWeight.from_quant_state(packed, state)
        numel = n_out * n_in
        moved = numel / 2 + numel / 64 + 2 * numel
        shape = f"{n_out}x{n_in} nf4->bf16"
        for impl, fn in (("ours", lambda: dequantize_4bit(w4, dtype)), ("bitsandbytes", lambda: bnbF.dequantize_4bit(packed, state))):
            ms = timed(fn)
            rows.append({"op": "nf4_dequant", "mode": "fwd", "shape": shape, "impl": impl, "ms": ms, "gbps": moved / ms / 1e6})

        base = bnb.nn.Linear4bit(n_in, n_out, bias=False, compute_dtype=dtype, quant_type="nf4", device="meta")
        base.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=64, quant_type="nf4",
                                        module=base, bnb_quantized=True)  # fmt: skip
        base.quant_state = state
        holder = torch.nn.Module()
        holder.proj = base
        peft_layer = get_peft_model(holder, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["proj"])).base_model.model.proj
        lora_A = peft_layer.lora_A["default"].weight.data.to(dtype).requires_grad_()
        lora_B = (torch.randn(n_out, RANK, device=device, dtype=dtype) * 0.01).requires_grad_()
        scaling = 2.0
        for tokens in token_counts:
            x = torch.randn(tokens, n_in, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn(tokens, n_out, device=device, dtype=dtype)
            impls = {
                "bf16": lambda: lora_linear(x, weight, None, lora_A, lora_B, scaling),
                "nf4": lambda: qlora_linear(x, w4, None, lora_A, lora_B, scaling),
                "peft_bnb": lambda: peft_layer(x),
            }
            times = {}
            for impl, forward in impls.items():
                def step(forward=forward):
                    forward().backward(dy)
                    x.grad = lora_A.grad = lora_B.grad = None
                    for p in peft_layer.parameters():
                        p.grad = None

                with torch.autocast(device.type, dtype=dtype):
                    times[impl] = timed(step)
            flops = 4 * tokens * n_in * n_out  # the base's two GEMMs (forward, x's gradient; the LoRA ones not counted)
            for impl, ms in times.items():
                rows.append({"op": f"qlora_linear {name}", "mode": "fwd+bwd", "shape": f"T={tokens} {n_out}x{n_in} r={RANK} bf16",
                             "impl": impl, "ms": ms, "vs_bf16": times["bf16"] / ms, "tflops": flops / ms / 1e9})  # fmt: skip

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "smoke": args.smoke,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "command": " ".join(["python", "benchmarks/qlora_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "versions": {"torch": torch.__version__, "bitsandbytes": bnb.__version__}, "rows": rows,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in rows:
        extra = f"  × bf16 {r['vs_bf16']:.2f}" if "vs_bf16" in r else f"  {r['gbps']:.0f} GB/s"
        print(f"{r['op']:<24} {r['impl']:<13} {r['shape']:<34} {r['ms']:9.3f} ms{extra}")
    if args.record and not args.smoke:
        from lightning_ft.bench.table import MICRO, append_rows, git_commit, micro_rows

        append_rows(args.record, micro_rows("kernels", result, git_commit()), MICRO)


if __name__ == "__main__":
    main()
