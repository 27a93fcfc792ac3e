"""A small, deterministic text corpus and byte-level batches for the reference training job: generated from a fixed
seed by a tiny grammar (no download, the same everywhere), with enough structure that a small model's loss falls
quickly (from ln 256 ~ 5.5 nats/byte)."""

from __future__ import annotations

import functools
import random

import torch

__all__ = ["VOCAB_SIZE", "make_corpus", "Batches", "check_batch_split", "check_fits_corpus"]

VOCAB_SIZE = 256
"""The built-in corpus's vocabulary: its tokens are bytes."""

_SUBJECTS = ["the cat", "a dog", "the old sailor", "my sister", "the tiny robot", "a quiet student", "the baker",
             "our teacher", "the red fox", "a young pilot", "the king", "the gardener"]
_VERBS = ["sees", "likes", "paints", "finds", "follows", "builds", "carries", "reads", "watches", "helps", "calls",
          "remembers"]
_OBJECTS = ["a small boat", "the green door", "an old map", "the bright moon", "a wooden box", "the long road",
            "a warm loaf", "the silver key", "a blue kite", "the quiet river", "a paper crane", "the tall tower"]
_PLACES = ["in the morning", "near the sea", "after dinner", "under the bridge", "at the market", "in the rain",
           "before sunset", "on the hill"]
_ENDINGS = [".", ".", ".", "!", "?"]


@functools.lru_cache(maxsize=4)
def make_corpus(num_sentences: int = 4000, seed: int = 1234) -> str:
    """Sentences from a small grammar, reproducible from ``seed`` (made once per process and arguments: a string)."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.5:
            words.append(rng.choice(_PLACES))
        sentence = " ".join(words)
        sentences.append(sentence[0].upper() + sentence[1:] + rng.choice(_ENDINGS))
    return " ".join(sentences)


def check_batch_split(batch_size: int, world_size: int, grad_accum: int = 1) -> None:
    """ValueError unless a global ``batch_size`` splits evenly over ``world_size`` ranks x ``grad_accum``."""
    parts = world_size * grad_accum
    if batch_size % parts != 0:
        lower = batch_size - batch_size % parts
        over = f"world size {world_size}" + (f" x grad_accum {grad_accum}" if grad_accum > 1 else "")
        raise ValueError(f"batch_size={batch_size} does not split over {over}: each rank needs the same number of "
                         f"sequences in every micro-batch. Use a multiple of {parts}, e.g. {lower or parts} or "
                         f"{lower + parts}.")


def check_fits_corpus(model_config, seq_len: int | None, source: str) -> None:
    """ValueError unless the model of ``model_config`` (from ``source``) can read the corpus: :data:`VOCAB_SIZE`
    token ids, and positions for ``seq_len`` tokens (None: not checked)."""
    if getattr(model_config, "vocab_size", VOCAB_SIZE) < VOCAB_SIZE:
        raise ValueError(f"{source} has vocab_size={model_config.vocab_size}; the built-in corpus is "
                         f"bytes (token ids up to {VOCAB_SIZE - 1}). Use a model with at least {VOCAB_SIZE} tokens.")
    positions = getattr(model_config, "max_position_embeddings", None)
    if seq_len is not None and isinstance(positions, int) and positions < seq_len:
        raise ValueError(f"{source} holds {positions} positions and seq_len={seq_len}: pass --seq-len "
                         f"{positions} or less, or a config with max_position_embeddings >= {seq_len}.")


class Batches:
    """Global batches of byte sequences (``batch_size`` over all ranks), the same for every world size; each rank
    takes its contiguous slice. Step ``s`` always yields the same global batch for ``seed``."""

    def __init__(self, *, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1, seed: int = 0) -> None:
        check_batch_split(batch_size, world_size)
        # from the bytes' buffer: a list of ~170 k Python ints took ~0.5 s of CPU per Batches
        self.data = torch.frombuffer(bytearray(make_corpus().encode("utf-8")), dtype=torch.uint8).to(torch.long)
        if seq_len + 1 > len(self.data):
            raise ValueError(f"seq_len={seq_len} is longer than the corpus ({len(self.data)} bytes).")
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.per_rank = batch_size // world_size
        self.start = rank * self.per_rank

    def __getitem__(self, step: int) -> torch.Tensor:
        """This rank's ``[per_rank, seq_len]`` token ids for ``step``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.seq_len, (self.batch_size,), generator=gen)
        mine = starts[self.start:self.start + self.per_rank]
        return torch.stack([self.data[s:s + self.seq_len] for s in mine.tolist()])
