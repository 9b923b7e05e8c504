"""Command line: ``python -m lightning_ft fit [hydra overrides]`` (or the ``lightning-ft`` script).

Examples::

    python -m lightning_ft fit                                   # built-in default (tiny model, CPU)
    python -m lightning_ft fit +experiment=qwen3_moe            # Qwen3-30B-A3B shape on a GPU
    python -m lightning_ft fit data.path=train.jsonl lora.rank=8
    python -m lightning_ft fit -m lora.rank=4,8                 # a Hydra sweep
    python -m lightning_ft fit --cfg job                         # print the composed config
    python -m lightning_ft bench +bench=llama8b                 # side-by-side step benchmark (GPU)
"""

from __future__ import annotations

import sys

COMMANDS = ("fit", "bench")
_CONFIG_NAMES = {"fit": "fit", "bench": "benchmark"}
USAGE = f"usage: python -m lightning_ft {{{','.join(COMMANDS)}}} [key=value ...] [+experiment=NAME] [-m]"


def _fit_task(cfg) -> None:
    from lightning_ft.fit import fit

    fit(cfg)


def _bench_task(cfg) -> None:
    from lightning_ft.bench.runner import run_bench

    run_bench(cfg)


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``argv[0]`` (a command; ``fit`` when omitted) to its Hydra app with the other arguments."""
    import hydra

    from lightning_ft.config import config_dir, register_configs

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if argv and argv[0] in COMMANDS:
        command, overrides = argv[0], argv[1:]
    elif not argv or "=" in argv[0] or argv[0].startswith(("-", "+")):
        # no command: `fit` (this is also how Lightning relaunches the other ranks under DDP)
        command, overrides = "fit", argv
    else:
        raise SystemExit(f"unknown command {argv[0]!r}; expected one of {COMMANDS}\n{USAGE}")
    register_configs()
    sys.argv = [sys.argv[0], *overrides]
    task = {"fit": _fit_task, "bench": _bench_task}[command]
    app = hydra.main(version_base="1.3", config_path=config_dir(), config_name=_CONFIG_NAMES[command])(task)
    app()


if __name__ == "__main__":
    main()
