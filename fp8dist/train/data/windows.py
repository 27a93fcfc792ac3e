"""Training and held-out batches from a :class:`~fp8dist.train.data.corpus.TokenCorpus`, cut into consecutive windows
of ``seq_len + 1`` tokens (torchtitan's packing: documents joined with the EOS id, attention not masked at their
borders; the last partial window dropped)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ...config.text import plural
from .builtin import check_batch_split
from .corpus import TokenCorpus

__all__ = ["TextBatches", "DEFAULT_EVAL_FRACTION", "SPLIT_SEED"]

DEFAULT_EVAL_FRACTION = 0.05
"""Share of the windows held out, as Hugging Face's run_clm example."""
SPLIT_SEED = 0
"""The held-out split's seed, fixed: every run on a corpus (any seed) evaluates the same windows."""


class TextBatches:
    """This rank's slices of shuffled global batches of windows (``batch_size`` over all ranks: the same for every
    world size), and of held-out batches. A fixed permutation puts ``eval_fraction`` of the windows aside: unlike a
    split by documents it works for one plain-text file, is exact and shares no token (a held-out window's
    neighbours may be trained on). Epoch ``e`` visits the training windows in a permutation seeded by ``(seed, e)``.
    ValueError: a bad argument, a corpus shorter than a window, or fewer training windows than a global batch."""

    def __init__(self, corpus: TokenCorpus, *, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, eval_fraction: float = DEFAULT_EVAL_FRACTION) -> None:
        check_batch_split(batch_size, world_size)
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be at least 1.")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative integer.")
        if not (isinstance(eval_fraction, (int, float)) and 0 <= eval_fraction < 1):
            raise ValueError(f"eval_fraction={eval_fraction!r} must be in [0, 1): the share of windows held out.")
        self.corpus = corpus
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.eval_fraction = float(eval_fraction)
        self.window = seq_len + 1
        count = corpus.num_tokens // self.window
        if count < 1:
            raise ValueError(f"the corpus has {corpus.num_tokens:,} tokens, fewer than one window of seq_len + 1 = "
                             f"{self.window:,}: add text or lower seq_len to {corpus.num_tokens - 1:,} or less.")
        split = np.random.default_rng(SPLIT_SEED).permutation(count)
        held = math.ceil(self.eval_fraction * count) if self.eval_fraction else 0
        self.eval_windows = split[:held]  # in the order the held-out batches take them
        self.train_windows = np.sort(split[held:])
        if len(self.train_windows) < batch_size:
            need = (batch_size + held) * self.window
            raise ValueError(f"the corpus has {corpus.num_tokens:,} tokens: {count:,} windows of {self.window:,}, "
                             f"{held:,} of them held out, leaves {len(self.train_windows):,} for training, fewer than "
                             f"a global batch of {batch_size}; that needs about {need:,} tokens. Add text, or lower "
                             "batch_size, seq_len or eval_fraction.")
        self.per_rank = batch_size // world_size
        self.rank = rank
        self.epoch, self.index = 0, 0
        self._orders: dict[int, np.ndarray] = {}

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, index)``: the next global batch starts at training window ``index`` of epoch ``epoch``."""
        return self.epoch, self.index

    def next_batch(self) -> torch.Tensor:
        """This rank's ``[batch_size / world_size, seq_len + 1]`` int64 token ids of the next global batch."""
        done = self.epoch * len(self.train_windows) + self.index
        start = done + self.rank * self.per_rank
        windows = [self._train_window(g) for g in range(start, start + self.per_rank)]
        self.epoch, self.index = divmod(done + self.batch_size, len(self.train_windows))
        return self._stack(windows)

    def eval_batches(self, num_batches: int | None = None) -> Iterator[torch.Tensor]:
        """This rank's slices of the first ``num_batches`` held-out global batches (default: every full one), the
        same on every call. ValueError: too few held-out windows."""
        full = len(self.eval_windows) // self.batch_size
        if num_batches is not None and num_batches < 1:
            raise ValueError(f"num_batches={num_batches} must be at least 1 (None: every full held-out batch).")
        wanted = full if num_batches is None else num_batches
        if full == 0 or wanted > full:
            asked = f"{plural(wanted, 'held-out batch')}" if wanted else "a held-out batch"
            raise ValueError(f"{asked} of {self.batch_size} windows need {max(wanted, 1) * self.batch_size:,} "
                             f"held-out windows; eval_fraction={self.eval_fraction:g} holds out "
                             f"{len(self.eval_windows):,} of this corpus's windows ({full} full batches). Ask for "
                             "fewer batches, or raise eval_fraction.")
        for b in range(wanted):
            start = b * self.batch_size + self.rank * self.per_rank
            yield self._stack(self.eval_windows[start:start + self.per_rank].tolist())

    def state_dict(self) -> dict[str, Any]:
        """The position and the stream it is in (JSON-serializable, for a checkpoint's ``extra``); save it after the
        step whose batch was taken last. After :meth:`load_state_dict` the batches equal an uninterrupted run's."""
        return {"epoch": self.epoch, "index": self.index, **self._stream()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the position ``state`` saved (batch and world sizes may differ). ValueError naming what
        changed when ``state`` is of another stream (files, tokenizer, seq_len, eval_fraction or seed)."""
        mine = self._stream()
        changed = [k for k in mine if state.get(k) != mine[k]]
        if changed:
            said = ", ".join("the files' contents" if k == "corpus" else f"{k} {state.get(k)!r} -> {mine[k]!r}"
                             for k in changed)
            raise ValueError(f"the saved data position belongs to another token stream ({said} changed since it was "
                             "saved), so the batches cannot continue where they stopped. Restore the data and options "
                             "of the saved run, or start without its data position.")
        if not (0 <= state["index"] < len(self.train_windows)) or state["epoch"] < 0:
            raise ValueError(f"data position (epoch {state['epoch']}, index {state['index']}) is outside this "
                             f"stream's {len(self.train_windows):,} training windows.")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])

    def describe(self) -> str:
        """How many windows train and how many are held out, in words."""
        return (f"{len(self.train_windows) + len(self.eval_windows):,} windows of {self.window:,} tokens: "
                f"{len(self.train_windows):,} for training (shuffled per epoch, seed {self.seed}), "
                f"{len(self.eval_windows):,} held out ({100 * self.eval_fraction:g}%)")

    def _stream(self) -> dict[str, Any]:
        return {"corpus": self.corpus.fingerprint(), "seq_len": self.seq_len, "eval_fraction": self.eval_fraction,
                "seed": self.seed}

    def _train_window(self, sample: int) -> int:
        epoch, i = divmod(sample, len(self.train_windows))
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # keep two epochs at most
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.train_windows))
        return int(self.train_windows[self._orders[epoch][i]])

    def _stack(self, windows: list[int]) -> torch.Tensor:
        rows = [self.corpus.tokens(w * self.window, (w + 1) * self.window) for w in windows]
        return torch.from_numpy(np.stack(rows))
