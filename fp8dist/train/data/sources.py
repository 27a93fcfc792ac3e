"""Reading a corpus file as text to tokenize: plain UTF-8 text (the whole file one document) or JSON lines (each
line an object whose ``text`` field, or another named one, is a document). Every bad input raises ValueError naming
the file, the line or byte, and the way out."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ...config.text import listing
from ..config import DEFAULT_TEXT_FIELD

__all__ = ["FileIdentity", "file_kind", "check_source", "unread_text_field", "file_identity", "file_sha256",
           "read_pieces", "JSON_SUFFIXES", "PIECE_BYTES"]

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
"""Files read as JSON lines; any other file is read as plain text."""
PIECE_BYTES = 1 << 18
"""Plain text is tokenized in pieces of about this many bytes, cut before a line that starts with a non-space:
byte-level BPE pre-tokenizers (GPT-2's, Llama 3's) split there anyway (SentencePiece may add a word-start mark)."""
_BATCH_BYTES = 1 << 22  # text handed to the tokenizer per call (it tokenizes a batch's items in parallel)
_BATCH_ITEMS = 1024
_HEAD_BYTES = 1 << 20

Kind = Literal["text", "jsonl"]


def file_kind(path: str | os.PathLike) -> Kind:
    """"jsonl" for a JSON-lines file (by its suffix, :data:`JSON_SUFFIXES`), else "text"."""
    return "jsonl" if Path(path).suffix.lower() in JSON_SUFFIXES else "text"


def check_source(path: str | os.PathLike) -> Path:
    """``path`` as an absolute Path; ValueError unless it is a non-empty readable regular file."""
    given = str(path)
    try:
        p = Path(path).expanduser().resolve()
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"data file {given!r} does not exist: pass a plain-text or JSON-lines file "
                         f"({', '.join(JSON_SUFFIXES)}).") from None
    except (OSError, RuntimeError) as err:  # a symlink loop (RuntimeError before Python 3.13), a name too long...
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(f"data file {given!r} cannot be opened ({reason}): pass a plain-text or JSON-lines file "
                         "(resolve the link to the file it means).") from None
    if stat.S_ISDIR(mode):
        raise ValueError(f"data file {given!r} is a directory: pass its files (e.g. {path}/*.jsonl).")
    if not stat.S_ISREG(mode):
        what = next((name for test, name in _NOT_REGULAR if test(mode)), "not a regular file")
        raise ValueError(f"data file {given!r} is {what}: only regular files are read (their size and contents key "
                         "the token cache). Save the text to a file and pass that.")
    if not os.access(p, os.R_OK):
        raise ValueError(f"data file {given!r} is not readable (permissions).")
    if p.stat().st_size == 0:
        raise ValueError(f"data file {given!r} is empty: there is nothing to tokenize.")
    return p


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def unread_text_field(paths: list[Path], text_field: str) -> str | None:
    """The note for a ``text_field`` set away from its default when no file is JSON lines (no file reads it)."""
    if text_field == DEFAULT_TEXT_FIELD or any(file_kind(p) == "jsonl" for p in paths):
        return None
    names = listing([p.name for p in paths])
    return (f"text_field={text_field!r} has no effect here (read only from JSON-lines files, "
            f"{', '.join(JSON_SUFFIXES)}; the data is plain text: {names}).")


@dataclass(frozen=True)
class FileIdentity:
    """What says a file is unchanged without reading all of it."""

    size: int
    mtime_ns: int
    head_sha256: str  # of the first MiB


def file_identity(path: Path) -> FileIdentity:
    """What identifies ``path``'s contents cheaply: its size, modification time and the SHA-256 of its first MiB
    (the token cache of a prepared corpus is reused while the size and that hash match)."""
    status = path.stat()
    with open(path, "rb") as f:
        return FileIdentity(status.st_size, status.st_mtime_ns, hashlib.sha256(f.read(_HEAD_BYTES)).hexdigest())


def file_sha256(path: Path) -> str:
    """The SHA-256 of the whole file at ``path``, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def read_pieces(path: Path, kind: Kind, text_field: str, *, digest: hashlib._Hash,
                progress: Callable[[int], object]) -> Iterator[tuple[list[str], list[bool]]]:
    """Batches of ``(texts, ends)`` to tokenize in order: ``ends[i]`` says text ``i`` closes a document (an EOS
    follows). Every byte read goes into ``digest`` and its count to ``progress``. ValueError: a binary or non-UTF-8
    file, a JSON line that is not an object with a string ``text_field``, or a JSON-lines file without one."""
    pieces = _json_documents(path, text_field, digest) if kind == "jsonl" else _text_pieces(path, digest)
    texts = []
    ends = []
    size = 0
    for text, end, raw in pieces:
        progress(raw)
        texts.append(text)
        ends.append(end)
        size += len(text)
        if size >= _BATCH_BYTES or len(texts) >= _BATCH_ITEMS:
            yield texts, ends
            texts = []
            ends = []
            size = 0
    if texts:
        yield texts, ends


def _decode(path: Path, raw: bytes, offset: int) -> str:
    nul = raw.find(b"\0")
    if nul >= 0:
        raise ValueError(f"data file {str(path)!r} looks binary (a NUL byte at byte {offset + nul:,}): pass UTF-8 "
                         f"plain text or JSON lines ({', '.join(JSON_SUFFIXES)}).")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        bad = raw[err.start]
        raise ValueError(f"data file {str(path)!r} is not UTF-8 text: byte 0x{bad:02x} at byte {offset + err.start:,} "
                         "cannot be decoded. Convert it (iconv -f LATIN1 -t UTF-8 ...) or pass a text file.") from None


def _text_pieces(path: Path, digest: hashlib._Hash) -> Iterator[tuple[str, bool, int]]:
    buffer: list[bytes] = []
    size = start = 0
    with open(path, "rb") as f:
        for line in f:
            digest.update(line)
            if size >= PIECE_BYTES and not line[:1].isspace():
                raw = b"".join(buffer)
                yield _decode(path, raw, start), False, len(raw)
                buffer, start, size = [], start + size, 0
            buffer.append(line)
            size += len(line)
    raw = b"".join(buffer)
    text = _decode(path, raw, start)
    yield (text[1:] if start == 0 and text.startswith("\ufeff") else text), True, len(raw)


def _json_documents(path: Path, field: str, digest: hashlib._Hash) -> Iterator[tuple[str, bool, int]]:
    offset = documents = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            digest.update(line)
            text = _decode(path, line, offset)
            offset += len(line)
            if not text.strip():
                continue
            yield _json_text(path, number, text, field), True, len(line)
            documents += 1
    if documents == 0:
        raise ValueError(f"data file {str(path)!r} holds only blank lines: a JSON-lines file has one JSON object per "
                         f"line, e.g. {{\"{field}\": \"...\"}}.")


def _json_text(path: Path, number: int, line: str, field: str) -> str:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}). A JSON-lines file "
                         f"({', '.join(JSON_SUFFIXES)}) holds one JSON object per line, e.g. {{\"{field}\": "
                         "\"...\"}; name plain text with another suffix (.txt).") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a JSON {type(record).__name__} where an object with a {field!r} field belongs.")
    if field not in record:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        raise ValueError(f"{where}: no {field!r} field (this line's fields: {keys}). Pass text_field= (--text-field) "
                         "naming the field that holds the text.")
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {field!r} is a JSON {type(text).__name__}, not a string.")
    return text
