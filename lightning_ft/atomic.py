"""Files and folders written whole or not at all: a crash (``kill -9``, a lost node) or a full disk
while writing leaves the previous version readable.

A file is written to ``<path>.tmp``, flushed and fsynced, then renamed over ``<path>``
(`os.replace` is atomic on POSIX file systems), and the folder holding it is fsynced so that the
rename survives a power loss. A folder (the exported adapter) is written to ``<path>.tmp/`` and
swapped in with two renames, the old one moved to ``<path>.old/`` in between; `recover_folder`
puts the old one back where a crash fell between the two. A write that fails removes its temporary
file or folder and re-raises; a full disk, a quota or a file-size limit (`out_of_space`) is
re-raised as an `OSError` naming ``<path>``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from lightning_ft.errors import exception_chain

PARTIAL_SUFFIX = ".tmp"  # a file or folder being written: ``<path>.tmp`` until it is renamed to ``<path>``
OLD_SUFFIX = ".old"  # the folder being replaced, between the two renames of `atomic_folder`
#: errno values of a write the disk refused for lack of room (a full disk, a quota, RLIMIT_FSIZE)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def out_of_space(err: BaseException) -> OSError | None:
    """The `OSError` of a full disk, a quota or a file-size limit (`NO_SPACE`) that ``err`` is or was raised
    from (its ``__cause__``/``__context__`` chain: ``torch.save`` wraps it in a RuntimeError); None otherwise."""
    return next((e for e in exception_chain(err) if isinstance(e, OSError) and e.errno in NO_SPACE), None)


def _umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reraise_naming(err: BaseException, path: Path) -> None:
    """Raise an `OSError` naming ``path`` when ``err`` is a lack of room (`out_of_space`); return otherwise."""
    full = out_of_space(err)
    if full is not None:
        raise OSError(full.errno, f"{os.strerror(full.errno)} (nothing of it was kept; the previous version is intact)",
                      str(path)) from err


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """Open ``<path>.tmp`` for binary writing; when the block ends without an error, fsync it and rename it
    over ``path`` (its folder created if missing, then fsynced).

    Raises:
        OSError: naming ``path``, when the disk has no room (`NO_SPACE`); the temporary file is removed.
        Anything the block or the write raises, after removing the temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        _reraise_naming(err, path)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all (`atomic_file`)."""
    with atomic_file(path) as f:
        f.write(text.encode("utf-8"))


def write_json_atomic(path: str | Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON to ``path`` whole or not at all (`atomic_file`)."""
    write_text_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")


def recover_folder(path: str | Path) -> None:
    """Undo what a crash inside `atomic_folder` left: ``<path>.old/`` without ``<path>/`` (killed between its two
    renames) is moved back; a ``<path>.tmp/`` (an unfinished write) and a ``<path>.old/`` beside a new
    ``<path>/`` are deleted."""
    path = Path(path)
    old, tmp = path.with_name(path.name + OLD_SUFFIX), path.with_name(path.name + PARTIAL_SUFFIX)
    if old.is_dir() and not path.exists():
        os.replace(old, path)
    for leftover in (tmp, old):
        if leftover.is_dir():
            shutil.rmtree(leftover)


@contextlib.contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yield an empty ``<path>.tmp/`` to write into; when the block ends without an error, fsync its files and
    put it in place of ``path`` (its files get the umask's permissions, as `open` gives them): ``path`` (if any) is renamed to ``<path>.old/``, the new folder to ``path``, and
    the old one deleted. Readers find the old or the new folder whole; a crash between the two renames leaves the
    old one as ``<path>.old/``, which `recover_folder` (run first here) moves back.

    Raises:
        OSError: naming ``path``, when the disk has no room (`NO_SPACE`); the temporary folder is removed and
            ``path`` is left as it was.
        Anything the block raises, after removing the temporary folder.
    """
    path = Path(path)
    recover_folder(path)
    tmp, old = path.with_name(path.name + PARTIAL_SUFFIX), path.with_name(path.name + OLD_SUFFIX)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        mode = 0o666 & ~_umask()  # what open() gives: safetensors writes its files 0600, unreadable to a server's user
        for file in tmp.rglob("*"):
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
                file.chmod(mode)
        _fsync_folder(tmp)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        _reraise_naming(err, path)
        raise
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_folder(path.parent)
    shutil.rmtree(old, ignore_errors=True)
