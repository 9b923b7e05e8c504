"""Exceptions whose message is the whole story: the CLI prints it without a traceback."""

from __future__ import annotations


class TrainingStopped(RuntimeError):
    """A check stopped training on purpose (a non-finite step, adapters that get no gradient).

    The message names the step or the modules, what was kept, and what to change.
    """


def check_local_path(key: str, value: str | None) -> None:
    """Raise FileNotFoundError naming ``key`` when ``value`` is written as a local path that does not exist.

    Hub names (``org/name``) are left to transformers; a path starting with ``.``, ``/`` or ``~``
    would otherwise reach the hub client and come back as a confusing repo-id error.
    """
    from pathlib import Path

    if value and value.startswith((".", "/", "~")) and not Path(value).expanduser().exists():
        raise FileNotFoundError(f"{key}={value!r}: no such folder (relative paths start from {Path.cwd()})")
