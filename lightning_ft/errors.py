"""Exceptions whose message is the whole story: the CLI prints it without a traceback."""

from __future__ import annotations


class TrainingStopped(RuntimeError):
    """A check stopped training on purpose (a non-finite step, adapters that get no gradient).

    The message names the step or the modules, what was kept, and what to change.
    """
