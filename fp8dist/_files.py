"""Writing files all or nothing: results, configs, checkpoints' meta.json and ``latest``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["atomic_write", "atomic_write_text", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the entries of ``directory`` (a rename into it, a new file) durable, not only its files' contents."""
    if os.name == "nt":  # Windows cannot open a directory; its renames are durable once they return
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(target: str | os.PathLike, write: Callable[[str], None]) -> None:
    """``write(tmp_path)`` beside ``target``, sync it to disk, rename it over ``target``, sync the directory.

    Readers see the old file or the whole new one, never a half-written one, even after a power loss; a
    failed ``write`` (or sync, or rename) removes the temporary file and leaves ``target`` as it was.
    """
    target = Path(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; these are ordinary files
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


def atomic_write_text(target: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write` of ``text``."""
    atomic_write(target, lambda tmp: Path(tmp).write_text(text))
