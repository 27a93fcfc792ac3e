"""The token cache: each corpus file tokenized once into a flat array of token ids on disk, read back memory-mapped.
An entry (``<key>.tokens`` and its index ``<key>.json``) is keyed by the file's path, kind, JSON field and the
tokenizer's fingerprint, and written atomically (tokens, then index): a reader sees a complete entry or none."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...config.text import plural
from ...runtime.files import atomic_write, atomic_write_text
from ..config import DEFAULT_TEXT_FIELD
from .sources import FileIdentity, check_source, file_identity, file_kind, file_sha256, read_pieces

__all__ = ["TokenFile", "tokenize_file", "default_cache_dir", "check_cache_dir", "cache_directory", "CACHE_FORMAT"]

CACHE_FORMAT = 1
"""The token cache's layout version: an entry of another version is rebuilt."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fp8dist/tokens`` (default ``~/.cache``). On several nodes, pass a directory every node sees,
    or each node tokenizes for itself."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fp8dist" / "tokens"


@dataclass(frozen=True)
class TokenFile:
    """One corpus file's tokens, memory-mapped from the cache."""

    source: Path
    tokens: np.ndarray  # read-only memmap: each document's tokens followed by the EOS id
    documents: int  # a plain-text file is one; empty JSON texts included
    empty_documents: int  # empty texts add no tokens and no EOS
    sha256: str  # of the source file as tokenized
    reused: bool  # read from the cache, or tokenized now
    tokenized_at: float | None = None  # seconds since the epoch; None for an entry older than the record


def tokenize_file(path: str | os.PathLike, tokenizer: Any, *, fingerprint: str, text_field: str = DEFAULT_TEXT_FIELD,
                  cache_dir: str | os.PathLike | None = None, progress: bool | None = None) -> TokenFile:
    """The tokens of ``path`` from the cache when the file and tokenizer (``fingerprint``) are unchanged, else
    tokenized now and cached. An entry is reused when the file's size, mtime and head hash match its index; when
    only the mtime differs, when the whole file's sha256 does. ``progress``: a bar (None: when stderr is a terminal).
    ValueError: a bad file, one that yields no tokens or changed while read; nothing is then left in the cache."""
    source = check_source(path)
    kind = file_kind(source)
    field = text_field if kind == "jsonl" else None
    key = hashlib.sha256(json.dumps([str(source), kind, field, fingerprint, CACHE_FORMAT]).encode()).hexdigest()[:24]
    with cache_directory(cache_dir) as directory:
        index_path, tokens_path = directory / f"{key}.json", directory / f"{key}.tokens"
        dtype = np.dtype(np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32)
        identity = file_identity(source)
        index = _reusable(index_path, identity, tokens_path, dtype, source)
        reused = index is not None
        if not reused:
            index = _build(source, kind, text_field, tokenizer, tokens_path, dtype, identity, progress)
            index.update(source=str(source), kind=kind, text_field=field, tokenizer_sha256=fingerprint,
                         tokenized_at=time.time())
        if not reused or index["mtime_ns"] != identity.mtime_ns:  # reused with a new mtime: recorded for the fast check
            index.update(asdict(identity))
            atomic_write_text(index_path, json.dumps(index, indent=1) + "\n")
        tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(index["tokens"],))
        return TokenFile(source, tokens, index["documents"], index["empty_documents"], index["sha256"], reused,
                         index.get("tokenized_at"))


def check_cache_dir(cache_dir: str | os.PathLike | None, option: str = "cache_dir", flag: str | None = None) -> Path:
    """The token cache's directory (``cache_dir``, else :func:`default_cache_dir`), checked without making it: a
    directory, or missing under a writable one. ValueError naming it as ``option`` (and ``flag``) and the way out."""
    directory = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if cache_dir is None:
        given, way_out = f"the token cache {str(directory)!r}", f"set XDG_CACHE_HOME or pass {flag or option + '='}"
    else:
        given = f"{option}={str(cache_dir)!r}" + (f" ({flag})" if flag else "")
        way_out = (f"pass {flag or option + '='} a directory (made if missing), or leave it out (the default "
                   f"{default_cache_dir()})")
    existing = next(p for p in (directory, *directory.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        what = "is a file" if existing == directory else f"is under {str(existing)!r}, a file"
        raise ValueError(f"{given} {what}, not a directory: {way_out}.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{given}: {str(existing)!r} is not writable (permissions): {way_out}.")
    return directory


@contextlib.contextmanager
def cache_directory(cache_dir: str | os.PathLike | None) -> Iterator[Path]:
    """The token cache's directory, made for the block inside; the folders made here are removed again where they
    stayed empty when the block raises: a refused file leaves nothing behind."""
    directory = check_cache_dir(cache_dir)
    made = [p for p in (directory, *directory.parents) if not p.exists()]  # deepest first
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"token cache {str(directory)!r} cannot be made a directory ({err.strerror}): pass "
                         "cache_dir= a writable directory.") from None
    try:
        yield directory
    except BaseException:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # not empty: another file's entry (complete) is kept, and the folders above it
                break
        raise


def _reusable(index_path: Path, identity: FileIdentity, tokens: Path, dtype: np.dtype, source: Path) -> dict | None:
    """The entry's index when it holds ``source``'s tokens as they are now, else None (rebuild)."""
    try:
        index = json.loads(index_path.read_text())
        size = tokens.stat().st_size
    except (OSError, ValueError):
        return None
    if (not isinstance(index, dict) or index.get("format") != CACHE_FORMAT or index.get("dtype") != dtype.name
            or index.get("size") != identity.size or index.get("head_sha256") != identity.head_sha256
            or size != index["tokens"] * dtype.itemsize):
        return None
    return index if index["mtime_ns"] == identity.mtime_ns or file_sha256(source) == index["sha256"] else None


def _build(source: Path, kind: str, text_field: str, tokenizer: Any, tokens_path: Path, dtype: np.dtype,
           identity: FileIdentity, progress: bool | None) -> dict:
    from tokenizers import Tokenizer
    from tqdm.auto import tqdm

    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()  # a saved tokenizer.json may truncate or pad: documents are taken whole
    backend.no_padding()
    eos = np.array([tokenizer.eos_token_id], dtype=dtype)
    digest = hashlib.sha256()
    counts = {"tokens": 0, "documents": 0, "empty_documents": 0}
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=identity.size, unit="B", unit_scale=True, desc=f"tokenizing {source.name}", disable=not show,
               file=sys.stderr)

    def write(tmp: str) -> None:
        in_document = 0  # tokens of the document being read (a plain-text file comes in several pieces)
        with open(tmp, "wb") as out:
            for texts, ends in read_pieces(source, kind, text_field, digest=digest, progress=bar.update):
                for encoding, end in zip(backend.encode_batch_fast(texts, add_special_tokens=False), ends):
                    out.write(np.asarray(encoding.ids, dtype=dtype).tobytes())
                    in_document += len(encoding.ids)
                    if end:
                        counts["documents"] += 1
                        counts["empty_documents"] += in_document == 0
                        if in_document:
                            out.write(eos.tobytes())
                            counts["tokens"] += in_document + 1
                        in_document = 0
        if counts["tokens"] == 0:
            documents = plural(counts["documents"], "document")
            raise ValueError(f"data file {str(source)!r} yields no tokens: its {documents} "
                             f"{'is' if counts['documents'] == 1 else 'are'} empty.")
        now = file_identity(source)
        if (now.size, now.mtime_ns) != (identity.size, identity.mtime_ns):
            raise ValueError(f"data file {str(source)!r} changed while it was tokenized: run again once it is "
                             "written.")

    try:
        atomic_write(tokens_path, write)
    finally:
        bar.close()
    return {"format": CACHE_FORMAT, **asdict(identity), "sha256": digest.hexdigest(), "dtype": dtype.name, **counts,
            "eos_id": tokenizer.eos_token_id}
