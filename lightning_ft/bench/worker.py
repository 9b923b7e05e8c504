"""One benchmark measurement in a fresh process: ``python -m lightning_ft.bench.worker SPEC_JSON``.

Builds the system named in the spec, runs ``warmup_steps + timed_steps`` training steps on one
sequence of ``seq_len`` seeded random tokens, and prints one line ``BENCH_ROW {json}`` with the
median step time, tokens/s, MFU, peak device memory (also per phase, see `StepTimer`) and the last loss (with ``spec["profile"]``,
also the device-busy time and kernel launches per step; see `StepTimer`), and the first step's time
(compilation, which the median leaves out). An out-of-memory error is a row with ``status: OOM``,
not a crash (its message and innermost frames go to the worker's log); any other error, a peer that fails to import included, is a row with the message.
For the ``unsloth`` system Unsloth is imported before anything else (see `import_unsloth`).
"""

from __future__ import annotations

import json
import statistics
import sys
import traceback
from typing import Any

import torch

ROW_PREFIX = "BENCH_ROW "


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the spec's system and return its result row (see the module docstring)."""
    from lightning_ft.bench.flops import train_step_flops
    from lightning_ft.bench.systems import STEP_FUNCTIONS, import_unsloth

    spec = {**spec, "dtype": getattr(torch, spec["dtype"])}
    row: dict[str, Any] = {k: spec[k] for k in ("system", "model", "seq_len")}
    row["layers"] = spec["model_config"]["num_hidden_layers"]
    cuda = spec["device"].startswith("cuda")
    try:
        if spec["system"] == "unsloth":
            import_unsloth()  # first of all: before transformers is imported and CUDA initialised (see systems.py)
        torch.manual_seed(0)
        input_ids = torch.randint(0, spec["model_config"]["vocab_size"], (1, spec["seq_len"]), device=spec["device"])
        times, loss, profile = STEP_FUNCTIONS[spec["system"]](spec, input_ids, spec["warmup_steps"] + spec["timed_steps"])
    except torch.OutOfMemoryError as err:  # where it ran out, for the worker's log (the row says OOM)
        print(f"out of memory: {err}", file=sys.stderr)
        traceback.print_exc(limit=-12)
        return {**row, "status": "OOM"}
    except Exception as err:  # a peer that fails to import or run is a row that says why (on one line, for the table)
        traceback.print_exc()
        return {**row, "status": " ".join(f"error: {type(err).__name__}: {err}".split())[:300]}
    timed = times[spec["warmup_steps"] :]
    seconds = statistics.median(timed)
    flops = train_step_flops(spec["model_config"], [spec["seq_len"]], spec["gradient_checkpointing"],
                             base_trainable=not spec["lora"].get("enabled", True))
    peak_flops = spec.get("peak_flops")
    return {
        **row,
        "status": "ok",
        "ms_per_step": 1e3 * seconds,
        "ms_min": 1e3 * min(timed),
        "ms_max": 1e3 * max(timed),
        "ms_first_step": 1e3 * times[0],  # not in the median: compiles, autotunes, warms the allocator
        "tokens_per_s": spec["seq_len"] / seconds,
        "tflops_per_s": flops / seconds / 1e12,
        "mfu": flops / seconds / peak_flops if peak_flops else None,
        **profile,
        # the step timer's peaks so far, or the allocator's since its last reset (`StepTimer`)
        **({"peak_mem_gib": None} if not cuda else {
            key: max(profile.get(key, 0.0), now / 2**30)
            for key, now in (("peak_mem_gib", torch.cuda.max_memory_allocated()), ("peak_reserved_gib", torch.cuda.max_memory_reserved()))
        }),
        "loss_last": loss,
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    print(ROW_PREFIX + json.dumps(measure(spec)), flush=True)


if __name__ == "__main__":
    main()
