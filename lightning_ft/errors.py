"""Exceptions whose message is the whole story: the CLI prints it without a traceback."""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from typing import Any


class TrainingStopped(RuntimeError):
    """A check stopped training on purpose (a non-finite step, adapters that get no gradient).

    The message names the step or the modules, what was kept, and what to change.
    """


class SigtermBeforeTraining(KeyboardInterrupt):
    """SIGTERM while a run sets up (tokenizer, data, model), before its training loop: raised by the handler
    `lightning_ft.callbacks.sigterm.SigtermAtStepEnd.raise_until_training` installs. A KeyboardInterrupt, so that a
    library's ``except Exception`` does not swallow it and Lightning tears the run down as for Ctrl-C; the command
    line reports it as SIGTERM (exit status 143)."""


class Interrupted(TrainingStopped):
    """A signal stopped training: Ctrl-C (SIGINT) or a scheduler's SIGTERM (preemption, a time limit); the message
    says where and, where a checkpoint exists, how to resume.

    The command line prints it as one line and exits with status ``exit_status``, 128 + the signal's number as a
    shell reports a process the signal ended (130 for SIGINT, 143 for SIGTERM): not 0, which a scheduler would
    take for a finished job, and not 1, which reads as a failure of the run.
    """

    def __init__(self, message: str, signal_number: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.exit_status = 128 + int(signal_number)


class BenchFailed(RuntimeError):
    """``bench`` ran, but no row measured anything (each crashed, timed out or could not start): the message lists
    why and where each row's output is."""


#: what runs out-of-memory advice suggests, cheapest change first
MEMORY_HINT = (
    "lower data.max_tokens (tokens per packed row), set model.gradient_checkpointing=true, or use a smaller model "
    "or more devices (strategy=fsdp2)"
)


def exception_chain(err: BaseException | None) -> Iterator[BaseException]:
    """``err``, then the exceptions it was raised from or during (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def out_of_memory(err: BaseException) -> str | None:
    """The first line of ``err``'s message where it (or an exception it was raised from) is an allocation that failed:
    `torch.OutOfMemoryError` (CUDA), `MemoryError`, or the CPU allocator's RuntimeError; None otherwise."""
    import torch

    for cause in exception_chain(err):
        text = str(cause)
        if isinstance(cause, (torch.OutOfMemoryError, MemoryError)) or (
            isinstance(cause, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in text
        ):
            return (text.splitlines() or [type(cause).__name__])[0]
    return None


def check_choice(key: str, value: Any, choices: Sequence[str]) -> None:
    """Raise ValueError naming ``key``, ``value``, the allowed ``choices`` and the closest of them when
    ``value`` is not one of ``choices`` (a config key with a fixed set of values: ``model.attention``, ...)."""
    import difflib

    if value in choices:
        return
    close = difflib.get_close_matches(str(value), choices, n=1)
    raise ValueError(f"{key}={value}: expected one of {', '.join(choices)}" + (f"; did you mean {key}={close[0]}?" if close else ""))


def check_local_path(key: str, value: str | None) -> None:
    """Raise FileNotFoundError naming ``key`` when ``value`` is written as a local path that does not exist.

    Hub names (``org/name``) are left to transformers; a path starting with ``.``, ``/`` or ``~``
    would otherwise reach the hub client and come back as a confusing repo-id error.
    """
    from pathlib import Path

    if value and value.startswith((".", "/", "~")) and not Path(value).expanduser().exists():
        raise FileNotFoundError(f"{key}={value!r}: no such folder (relative paths start from {Path.cwd()})")


#: a Lightning logger class → (the modules it needs, any of them; how to install one)
LOGGER_PACKAGES = {
    "WandbLogger": (("wandb",), 'pip install wandb (or pip install -e ".[wandb]")'),
    "MLFlowLogger": (("mlflow",), 'pip install mlflow (or pip install -e ".[mlflow]")'),
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "pip install tensorboard"),
}


def check_logger_installed(logger: Any) -> None:
    """Raise ModuleNotFoundError naming the package and its install command when the ``logger`` config (a
    ``_target_`` node, or None) is a Lightning logger of `LOGGER_PACKAGES` whose package is not installed;
    Lightning would say so only after the data and the model have loaded.
    """
    import importlib.util

    target = str((logger or {}).get("_target_", "")) if hasattr(logger, "get") else ""
    modules, install = LOGGER_PACKAGES.get(target.rsplit(".", 1)[-1], ((), ""))
    if modules and not any(importlib.util.find_spec(m) is not None for m in modules):
        raise ModuleNotFoundError(
            f"logger: {target} needs the {modules[0]} package, which is not installed: {install}; "
            "or pick another logger (logger=csv needs nothing)"
        )
