"""Writing result and config files all or nothing."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

__all__ = ["atomic_write"]


def atomic_write(target: Path, write: Callable[[str], None]) -> None:
    """``write(tmp_path)`` beside ``target``, then rename it over ``target``: no half-written file is ever
    visible, and a failed write leaves nothing behind."""
    target = Path(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; these are ordinary files
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
