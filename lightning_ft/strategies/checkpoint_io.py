"""Atomic checkpoint writes: a crash while writing leaves the previous checkpoint intact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from lightning_ft.atomic import PARTIAL_SUFFIX, atomic_file


def remove_partial_checkpoints(dirs: list[Path]) -> list[Path]:
    """Delete the ``*.ckpt.tmp`` files in ``dirs``: the writes a killed process (``kill -9``, a lost
    node) left unfinished, which no later save of another step replaces (done before a resume, or a
    new run in a folder whose run was killed before its first checkpoint). Returns what was deleted."""
    partial = [p for d in dirs if d.is_dir() for p in d.glob(f"*.ckpt{PARTIAL_SUFFIX}")]
    for p in partial:
        p.unlink(missing_ok=True)
    return partial


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` that writes to ``<path>.tmp``, fsyncs it, then renames it over ``<path>``
    (`lightning_ft.atomic.atomic_file`).

    Readers see either the old file or the whole new one (Lightning's own writer streams into the
    final path). A write that fails removes its temporary file and re-raises (a full disk as an
    `OSError` naming ``path``); the previous checkpoint at ``path`` is untouched. A process killed
    mid-write leaves its temporary file: a resume, or a new run in the folder, removes it
    (`remove_partial_checkpoints`).
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        with atomic_file(path) as f:
            torch.save(checkpoint, f)
