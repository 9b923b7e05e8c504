"""Atomic checkpoint writes: a crash while writing leaves the previous checkpoint intact."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override


PARTIAL_SUFFIX = ".tmp"  # a checkpoint being written: ``<path>.tmp`` until it is renamed to ``<path>``


def remove_partial_checkpoints(dirs: list[Path]) -> list[Path]:
    """Delete the ``*.ckpt.tmp`` files in ``dirs``: the writes a killed process (``kill -9``, a lost
    node) left unfinished, which no later save of another step replaces. Returns what was deleted."""
    partial = [p for d in dirs if d.is_dir() for p in d.glob(f"*.ckpt{PARTIAL_SUFFIX}")]
    for p in partial:
        p.unlink(missing_ok=True)
    return partial


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` that writes to ``<path>.tmp`` then renames it over ``<path>``.

    `os.replace` is atomic on POSIX file systems, so readers see either the old file or the whole
    new one (Lightning's own writer streams into the final path). A write that fails removes its
    temporary file and re-raises; the previous checkpoint at ``path`` is untouched. A process killed
    mid-write leaves its temporary file: a resume removes it (`remove_partial_checkpoints`).
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + PARTIAL_SUFFIX)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
