"""Packed attention on the GPU: metadata cached once per batch vs rebuilt in every layer, and packed vs padded.

    python benchmarks/attention_bench.py --out benchmarks/attention_bench.json      # CUDA, < 3 min on an H200
    python benchmarks/attention_bench.py --smoke --out /tmp/attention_smoke.json   # CPU check, tiny shapes

Every row times one forward+backward step (no optimizer step) of a LoRA model built by
`FinetuneModule` (random init, bf16, PEFT LoRA r16 on q/k/v/o/gate/up/down), with
`FinetuneModule.loss_sum` as the loss; the median over timed steps after warm-up, each step between
two ``torch.cuda.synchronize()``. Shapes:

    qwen3_0_6b     Qwen3-0.6B: 28 layers, hidden 1024, 16 heads / 8 kv heads of 128, vocab 151936
    llama3_2_1b    Llama-3.2-1B with 16 layers: hidden 2048, 32 heads / 8 kv heads of 64, ffn 8192, vocab 128256

on one packed row of 2048 and of 8192 tokens, filled with whole documents in data order. Document
lengths are GSM8K's (question + answer, tokenized with the project's builtin tokenizer) when
``--data`` names a GSM8K-style jsonl file (``question``, ``answer``), else drawn uniformly from 100..400.

(a) cache: each backend with its attention metadata built once per batch (the cache is cleared once
    before each step, as a new batch would have it) vs rebuilt in every layer (cleared before each
    decoder layer); ``saving`` = 1 - cached / rebuilt step time.
(b) padding: the same documents as a padded batch (one row per document, right-padded to the
    longest) through transformers' stock SDPA attention with an ``attention_mask``, vs the packed
    row with ``model.attention=auto``; ``tokens/s`` counts real tokens only, ``padding`` is the padded
    fraction of the padded batch; ``packed x`` = padded time / packed time.

With ``--cuda-graphs`` every module is built with gradient checkpointing and ``strategy.cuda_graphs``
(both the packed and the padded rows: the padded batch's layers are graphed too, with its attention
mask as a graph input), and each row reports the share of its layer calls replayed from graphs.

flex compiles on its first step (included in warm-up); rows that would not finish within
``--budget-s`` seconds of the start are skipped and listed as such. With --smoke everything runs on the CPU
with tiny shapes and the sdpa backend, timed with perf_counter, to check that the script works; its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

LORA = {
    "rank": 16, "alpha": 32.0, "dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}  # fmt: skip
SHAPES = {
    "qwen3_0_6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
    ),
    "llama3_2_1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    ),
}  # fmt: skip
SMOKE_SHAPES = {
    "tiny_qwen3": dict(
        model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    ),
}  # fmt: skip
Docs = list[tuple[list[int], list[int]]]  # (input_ids, labels) per document
FLEX_COMPILE_S = 75  # headroom a first flex step needs (compile of forward and backward)
ROW_S = 12  # headroom any other row needs


@dataclass
class Row:
    section: str  # "cache" | "padding"
    model: str
    tokens: int  # real tokens in the step
    docs: int
    backend: str  # attention backend; "hf_sdpa_padded" for the padded batch
    variant: str  # "cached" | "rebuilt" | "packed" | "padded"
    ms: float | None = None  # median step time; None when skipped
    tokens_per_s: float | None = None
    peak_gib: float | None = None
    padded_tokens: int | None = None
    skipped: str | None = None
    replayed_share: float | None = None  # with --cuda-graphs: share of the row's layer calls (warm-up and timed) replayed


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def document_lengths(data: Path, smoke: bool, seed: int = 0) -> tuple[list[int], str]:
    """Token counts of documents in data order (GSM8K through the builtin tokenizer), or sampled."""
    rng = random.Random(seed)
    if smoke:
        return [rng.randint(10, 60) for _ in range(200)], "sampled 10..60 (smoke)"
    if not data.is_file():
        return [rng.randint(100, 400) for _ in range(400)], "sampled uniformly from 100..400"
    from lightning_ft.data.tokenization import load_tokenizer

    tokenizer = load_tokenizer("builtin")
    rows = [json.loads(line) for line in data.read_text().splitlines()[:400]]
    texts = [row["question"] + "\n" + row["answer"] for row in rows]
    return [len(ids) for ids in tokenizer(texts)["input_ids"]], f"{data.name}, builtin tokenizer"


def fill_row(lengths: list[int], budget: int) -> list[int]:
    """Whole documents in data order that fit a row of ``budget`` tokens (a document that does not fit is skipped)."""
    row: list[int] = []
    for n in lengths:
        if sum(row) + n <= budget:
            row.append(n)
        if budget - sum(row) < min(lengths):
            break
    return row


def _timer(device, warmup: int, steps: int) -> Callable[[Callable[[], None]], tuple[float, float | None]]:
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def run(step):
        for _ in range(warmup):
            step()
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            sync()
            times.append((time.perf_counter() - start) * 1e3)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        return statistics.median(times), peak

    return run


def _build(shape: dict, device, dtype: str, cuda_graphs: bool):
    """A `FinetuneModule` with random weights of ``shape`` and LoRA, on ``device``, in training mode
    (with ``cuda_graphs``: gradient checkpointing and every decoder layer replayed from CUDA graphs)."""
    import torch

    from lightning_ft.model.build import ModelBuilder
    from lightning_ft.module import FinetuneModule
    from lightning_ft.strategies.strategy import Execution

    torch.manual_seed(0)
    model = {"init": "random", "config": dict(shape), "dtype": dtype, "attention": "sdpa", "gradient_checkpointing": cuda_graphs}
    module = FinetuneModule(ModelBuilder(model=model, lora=LORA, execution=Execution(cuda_graphs=cuda_graphs)))
    with device:
        module.configure_model()
    module.model.train()
    return module


def _packed_step(module, docs: Docs, device, rebuilt: bool) -> tuple[Callable[[], None], list]:
    """One forward+backward of the packed row, and the hooks to remove afterwards.

    Note: the batch cache (``PackedBatch._cache``) is cleared before each step, as a new batch would
    start, and with ``rebuilt`` also before each decoder layer, as if there were no cache.
    """
    from lightning_ft.data.packing import collate_packed

    batch = collate_packed(docs).to(device, non_blocking=True)
    hf = module.hf_model
    layers = getattr(hf, hf.base_model_prefix).layers
    hooks = [layer.register_forward_pre_hook(lambda *_: batch._cache.clear()) for layer in layers] if rebuilt else []

    def step():
        batch._cache.clear()
        module.loss_sum(batch).backward()
        module.model.zero_grad(set_to_none=True)

    return step, hooks


def _padded_step(module, docs: Docs, device) -> Callable[[], None]:
    """One forward+backward of the documents as right-padded rows through stock HF SDPA with an attention mask."""
    import torch
    import torch.nn.functional as F

    longest = max(len(ids) for ids, _ in docs)
    input_ids = torch.zeros(len(docs), longest, dtype=torch.long)
    labels = torch.full((len(docs), longest), -100, dtype=torch.long)
    attention_mask = torch.zeros(len(docs), longest, dtype=torch.long)
    for i, (ids, _) in enumerate(docs):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, 1 : len(ids)] = torch.tensor(ids[1:])
        attention_mask[i, : len(ids)] = 1
    input_ids, labels, attention_mask = (t.to(device) for t in (input_ids, labels, attention_mask))

    def step():
        logits = module.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        targets = labels[:, 1:].flatten()
        F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets, ignore_index=-100, reduction="sum").backward()
        module.model.zero_grad(set_to_none=True)

    return step


def run(args, device, auto: str) -> tuple[list[Row], str]:
    """Time every row of sections (a) and (b) (rows past ``args.budget_s`` are skipped); also says
    where the document lengths came from."""
    import torch

    from lightning_ft.model import attention

    start = time.perf_counter()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    token_budgets = (128, 256) if args.smoke else (2048, 8192)
    backends = ["sdpa"] if args.smoke else args.backends.split(",")
    timer = _timer(device, args.warmup, args.steps)
    lengths, source = document_lengths(Path(args.data), args.smoke)
    print(f"documents: {source}", file=sys.stderr)
    rng = random.Random(1)
    rows: list[Row] = []
    flex_compiled: set[str] = set()

    def timed(row: Row, step: Callable[[], None]) -> Row:
        need = FLEX_COMPILE_S if row.backend == "flex" and row.model not in flex_compiled else ROW_S
        left = args.budget_s - (time.perf_counter() - start)
        if args.smoke or left >= need:
            calls = _graph_calls(modules[row.model])
            row.ms, row.peak_gib = timer(step)
            if calls is not None:  # the share over warm-up and timed steps; recording happens in warm-up
                replayed, eager = (after - before for after, before in zip(_graph_calls(modules[row.model]), calls))
                row.replayed_share = replayed / max(1, replayed + eager)
            row.tokens_per_s = row.tokens / row.ms * 1e3
            if row.backend == "flex":
                flex_compiled.add(row.model)
        else:
            row.skipped = f"over --budget-s: {left:.0f} s left, needs ~{need} s"
        print(row.section, row.model, row.tokens, row.backend, row.variant, row.ms or row.skipped, file=sys.stderr)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return row

    modules = {name: _build(shape, device, args.dtype, args.cuda_graphs) for name, shape in shapes.items()}
    batches = {budget: fill_row(lengths[rng.randrange(len(lengths) // 2) :], budget) for budget in token_budgets}
    docs = {
        (name, budget): [(ids, ids) for ids in ([rng.randrange(shape["vocab_size"]) for _ in range(n)] for n in sizes)]
        for name, shape in shapes.items() for budget, sizes in batches.items()
    }  # fmt: skip
    # flex last: its first step compiles, so the other rows come first within the budget
    plan = [(name, b) for b in sorted(backends, key=lambda b: b == "flex") for name in shapes]
    for name, backend in plan:
        module = modules[name]
        module.hf_model.set_attn_implementation(attention.register_packed_attention(backend))
        for budget in token_budgets:
            row_docs, tokens = docs[name, budget], sum(batches[budget])
            for variant in ("cached", "rebuilt"):
                step, hooks = _packed_step(module, row_docs, device, rebuilt=variant == "rebuilt")
                rows.append(timed(Row("cache", name, tokens, len(row_docs), backend, variant), step))
                for hook in hooks:
                    hook.remove()
        if backend == auto:
            module.hf_model.set_attn_implementation("sdpa")
            for budget in token_budgets:
                row_docs, tokens = docs[name, budget], sum(batches[budget])
                row = Row("padding", name, tokens, len(row_docs), "hf_sdpa_padded", "padded")
                row.padded_tokens = len(row_docs) * max(batches[budget])
                rows.append(timed(row, _padded_step(module, row_docs, device)))
    return rows, source


def _graph_calls(module) -> tuple[int, int] | None:
    from lightning_ft.strategies.cuda_graphs import cuda_graph_stats

    stats = cuda_graph_stats(module.model)
    return None if stats is None else (stats["replayed_layer_calls"], stats["eager_layer_calls"])


def _table(rows: list[Row], auto: str) -> str:
    """Markdown tables of sections (a) and (b)."""
    by_key = {(r.section, r.model, r.tokens, r.backend, r.variant): r for r in rows}
    fmt = lambda x, spec: "skipped" if x is None else format(x, spec)  # noqa: E731
    lines = [
        "(a) attention metadata cached once per batch vs rebuilt in every layer (forward+backward ms/step)",
        "",
        "| model | tokens | docs | backend | cached ms | rebuilt ms | saving |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if r.section == "cache" and r.variant == "cached":
            rebuilt = by_key[("cache", r.model, r.tokens, r.backend, "rebuilt")]
            saving = 1 - r.ms / rebuilt.ms if r.ms and rebuilt.ms else None
            lines.append(
                f"| {r.model} | {r.tokens} | {r.docs} | {r.backend} | {fmt(r.ms, '.1f')} | {fmt(rebuilt.ms, '.1f')} "
                f"| {fmt(saving, '.1%')} |"
            )
    lines += [
        "",
        f"(b) packed ({auto}) vs padded (one row per document, stock HF SDPA + attention_mask), same tokens",
        "",
        "| model | tokens | docs | padding | padded ms | packed ms | padded tok/s | packed tok/s | packed x |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.section == "padding":
            packed = by_key.get(("cache", r.model, r.tokens, auto, "cached"))
            padding = 1 - r.tokens / r.padded_tokens if r.padded_tokens else None
            ratio = r.ms / packed.ms if r.ms and packed and packed.ms else None
            lines.append(
                f"| {r.model} | {r.tokens} | {r.docs} | {fmt(padding, '.1%')} | {fmt(r.ms, '.1f')} "
                f"| {fmt(packed.ms if packed else None, '.1f')} | {fmt(r.tokens_per_s, ',.0f')} "
                f"| {fmt(packed.tokens_per_s if packed else None, ',.0f')} | {fmt(ratio, '.2f')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--record", help="also append the rows to this micro-benchmark table (benchmarks/micro.csv; not with --smoke)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, to check the script")
    parser.add_argument("--data", default="", help="GSM8K-style jsonl for document lengths (default: sampled 100..400)")
    parser.add_argument(
        "--backends", help="comma-separated packed attention backends (default varlen,sdpa,flex; varlen,sdpa with --cuda-graphs)"
    )
    parser.add_argument("--warmup", type=int, help="untimed steps per row (default 2; 1 with --smoke)")
    parser.add_argument("--steps", type=int, help="timed steps per row, median (default 5; 2 with --smoke)")
    parser.add_argument("--budget-s", type=float, default=165.0, help="skip rows that would end later than this")
    parser.add_argument(
        "--cuda-graphs", action="store_true",
        help="gradient checkpointing + strategy.cuda_graphs=true for every row (packed and padded); varlen/sdpa only",
    )  # fmt: skip
    args = parser.parse_args(argv)

    import torch

    from lightning_ft.model import attention

    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs CUDA (or --smoke for the CPU check)")
    args.backends = args.backends or ("varlen,sdpa" if args.cuda_graphs else "varlen,sdpa,flex")
    if args.cuda_graphs and (args.smoke or "flex" in args.backends.split(",")):
        parser.error("--cuda-graphs needs CUDA and --backends of varlen and/or sdpa (graphs do not replay flex)")
    device = torch.device("cpu" if args.smoke else "cuda")
    args.dtype = "float32" if args.smoke else "bfloat16"
    args.warmup = args.warmup if args.warmup is not None else 1 if args.smoke else 2
    args.steps = args.steps if args.steps is not None else 2 if args.smoke else 5
    auto = attention.resolve_attention_backend("auto", device, getattr(torch, args.dtype))[0]
    rows, documents = run(args, device, auto)
    table = _table(rows, auto)
    print(table)
    result = {
        "command": " ".join(["python", "benchmarks/attention_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {d: _version(d) for d in ("torch", "transformers", "peft", "lightning")},
        "smoke": args.smoke,
        "documents": documents,
        "auto_backend": auto,
        "rows": [asdict(r) for r in rows],
        "table": table,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    if args.record:  # the micro-benchmarks' results table (lightning_ft/bench/table.py, MICRO)
        from lightning_ft.bench.table import MICRO, append_rows, git_commit, micro_rows

        append_rows(args.record, micro_rows("attention", result, git_commit()), MICRO)


if __name__ == "__main__":
    main()
