"""The token cache: each corpus file tokenized once into a flat array of token ids on disk, read back memory-mapped.

Per file and tokenizer, the cache directory holds ``<key>.tokens`` (the ids, documents each followed by the EOS
id, as uint16 when the tokenizer has at most 65,536 ids, else uint32) and ``<key>.json`` (its index: the source's
size, mtime, sha256 of its first MiB and of all of it, the tokenizer's fingerprint, counts). ``key`` hashes the
file's absolute path, its kind, the JSON field and the tokenizer's fingerprint, so another tokenizer gets its own
entry and a changed file replaces its own.

Reuse: an entry is reused when the file's size, mtime and head hash equal the index's (no full read); when only
the mtime differs (a copy, a touch), the whole file is hashed and the entry reused if its sha256 is unchanged.
Both files are written to a temporary name and renamed into place, the tokens first, then the index: a reader
sees a complete entry or none, and an error or a kill while tokenizing leaves no partial file behind.
"""

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
from ...pipeline.files import atomic_write, atomic_write_text
from .sources import (DEFAULT_TEXT_FIELD, FileIdentity, check_source, file_identity, file_kind, file_sha256,
                      read_pieces)

__all__ = ["TokenFile", "tokenize_file", "default_cache_dir", "check_cache_dir", "cache_directory", "token_dtype",
           "CACHE_FORMAT"]

CACHE_FORMAT = 1
"""Version of the cache's layout; an entry of another version is rebuilt."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fp8dist/tokens`` (``~/.cache/fp8dist/tokens`` when it is unset). On several nodes, pass a
    directory every node sees, or each node tokenizes once for itself."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fp8dist" / "tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for at most 65,536 token ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass(frozen=True)
class TokenFile:
    """One corpus file's tokens, memory-mapped from the cache."""

    source: Path
    tokens: np.ndarray
    """The token ids (a read-only memmap): each document's tokens followed by the EOS id."""
    documents: int
    """Documents read (a plain-text file is one; empty JSON texts included)."""
    empty_documents: int
    """Documents whose text was empty: they add no tokens and no EOS."""
    sha256: str
    """sha256 of the source file as tokenized."""
    index: Path
    """The cache entry's index file."""
    reused: bool
    """Read from the cache (True) or tokenized now."""
    tokenized_at: float | None = None
    """When the entry was tokenized (seconds since the epoch); None for an entry older than the record."""


def tokenize_file(path: str | os.PathLike, tokenizer: Any, *, fingerprint: str, text_field: str = DEFAULT_TEXT_FIELD,
                  cache_dir: str | os.PathLike | None = None, progress: bool | None = None) -> TokenFile:
    """The tokens of ``path``: from the cache when the file and the tokenizer are unchanged, else tokenized now
    (in batches, with a progress bar on a terminal) and cached.

    Args:
        path: a plain-text or JSON-lines file (see :mod:`fp8dist.train.data.sources`).
        tokenizer: a fast tokenizer (:func:`~fp8dist.train.data.tokenizer.load_tokenizer`).
        fingerprint: its :func:`~fp8dist.train.data.tokenizer.tokenizer_fingerprint`.
        cache_dir: where entries live (default :func:`default_cache_dir`).
        progress: show a progress bar; None: when stderr is a terminal.

    Raises:
        ValueError: a bad file (missing, empty, binary, a JSON line without the field, ... with file and line),
            a file that yields no tokens, or one that changed while it was read. Nothing is left in the cache.
    """
    source = check_source(path)
    kind = file_kind(source)
    field = text_field if kind == "jsonl" else None
    key = hashlib.sha256(json.dumps([str(source), kind, field, fingerprint, CACHE_FORMAT]).encode()).hexdigest()[:24]
    with cache_directory(cache_dir) as directory:
        index_path, tokens_path = directory / f"{key}.json", directory / f"{key}.tokens"
        dtype = token_dtype(len(tokenizer))
        identity = file_identity(source)
        index = _reusable(_read_index(index_path), identity, tokens_path, dtype, source)
        reused = index is not None
        if not reused:
            index = _build(source, kind, text_field, tokenizer, tokens_path, dtype, identity, progress)
            index.update(source=str(source), kind=kind, text_field=field, tokenizer_sha256=fingerprint,
                         tokenized_at=time.time())
        if not reused or index["mtime_ns"] != identity.mtime_ns:  # reused with a new mtime: recorded for the fast check
            index.update(asdict(identity))
            atomic_write_text(index_path, json.dumps(index, indent=1) + "\n")
        tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(index["tokens"],))
        return TokenFile(source, tokens, index["documents"], index["empty_documents"], index["sha256"], index_path,
                         reused, index.get("tokenized_at"))


def check_cache_dir(cache_dir: str | os.PathLike | None, option: str = "cache_dir", flag: str | None = None) -> Path:
    """The token cache's directory (``cache_dir``, else :func:`default_cache_dir`), checked without making it: a
    directory, or missing under a writable one. ValueError naming the value as the caller calls it (``option``,
    and its command-line ``flag`` when there is one) and the way out."""
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
def cache_directory(cache_dir: str | os.PathLike | None, option: str = "cache_dir") -> Iterator[Path]:
    """The token cache's directory (:func:`check_cache_dir`), made with its missing parents for the block inside;
    when the block raises (a refused file), the folders made here are removed again where they stayed empty: a
    refused file leaves nothing behind."""
    directory = check_cache_dir(cache_dir, option)
    made = [p for p in (directory, *directory.parents) if not p.exists()]  # deepest first
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"token cache {str(directory)!r} cannot be made a directory ({err.strerror}): pass "
                         f"{option}= a writable directory.") from None
    try:
        yield directory
    except BaseException:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # not empty: another file's entry (complete) is kept, and the folders above it
                break
        raise


def _read_index(path: Path) -> dict | None:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) and index.get("format") == CACHE_FORMAT else None


def _reusable(index: dict | None, identity: FileIdentity, tokens: Path, dtype: np.dtype,
              source: Path) -> dict | None:
    """``index`` when its entry holds ``source``'s tokens as they are now, else None (rebuild)."""
    if index is None or index.get("dtype") != dtype.name or index.get("size") != identity.size:
        return None
    try:
        if tokens.stat().st_size != index["tokens"] * dtype.itemsize:
            return None
    except OSError:
        return None
    if index["head_sha256"] != identity.head_sha256:
        return None
    return index if index["mtime_ns"] == identity.mtime_ns or file_sha256(source) == index["sha256"] else None


def _build(source: Path, kind: str, text_field: str, tokenizer: Any, tokens_path: Path, dtype: np.dtype,
           identity: FileIdentity, progress: bool | None) -> dict:
    """Tokenize ``source`` into ``tokens_path`` (atomically); the index's counts and hashes."""
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
