"""One writer per checkpoint directory: the job that trains into ``D`` holds ``D/.fp8dist.lock``, and a second job
given ``D`` is refused before it trains, naming the holder.

The lock is the operating system's (``fcntl.flock`` on that file): it ends with the process that holds it, whatever
ends the process (SIGKILL, a crash, a lost node on NFS), so a lock is never stuck behind a dead job. The holder's
PID, host and start time are written inside for the messages only. A file whose writer ended without removing it is
taken over with a note. Where the filesystem offers no ``flock`` (some network mounts), the file alone decides: held
while it names a live process on this host, or a process on another host (the message says how to take it over
once that job is gone)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from .io import CheckpointError

__all__ = ["LOCK_FILE", "CheckpointDirLocked", "LockHolder", "CheckpointDirLock", "lock_checkpoint_dir",
           "check_unlocked"]

LOCK_FILE = ".fp8dist.lock"
"""The lock file's name inside a locked checkpoint directory (it holds the holder's PID, host and start time)."""
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # the filesystem cannot flock


class CheckpointDirLocked(CheckpointError):
    """Another job holds the checkpoint directory's lock (the message names it, its PID and host, and the way out)."""


@dataclass(frozen=True)
class LockHolder:
    """Who wrote a lock file: its process, host and start time (UTC)."""

    pid: int
    """The holder's process id on ``host``."""
    host: str
    """The machine it runs on (``socket.gethostname()``)."""
    started: str
    """When it took the lock, "YYYY-MM-DD HH:MM:SS UTC"."""

    def describe(self) -> str:
        """``PID 123 on host node7 (since 2026-12-01 22:00:00 UTC)``."""
        return f"PID {self.pid} on host {self.host} (since {self.started})"

    def running(self) -> bool:
        """Whether the process is alive; a process on another host counts as running (it cannot be asked)."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return True


def _me() -> LockHolder:
    return LockHolder(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))


def _read(fd: int) -> LockHolder | None:
    """The holder written in the open lock file; None when it is empty or not ours (written by hand)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"null")
        return LockHolder(int(data["pid"]), str(data["host"]), str(data["started"]))
    except (ValueError, TypeError, KeyError, OSError):
        return None


def _refusal(file: Path, holder: LockHolder | None) -> CheckpointDirLocked:
    who = holder.describe() if holder is not None else "a process that wrote no PID"
    here = holder is not None and holder.host == socket.gethostname()
    stop = f"stop it (kill {holder.pid})" if here else \
        f"stop it; if that job is gone (its host down or unreachable), remove {file}"
    return CheckpointDirLocked(
        f"checkpoint_dir '{file.parent}' is in use by another training job: {who} holds {file}. Two jobs writing "
        f"one checkpoint directory replace each other's checkpoints. Wait for that job to end or {stop}; or pass "
        "another --checkpoint-dir.")


def _same_file(fd: int, file: Path) -> bool:
    """Whether ``file`` still names the open ``fd``: a holder removes the file as it releases the lock, so a lock
    won on a removed file guards nothing."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(file))
    except FileNotFoundError:
        return False


class CheckpointDirLock:
    """A held lock on a checkpoint directory (from :func:`lock_checkpoint_dir`); ``taken_over`` names the holder
    whose leftover file it replaced (it had ended without releasing it), else None."""

    def __init__(self, file: Path, fd: int, created_dir: bool, taken_over: LockHolder | None):
        self.file = file
        """The lock file (:data:`LOCK_FILE` in the directory)."""
        self._fd = fd
        self._created_dir = created_dir
        self.taken_over = taken_over
        """The ended job whose leftover lock file this one replaced, else None."""

    def note(self) -> str | None:
        """The one line to say when the lock was taken over from an ended job, else None."""
        if self.taken_over is None:
            return None
        return (f"checkpoint: took over {self.file}, left by {self.taken_over.describe()}, which ended without "
                "releasing it")

    def release(self) -> None:
        """Remove the lock file and let go (idempotent); the directory too when this lock created it and it stayed
        empty. Call it when the job ends, however it ends."""
        if self._fd < 0:
            return
        if _same_file(self._fd, self.file):
            self.file.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1
        if self._created_dir:
            try:
                self.file.parent.rmdir()
            except OSError:  # it holds checkpoints (or anything else): kept
                pass


def lock_checkpoint_dir(root: str | os.PathLike) -> CheckpointDirLock:
    """Take the lock of the checkpoint directory ``root`` (created if missing) for this process. Call it once per
    job, in the process that stays for the whole job (``fp8dist train``: global rank 0), before the first save;
    :meth:`CheckpointDirLock.release` when the job ends.

    Raises:
        CheckpointDirLocked: another live job holds it (the message names the file, the holder's PID, host and
            start time, and the way out).
        OSError: the lock file cannot be created or written.
    """
    root = Path(root)
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    fd, previous = _free(root / LOCK_FILE, create=True)
    me = _me()
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"pid": me.pid, "host": me.host, "started": me.started}) + "\n").encode(), 0)
    os.fsync(fd)
    return CheckpointDirLock(root / LOCK_FILE, fd, created, previous)


def check_unlocked(root: str | os.PathLike) -> None:
    """Raise :class:`CheckpointDirLocked` when a live job holds the lock of ``root``; changes nothing. For an early
    answer before the job's processes start (the job still takes the lock itself)."""
    try:
        fd, _ = _free(Path(root) / LOCK_FILE, create=False)
    except FileNotFoundError:
        return
    os.close(fd)  # a leftover file stays: the job takes it over and says so


def _free(file: Path, *, create: bool) -> tuple[int, LockHolder | None]:
    """``file`` open and locked by this process, and the holder written in it (one that ended without removing
    it); CheckpointDirLocked when a live job holds it."""
    while True:  # again when the holder removed the file between our open and our lock
        fd = os.open(file, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise _refusal(file, holder) from None
        except OSError as err:
            if err.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            previous = _read(fd)  # no OS lock on this filesystem: the holder written in the file decides
            if previous is not None and previous.running():
                os.close(fd)
                raise _refusal(file, previous) from None
            return fd, previous
        if _same_file(fd, file):
            return fd, _read(fd)
        os.close(fd)
