"""What ``fp8dist train`` and ``fp8dist bench`` train on: the built-in grammar (bytes, offline) or text files
tokenized once per node (:func:`load_job_corpus`, :func:`load_on_each_node`), the loss of a batch of either
(:func:`lm_loss`), and the held-out loss (:func:`evaluate`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...config.text import plural
from .builtin import Batches
from .corpus import TokenCorpus, load_text_corpus
from .windows import TextBatches

__all__ = ["MAX_DEFAULT_EVAL_BATCHES", "job_tokenizer", "load_job_corpus", "load_on_each_node", "JobBatches",
           "eval_batch_count", "eval_steps", "lm_loss", "evaluate"]

T = TypeVar("T")

MAX_DEFAULT_EVAL_BATCHES = 10
"""Held-out global batches an evaluation reads at most with no ``eval_batches``: a loss to 3 digits, bounded."""


def job_tokenizer(data: Sequence[str], tokenizer: str | None, pretrained: str | None) -> str | None:
    """The tokenizer directory of a job on ``data``: ``tokenizer``, else ``pretrained``; None without data.
    ValueError for data without a tokenizer, or a tokenizer without data."""
    if not data:
        if tokenizer is not None:
            raise ValueError(f"tokenizer={tokenizer!r} without data: pass --data FILE [FILE ...] to train on text "
                             "files, or leave --tokenizer out to train on the built-in corpus.")
        return None
    if tokenizer is None and pretrained is None:
        raise ValueError("--data needs a tokenizer: pass --tokenizer DIR (a directory a tokenizer's save_pretrained "
                         "wrote), or --pretrained DIR holding the model's own tokenizer.")
    return tokenizer if tokenizer is not None else pretrained


def load_job_corpus(train: Any, pretrained: str | None, *, progress: bool | None = None) -> TokenCorpus | None:
    """``train.data`` (a TrainConfig's, or any object with its data options) tokenized with the job's tokenizer or
    read from the token cache; None for the built-in corpus. ValueError for a bad file or tokenizer."""
    from ...config.schema import cli_flag
    from .cache import check_cache_dir

    tokenizer = job_tokenizer(train.data, train.tokenizer, pretrained)
    if tokenizer is None:
        return None
    check_cache_dir(train.data_cache, "data_cache", cli_flag("data_cache"))
    return load_text_corpus(list(train.data), tokenizer=tokenizer, text_field=train.text_field,
                            cache_dir=train.data_cache, progress=progress)


def load_on_each_node(load: Callable[[], T], local_rank: int) -> T:
    """``load()`` on local rank 0 of each node first, then, once every rank knows it worked, on the others (which
    read what it cached); a failure on any rank raises on every rank. Call on every rank, or alone."""
    from ...runtime.agree import on_all_ranks

    first = on_all_ranks("tokenizing the data", load if local_rank == 0 else None, error=ValueError,
                         passthrough=(ValueError,))
    rest = on_all_ranks("reading the token cache", load if local_rank != 0 else None, error=ValueError,
                        passthrough=(ValueError,))
    return first if local_rank == 0 else rest


class JobBatches:
    """The batches of a job: the grammar's (:class:`~fp8dist.train.data.Batches`, by step, ``seq_len`` tokens a row)
    or ``corpus``'s (:class:`TextBatches`, in order, ``seq_len + 1`` tokens a row, with a position to save).
    ValueError: the corpus is shorter than a window or a global batch, or holds out too few windows."""

    def __init__(self, corpus: TokenCorpus | None, *, batch_size: int, seq_len: int, seed: int, rank: int = 0,
                 world_size: int = 1, eval_batches: int | None = None) -> None:
        self.corpus = corpus
        self.windows = corpus is not None  # rows of seq_len + 1 tokens: see lm_loss
        args = dict(batch_size=batch_size, seq_len=seq_len, rank=rank, world_size=world_size, seed=seed)
        self.grammar = Batches(**args) if corpus is None else None
        self.text = None if corpus is None else TextBatches(corpus, **args)
        self.eval_count = 0 if corpus is None else eval_batch_count(self.text, eval_batches)

    def take(self, step: int) -> torch.Tensor:
        """This rank's batch of ``step`` (0-based); text batches are taken in order, one per call."""
        return self.grammar[step] if self.text is None else self.text.next_batch()

    def state_dict(self) -> dict[str, Any] | None:
        """The text's position; None for the grammar (its batches follow the step)."""
        return None if self.text is None else self.text.state_dict()

    def evaluate(self, model: Any, device: torch.device) -> float:
        """The mean held-out loss of ``model`` over the run's held-out batches on ``device``."""
        return evaluate(model, self.text, self.eval_count, device)

    def describe(self) -> str:
        """The corpus, windows and held-out batches for a run's header ("" for the grammar)."""
        if self.text is None:
            return ""
        return (f"data: {self.corpus.describe()}\ndata: {self.text.describe()}; each evaluation reads "
                f"{plural(self.eval_count, 'held-out batch')} of {self.text.batch_size}")


def eval_batch_count(batches: TextBatches, asked: int | None) -> int:
    """The held-out global batches one evaluation reads: ``asked``, or every full one up to
    :data:`MAX_DEFAULT_EVAL_BATCHES`. ValueError: the split holds fewer full batches than asked (or none)."""
    full = len(batches.eval_windows) // batches.batch_size
    wanted = min(full, MAX_DEFAULT_EVAL_BATCHES) if asked is None else asked
    if wanted < 1 or wanted > full:
        need = max(wanted, 1) * batches.batch_size
        fewer = f"Pass --eval-batches {full}{' or fewer' if full > 1 else ''}, or add text" if full else "Add text"
        share = 100 * batches.eval_fraction
        raise ValueError(f"{'--eval-batches ' + str(asked) if asked else 'an evaluation'} needs {need:,} held-out "
                         f"windows of {batches.window:,} tokens; the corpus's held-out {share:g}% is "
                         f"{len(batches.eval_windows):,} windows ({full} global batches of {batches.batch_size}). "
                         f"{fewer}, or lower --batch-size or --seq-len.")
    return wanted


def eval_steps(steps: int, every: int) -> list[int]:
    """The steps (from 1) after which a run evaluates: every ``every``-th (0: none) and the last."""
    marks = set(range(every, steps + 1, every)) if every > 0 else set()
    return sorted(marks | {steps})


def lm_loss(model: Any, batch: torch.Tensor, *, windows: bool) -> torch.Tensor:
    """The mean next-token cross-entropy of ``batch`` under a causal LM. ``windows`` (rows of ``seq_len + 1``): the
    model reads ``batch[:, :-1]``, the loss against ``batch[:, 1:]`` is computed here in fp32 (as transformers does),
    so no model shifts the targets twice; else transformers' ``labels=batch``, shifted inside the model."""
    if not windows:
        return model(input_ids=batch, labels=batch).loss
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: Any, batches: TextBatches, num_batches: int, device: torch.device) -> float:
    """The mean :func:`lm_loss` over the first ``num_batches`` held-out global batches and every rank, in eval mode;
    the training position does not move. Call on every rank."""
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), device=device)
        for batch in batches.eval_batches(num_batches):
            total += lm_loss(model, batch.to(device), windows=True).float()
    finally:
        model.train(was_training)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return (total / num_batches).item()

