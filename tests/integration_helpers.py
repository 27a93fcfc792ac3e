"""Shared by the Trainer and Accelerate tests: the rank's Accelerate environment, a dataset Trainer reads in the
order of fp8dist's byte batches, and fp8dist's own loop doing the arithmetic Trainer and Accelerate do."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from helpers import BATCH, SEQ
from torch import nn

import fp8dist
from fp8dist.train.data import Batches

LR = 1e-3
MAX_NORM = 1.0  # Trainer's default max_grad_norm


def accelerate_env(rank: int, world: int) -> None:
    """What a launcher sets and Accelerate reads to join the process group the harness already made."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


class ByteRows(torch.utils.data.Dataset):
    """Rows of fp8dist's global byte batches, one after the other, with an ``idx`` column the model does not take.
    Read in order (``train_sampling_strategy="sequential"``), Accelerate hands rank ``r`` the ``r``-th of each
    ``world`` per-device batches: at step ``s`` exactly the rows ``Batches(rank=r)[s]`` of fp8dist's loop."""

    def __init__(self, steps: int):
        whole = Batches(batch_size=BATCH, seq_len=SEQ, seed=0)
        self.rows = torch.cat([whole[step] for step in range(steps)])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i], "idx": i}


def own_loop_losses(model: nn.Module, rank: int, world: int, steps: int, *, tokens_over_ranks: bool) -> list[float]:
    """fp8dist's own loop on ``model`` (AdamW at ``LR``, ``fp8dist.clip_grad_norm_`` at ``MAX_NORM``), with the loss
    Trainer computes when ``tokens_over_ranks`` (the label tokens of all ranks' batches as the divisor, times the
    world size, which DDP and FSDP then average back), else the model's own mean."""
    batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        ids = batches[step]
        if tokens_over_ranks:
            tokens = (ids[:, 1:] != -100).sum()
            dist.all_reduce(tokens)
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=tokens / 1).loss * world
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        fp8dist.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses
