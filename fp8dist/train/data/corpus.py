"""A real-text corpus: one or more files tokenized (through the token cache) into one stream of token ids. In a job of
several processes, tokenize once per node: :func:`fp8dist.train.data.job.load_on_each_node`."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...config.text import plural
from .cache import TokenFile, tokenize_file
from ..config import DEFAULT_TEXT_FIELD
from .sources import check_source, unread_text_field
from .tokenizer import load_tokenizer, tokenizer_fingerprint

__all__ = ["TokenCorpus", "load_text_corpus"]


@dataclass(frozen=True)
class TokenCorpus:
    """The files' tokens, read in the order given, as one stream (each file's documents end with the EOS id)."""

    files: tuple[TokenFile, ...]
    tokenizer_dir: str
    tokenizer_sha256: str  # tokenizer_fingerprint
    vocab_size: int  # len(tokenizer): the embedding needs at least this many rows
    eos_id: int

    @property
    def num_tokens(self) -> int:
        """Tokens of every file of the corpus together."""
        return int(sum(len(f.tokens) for f in self.files))

    @property
    def num_documents(self) -> int:
        """Documents of every file of the corpus together."""
        return sum(f.documents for f in self.files)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Token ids ``start:stop`` of the stream (across file borders), int64."""
        parts, offset = [], 0
        for f in self.files:
            n = len(f.tokens)
            lo, hi = max(start - offset, 0), min(stop - offset, n)
            if lo < hi:
                parts.append(np.asarray(f.tokens[lo:hi], dtype=np.int64))
            offset += n
            if offset >= stop:
                break
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    def fingerprint(self) -> dict[str, Any]:
        """The files' and tokenizer's hashes, stored with a data position: a resumed run checks it reads the same."""
        return {"files": [f.sha256 for f in self.files], "tokenizer": self.tokenizer_sha256}

    def describe(self) -> str:
        """One line: files, documents, tokens, and whether tokenized now or read from the token cache (and when)."""
        return (f"{plural(len(self.files), 'file')}, {plural(self.num_documents, 'document')}, "
                f"{plural(self.num_tokens, 'token')} (tokenizer {self.tokenizer_dir}, {self.vocab_size:,} ids; "
                f"{_provenance(self.files)})")


def _provenance(files: list[TokenFile]) -> str:
    fresh = sum(not f.reused for f in files)
    cached = [f.tokenized_at for f in files if f.reused]
    if not cached:
        return "tokenized now"
    known = [at for at in cached if at is not None]
    when = ""
    if known:
        newest, oldest = _ago(max(known)), _ago(min(known))
        when = f" (tokenized {newest if newest == oldest else f'{newest} to {oldest}'} ago)"
    if not fresh:
        return f"read from the token cache{when}"
    return f"{plural(fresh, 'file')} tokenized now, {len(cached)} read from the token cache{when}"


def _ago(at: float) -> str:
    seconds = max(time.time() - at, 0.0)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= 2 * size:
            return plural(int(seconds // size), unit)
    return f"{max(1, round(seconds))} s"


def load_text_corpus(paths: str | os.PathLike | Sequence[str | os.PathLike], *, tokenizer: str | os.PathLike,
                     text_field: str = DEFAULT_TEXT_FIELD, cache_dir: str | os.PathLike | None = None,
                     progress: bool | None = None) -> TokenCorpus:
    """``paths`` (plain text: a file is one document; JSON lines, ``.jsonl``/``.ndjson``/``.json``: each line's
    ``text_field``), in order, tokenized with the fast tokenizer saved in directory ``tokenizer`` or read from the
    token cache (default ``~/.cache/fp8dist/tokens``). ``progress``: bars (None: when stderr is a terminal).
    ValueError: no paths, one twice, a bad tokenizer or file; every file is checked before any is tokenized."""
    listed = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not listed:
        raise ValueError("no data files: pass one or more plain-text or JSON-lines files.")
    sources = [check_source(p) for p in listed]
    twice = sorted({str(p) for p in sources if sources.count(p) > 1})
    if twice:
        raise ValueError(f"{'data files' if len(twice) > 1 else 'a data file'} given more than once: "
                         f"{', '.join(twice)}; pass each once.")
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field={text_field!r} must name a JSON field, e.g. 'text'.")
    if (note := unread_text_field(sources, text_field)) is not None:
        warnings.warn(note, UserWarning, stacklevel=2)
    loaded = load_tokenizer(tokenizer)
    fingerprint = tokenizer_fingerprint(loaded)
    files = tuple(tokenize_file(p, loaded, fingerprint=fingerprint, text_field=text_field, cache_dir=cache_dir,
                                progress=progress) for p in sources)
    return TokenCorpus(files, str(Path(tokenizer)), fingerprint, len(loaded), loaded.eos_token_id)
