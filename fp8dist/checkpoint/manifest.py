"""Every file of a checkpoint with its size and CRC-32, recorded in meta.json at save and checked at load, the ranks
sharing the reading. CRC-32 finds damage (a forged file is refused by what it may unpickle); here it ran 1.8-2.8x
faster than sha256 and blake2b, 0.5-1.9 CPU s/GB (benchmarks/checkpoint/results.md). Loading checks every file
unless the caller says ``verify=False``: a meta.json that records fewer checksums than files, or a file it does not
list, is refused, so editing a checkpoint cannot switch the check off."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

from ..config.text import listing
from .io import CheckpointError, all_ranks_values, inside

__all__ = ["CHECKSUM", "file_checksum", "record_files", "check_names", "verify_files"]

CHECKSUM = "crc32"
"""meta.json's ``checksum``: the algorithm of the per-file checksums :func:`verify_files` checks."""
_MAPS = ("files", "checksums")  # meta.json's maps by file name: sizes, checksums
_CHUNK = 16 * 2**20


def file_checksum(path: Path) -> str:
    """CRC-32 of the file's bytes, as 8 hex digits."""
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """This rank's files: the largest first, each to the rank with the fewest bytes so far (the same on every rank)."""
    loads, mine = [0] * world, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = loads.index(min(loads))
        loads[least] += sizes[name]
        if least == rank:
            mine.append(name)
    return mine


def _files(directory: Path) -> dict[str, int]:
    return {p.relative_to(directory).as_posix(): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file()}


def record_files(directory: Path, rank: int, world: int) -> tuple[dict[str, int], dict[str, str]]:
    """(sizes, checksums) of every file under ``directory``, this rank syncing and summing its share. Call it on
    every rank once all have written."""
    sizes = _files(directory)
    mine = {}
    for name in _share(sizes, rank, world):
        with open(directory / name, "rb") as f:
            os.fsync(f.fileno())
        mine[name] = file_checksum(directory / name)
    checksums = {name: crc for part in all_ranks_values(mine) for name, crc in part.items()}
    return sizes, dict(sorted(checksums.items()))


def check_names(path: Path, meta: dict[str, Any]) -> None:
    """CheckpointError naming the entry unless every name of meta.json's ``files`` and ``checksums`` maps is a file
    inside the checkpoint ``path`` (:func:`~fp8dist.checkpoint.io.inside`). Call it before any of them is opened or
    stat'ed, whether or not the files are verified."""
    if not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path / 'meta.json'} has no 'files' map (each file's size), which every fp8dist "
                              "checkpoint records: it is damaged or was edited by hand. Load another checkpoint.")
    for key in _MAPS:
        names = meta.get(key)
        for name in names if isinstance(names, dict) else ():
            inside(path, name, f"meta.json's {key!r} entry")


def _on_disk(directory: Path) -> list[str]:
    """Every name under ``directory`` but its folders, symbolic links not followed (nothing they lead to is
    stat'ed)."""
    names, folders = [], [directory]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(Path(entry.path))
                else:
                    names.append(Path(entry.path).relative_to(directory).as_posix())
    return sorted(names)


def _unchecked(path: Path, meta: dict[str, Any]) -> str | None:
    """Why the checksums of meta.json cannot vouch for every file of the checkpoint; None when they can."""
    checksums, files = meta.get("checksums"), meta["files"]
    if not isinstance(checksums, dict) or not checksums:
        return "records no checksums"
    missing, extra = [n for n in files if n not in checksums], [n for n in checksums if n not in files]
    unlisted = [n for n in _on_disk(path) if n not in files and n != "meta.json"]
    reasons = ((missing, "records no checksum for {}"), (extra, "records checksums of {}, which it does not list"),
               (unlisted, "does not list {}, which the folder holds"))
    return next((what.format(listing([repr(n) for n in names])) for names, what in reasons if names), None)


def verify_files(path: Path, meta: dict[str, Any], rank: int, world: int) -> None:
    """Check this rank's share of the files against meta.json's checksums, after :func:`check_names`.

    Raises:
        CheckpointError: naming the first file that differs; or, before reading any, when meta.json records no
            checksums, misses one for a file it lists, or does not list a file the folder holds (the way out:
            ``verify=False``, loading it unchecked knowingly).
    """
    unchecked = _unchecked(path, meta)
    if unchecked is not None:
        raise CheckpointError(
            f"{path / 'meta.json'} {unchecked}: the checkpoint cannot be checked for damage, and fp8dist loads none "
            "unchecked unless told. It was saved by an fp8dist that recorded none, or edited by hand. Load another "
            "checkpoint (its step_* folders), or load_checkpoint(..., verify=False) to load it unchecked knowingly.")
    checksums = meta["checksums"]
    if meta.get("checksum") != CHECKSUM:
        raise CheckpointError(f"{path / 'meta.json'} records {meta.get('checksum')!r} checksums; this fp8dist "
                              f"computes {CHECKSUM!r}. Upgrade fp8dist, or load with verify=False.")
    for name in _share({n: meta["files"][n] for n in checksums}, rank, world):
        actual = file_checksum(path / name)
        if actual != checksums[name]:
            raise CheckpointError(
                f"{path / name} is damaged: its {CHECKSUM} is {actual}, {checksums[name]} when it was saved (its "
                f"size is unchanged). Load an older checkpoint: another step_* folder of {path.parent} (fp8dist "
                f"train --resume: move {path.name} out of {path.parent} first), or load_checkpoint(..., "
                "verify=False) to load it as it is.")
