"""A small real-text corpus and its tokenizer, made offline in a test's directory (no Hub, no download).

    corpus = write_text_corpus(tmp_path)      # corpus.jsonl, corpus.txt, tokenizer/ (a byte-level BPE)
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from fp8dist.train.data import make_corpus, train_tokenizer

WORDS = ("café", "naïve", "über", "東京", "ß", "—")  # multi-byte UTF-8, so byte offsets differ from characters


def documents(count: int = 120, seed: int = 0) -> list[str]:
    """``count`` documents of a few grammar sentences each, some with non-ASCII words, some over several lines."""
    rng = random.Random(seed)
    sentences = make_corpus(count * 4, seed=seed).split(". ")
    docs = []
    for i in range(count):
        words = sentences[4 * i:4 * i + rng.randint(1, 4)]
        text = ". ".join(words) + f" {rng.choice(WORDS)}."
        docs.append(text.replace(" the ", "\nthe ", 1) if i % 3 == 0 else text)
    return docs


@dataclass(frozen=True)
class TextCorpus:
    jsonl: Path
    text: Path
    tokenizer: Path
    docs: list[str]


def write_text_corpus(directory: Path, *, count: int = 120, vocab_size: int = 320) -> TextCorpus:
    """``corpus.jsonl`` (one document per line in ``text``), ``corpus.txt`` (the same documents, one plain-text
    document) and ``tokenizer/`` (a byte-level BPE trained on them, saved with save_pretrained)."""
    docs = documents(count)
    jsonl, text = directory / "corpus.jsonl", directory / "corpus.txt"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    text.write_text("\n".join(docs) + "\n")
    train_tokenizer(docs, directory / "tokenizer", vocab_size=vocab_size)
    return TextCorpus(jsonl, text, directory / "tokenizer", docs)
