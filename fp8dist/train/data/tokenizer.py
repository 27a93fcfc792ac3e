"""The tokenizer of a real-text corpus: a Hugging Face fast tokenizer from a ``save_pretrained`` directory (local files
only), its fingerprint for the token cache, the check that it fits the model's embedding, and a byte-level BPE
trainer for corpora that have no tokenizer yet."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["load_tokenizer", "tokenizer_fingerprint", "check_vocab_fits", "train_tokenizer", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")
"""A directory a tokenizer's ``save_pretrained`` wrote holds one of these."""


def load_tokenizer(directory: str | os.PathLike) -> Any:
    """The fast tokenizer saved in ``directory``, read from local files only. ValueError: not a directory, no
    tokenizer files, not readable as a fast tokenizer, or no EOS token (documents are joined with it)."""
    from transformers import AutoTokenizer

    path = Path(directory)
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is a file, not a directory"
        raise ValueError(f"tokenizer {str(path)!r} {what}: pass the directory a tokenizer's save_pretrained wrote "
                         "(it holds tokenizer.json or tokenizer_config.json).")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        found = sorted(p.name for p in path.iterdir())[:8]
        raise ValueError(f"tokenizer {str(path)!r} holds no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there "
                         f"(found: {', '.join(found) or 'nothing'}). Save one with "
                         f"tokenizer.save_pretrained({str(path)!r}), or pass the directory that has it.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # whatever transformers (or tokenizers) raises reading a user's folder is about its files
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"tokenizer {str(path)!r}: transformers cannot read it as a tokenizer ({first}).") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"tokenizer {str(path)!r} loads as a slow (Python) tokenizer {type(tokenizer).__name__}: "
                         "fp8dist tokenizes with fast tokenizers only. Save its fast version (tokenizer.json) with "
                         "PreTrainedTokenizerFast / AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained.")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {str(path)!r} has no EOS token, which separates the documents: set one "
                         "(tokenizer.add_special_tokens({'eos_token': '<|endoftext|>'})) and save it again.")
    return tokenizer


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A sha256 of what tokenization depends on: the fast tokenizer's full serialization and its EOS id (a re-saved
    identical tokenizer keeps it; other files in its directory are not read)."""
    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(json.dumps({"eos_token_id": tokenizer.eos_token_id}).encode())
    return digest.hexdigest()


def check_vocab_fits(tokenizer_size: int, embedding_size: int, *, tokenizer: str = "the tokenizer",
                     model: str = "the model") -> None:
    """ValueError unless each of ``tokenizer_size`` ids (``len(tokenizer)``) has a row in an embedding of
    ``embedding_size``; call before training: an id past the embedding fails later, deep in an indexing kernel."""
    if tokenizer_size > embedding_size:
        raise ValueError(f"{tokenizer} has {tokenizer_size:,} token ids and {model}'s embedding has "
                         f"{embedding_size:,} rows, so ids {embedding_size:,}..{tokenizer_size - 1:,} have no "
                         "embedding. Pass the model's own tokenizer, or grow the model's vocabulary "
                         f"(model.resize_token_embeddings({tokenizer_size}) before saving it).")


def train_tokenizer(texts: Iterable[str], directory: str | os.PathLike, *, vocab_size: int = 8192,
                    eos_token: str = "<|endoftext|>") -> Any:
    """Train a byte-level BPE (GPT-2's scheme: any UTF-8 text round-trips) of ``vocab_size`` ids on ``texts``, with
    ``eos_token`` its one special token, save it as a fast tokenizer in ``directory`` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ...runtime.files import check_output_path

    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} must be at least 257: the 256 bytes and the EOS token.")
    check_output_path(directory, name="directory", directory=True)  # before the training, not after it
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos_token)
    tokenizer.save_pretrained(str(directory))
    return tokenizer
