"""Host work of one training step, counted on the CPU: Python function calls and aten ops per step.

Short-row steps can wait on the host rather than the GPU (``python -m lightning_ft bench ...
profile=true`` reports the device-busy time per step beside the step time). Python calls and
dispatched aten ops per step are what the host spends that time on, and unlike wall time they are counted exactly and do
not depend on the machine, so a change to the hot path can be checked here before GPU time is
spent on it. The model is a tiny random one of the chosen architecture (the per-layer host work
does not depend on the hidden size) in bf16 under bf16 autocast with fp32 LoRA weights, gradient
checkpointing, one packed row, `FinetuneModule.loss_sum` + backward, as in training; only
torch-level kernel switches (no Triton: ``lora``) are compared, each on vs off.

Usage:
    python benchmarks/host_overhead.py --model llama --layers 8 --out host_overhead.json
    python benchmarks/host_overhead.py --model qwen3_moe --moe grouped_mm
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from lightning_ft.data.packing import collate_packed
from lightning_ft.model.build import ModelBuilder
from lightning_ft.model.lora import _skip_adapter_input_casts
from lightning_ft.module import FinetuneModule

CONFIGS = {
    "llama": dict(model_type="llama", intermediate_size=128),
    "qwen3_moe": dict(model_type="qwen3_moe", intermediate_size=128, moe_intermediate_size=32, num_experts=16,
                      num_experts_per_tok=4, norm_topk_prob=True),
}
TARGETS = {
    "llama": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
    "qwen3_moe": {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                  "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
}


def measure(model: str, layers: int, moe: str, kernels: dict[str, bool], timed_steps: int) -> dict:
    """Python calls, aten ops and wall ms (median; machine-dependent) of one forward + backward step."""
    torch.manual_seed(0)
    config = dict(CONFIGS[model], hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=256, tie_word_embeddings=False)
    module = FinetuneModule(ModelBuilder(
        model={"init": "random", "config": config, "gradient_checkpointing": True, "dtype": "bfloat16"},
        lora={"rank": 4, "alpha": 8, "dropout": 0.0, **TARGETS[model]},
        kernels=kernels,
        moe={"backend": moe},
    ))
    module.configure_model()
    _skip_adapter_input_casts(module.model)  # as under Lightning's bf16-mixed precision
    tokens = list(range(1, 128))
    batch = collate_packed([(tokens, tokens)])

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module.loss_sum(batch)
        loss.backward()

    for _ in range(2):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    aten_ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    seconds = []
    for _ in range(timed_steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return {"python_calls_per_step": pstats.Stats(profiler).total_calls, "aten_ops_per_step": aten_ops,
            "ms_per_step": statistics.median(seconds) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(CONFIGS), default="llama")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--moe", default="grouped_mm", help="moe.backend for qwen3_moe (hf, grouped_mm, native_torch)")
    parser.add_argument("--switches", default="lora", help="comma-separated torch-level kernel switches to compare")
    parser.add_argument("--timed-steps", type=int, default=10)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    moe = args.moe if args.model == "qwen3_moe" else "hf"
    rows = []
    for switch in args.switches.split(","):
        for on in (False, True):
            row = measure(args.model, args.layers, moe, {switch: on, "fused_linear_cross_entropy": False}, args.timed_steps)
            rows.append({"model": args.model, "layers": args.layers, "moe": moe, "switch": switch, "on": on, **row})
            print(f"{args.model} x{args.layers} {switch}={'on ' if on else 'off'}: {row['python_calls_per_step']} Python "
                  f"calls, {row['aten_ops_per_step']} aten ops, {row['ms_per_step']:.1f} ms per step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
