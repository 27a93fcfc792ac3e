"""Writing files all or nothing (results, configs, checkpoints' meta.json and ``latest``), and checking an output
path before the work whose result it will hold (:func:`check_output_path`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["atomic_write", "atomic_write_text", "fsync_dir", "check_output_path"]


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
    """``write(tmp_path)`` beside ``target``, sync it, rename it over ``target``, sync the directory: readers see the
    old file or the whole new one, even after a power loss; a failure removes the temporary file. ``write`` gets the
    temporary file's path and writes the whole content there.

    Raises:
        OSError: the write, sync or rename failed (naming ``target``, not the temporary file); whatever ``write``
            raises, as it is.
    """
    target = Path(target)
    prefix = f".{target.name}."
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=prefix, suffix=target.suffix)
        os.close(fd)
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; these are ordinary files
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and _is_temporary(err.filename, target, prefix):
            # the temporary name means nothing to the user: say the file they asked for
            raise type(err)(err.errno, f"{err.strerror} (writing {str(target)!r})", str(target)) from None
        raise
    fsync_dir(target.parent)


def _is_temporary(name: object, target: Path, prefix: str) -> bool:
    return isinstance(name, (str, os.PathLike)) and Path(name).parent == target.parent and \
        Path(name).name.startswith(prefix)


def atomic_write_text(target: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``target`` all or nothing (:func:`atomic_write`, which says what it raises)."""
    atomic_write(target, lambda tmp: Path(tmp).write_text(text))


def _given(name: str, path: str | os.PathLike) -> str:
    return f"{name} {str(path)!r}" if name.startswith("-") else f"{name}={str(path)!r}"  # a flag, or a keyword


def wrong_kind(path: str | os.PathLike, *, name: str, directory: bool) -> str | None:
    """The message when ``path`` is a directory where a file is meant or (``directory``) a file where a directory
    is meant, naming it as the user gave it (``name``: a flag or a keyword); None when it is neither."""
    out = Path(path)
    if out.is_dir() and not directory:
        return (f"{_given(name, path)} is a directory, and a file is meant: pass the path of a file (in that "
                "directory, for instance).")
    if out.exists() and not out.is_dir() and directory:
        return (f"{_given(name, path)} is a file, and a directory is meant: pass a directory (created if missing), "
                "or move the file away.")
    return None


def check_output_path(path: str | os.PathLike, *, name: str, directory: bool = False) -> Path:
    """Check, before any work, that ``path`` can be written as a file (or, with ``directory``, as a directory): not
    of the other kind, its folders exist or can be created, and the nearest existing one takes a new file (tried for
    real: permission bits do not stop root, a read-only mount does); creates nothing it leaves behind. Returns
    ``path`` as a Path; ValueError naming ``name`` (a flag like ``--json`` or a keyword like ``metrics_file``),
    ``path``, the problem and the way out."""
    out, given = Path(path), _given(name, path)
    if (mismatch := wrong_kind(path, name=name, directory=directory)) is not None:
        raise ValueError(mismatch)
    if out.is_file() and not os.access(out, os.W_OK):
        raise ValueError(f"{given} is a read-only file: make it writable, or pass another path.")
    folder = out if out.is_dir() else out.parent
    while not folder.exists() and not folder.is_symlink() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{given} cannot be created: {str(folder)!r} is not a directory. Pass a path whose "
                         "folders are directories.")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".fp8dist-write-check.")
    except OSError as err:
        raise ValueError(f"{given} cannot be written: creating a file in {str(folder)!r} failed "
                         f"({err.strerror}). Pass a path in a directory you can write to.") from None
    os.close(fd)
    os.unlink(probe)
    return out
