"""What ``fp8dist train`` checks around its loop: that the job fits in memory, that a checkpoint directory is not
silently reused, and that a diverged run stops with a clear message instead of printing NaN to the end."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config.text import byte_size as _gib, plural

__all__ = ["MAX_NONFINITE_STEPS", "TrainingDiverged", "LossWatch", "MemoryNeed", "job_memory_need", "check_memory",
           "check_positions", "check_checkpoint_dir"]

MAX_NONFINITE_STEPS = 5
"""Consecutive steps of non-finite loss after which the job stops: with the non-finite guard a transient overflow
recovers in a step or two, so 5 in a row means it is not recovering; without it, 5 NaN steps cost little."""


class TrainingDiverged(RuntimeError):
    """The loss was not finite for :data:`MAX_NONFINITE_STEPS` consecutive steps."""


class LossWatch:
    """Counts consecutive steps whose loss (the same on every rank: the mean over ranks) is not finite."""

    def __init__(self, lr: float, resumable: bool):
        self.lr = lr
        self.resumable = resumable
        self.run = 0

    def update(self, step: int, loss: float) -> None:
        """Call after each step (0-based ``step``); raises :class:`TrainingDiverged` at the limit."""
        self.run = 0 if math.isfinite(loss) else self.run + 1
        if self.run < MAX_NONFINITE_STEPS:
            return
        resume = " and --resume from the last checkpoint" if self.resumable else ""
        raise TrainingDiverged(f"loss non-finite ({loss}) for {MAX_NONFINITE_STEPS} consecutive steps (steps "
                               f"{step + 2 - MAX_NONFINITE_STEPS}-{step + 1}): training diverged. Lower --lr (now "
                               f"{self.lr:g}){resume}, or clip gradients (--gradient-clipping 1.0).")


@dataclass(frozen=True)
class MemoryNeed:
    """What one rank of the job needs, predicted by :func:`fp8dist.estimate_memory` before the first step."""

    model_state_bytes: int
    activation_bytes: int | None  # None where no activation formula covers the model
    micro_batch: int
    seq_len: int

    def describe(self) -> str:
        """The estimate in words for the run's header (model states, activations per rank)."""
        states = f"model states {_gib(self.model_state_bytes)}"
        if self.activation_bytes is None:
            return f"{states} per rank (activations not modelled for this model)"
        return (f"{states} + activations {_gib(self.activation_bytes)} (micro-batch {self.micro_batch} x "
                f"{self.seq_len:,} tokens) per rank, estimated")


def job_memory_need(config: Any, train: Any, model_config: Any, world: int) -> MemoryNeed:
    """The per-rank estimate of the job's model (built again on the meta device; with ``lora_rank``, its PEFT model)
    wrapped with ``config``."""
    from transformers import AutoModelForCausalLM

    from ..accounting.estimate import estimate_memory

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    if train.lora_rank:
        from .lora import apply_lora

        model = apply_lora(model, train)
    micro = max(1, train.batch_size // (world * config.parallel.grad_accum))
    with warnings.catch_warnings():  # its notes (an option no axis reads) are wrap_model's to say, once
        warnings.simplefilter("ignore", UserWarning)
        est = estimate_memory(model, config, world_size=world, micro_batch_size=micro, seq_len=train.seq_len)
    return MemoryNeed(est.model_state_bytes, est.activation_bytes if est.activations_modelled else None, micro,
                      train.seq_len)


def check_positions(model_config: Any, name: str, config: Any, train: Any, world: int) -> None:
    """ValueError when ``seq_len`` exceeds the model's positions, saying what that length would need in memory."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(positions, int) or train.seq_len <= positions:
        return
    need = job_memory_need(config, train, model_config, world)
    raise ValueError(f"seq_len={train.seq_len:,} and {name} holds {positions:,} positions: pass --seq-len {positions} "
                     f"or less, or --model-config with max_position_embeddings >= {train.seq_len}. At that length "
                     f"the job would need {need.describe()}.")


def check_memory(need: MemoryNeed, device: torch.device, ranks_here: int) -> None:
    """MemoryError when the estimate exceeds this rank's share: its GPU's free memory, or on CPU the node's available
    memory over its ``ranks_here`` ranks (clearer than hours of swapping or an OOM kill)."""
    from ..strategies.common import available_bytes

    free = available_bytes(device)
    if free is None:
        return
    share = free if device.type == "cuda" else free // max(1, ranks_here)
    total = need.model_state_bytes + (need.activation_bytes or 0)
    if total > share:
        where = f"{device} has {_gib(free)} free" if device.type == "cuda" else \
            f"this node has {_gib(free)} available for {plural(ranks_here, 'rank')}: {_gib(share)} each"
        raise MemoryError(f"the job needs about {_gib(total)} per rank ({need.describe()}) and {where}. Lower "
                          f"--seq-len (now {need.seq_len:,}) or --batch-size, add --grad-accum, or "
                          "--activation-checkpointing full.")


def check_checkpoint_dir(train: Any) -> tuple[Path | None, Path | None]:
    """(The directory the job saves into, the checkpoint it resumes from or None). ValueError naming the newest when
    the directory holds checkpoints (or is one) without ``--resume``: a new run would replace them one by one."""
    from ..runtime.files import wrong_kind
    from ..checkpoint.io import CheckpointError
    from ..checkpoint.layout import job_checkpoints

    if train.checkpoint_dir is None:
        return None, None
    mismatch = wrong_kind(train.checkpoint_dir, name="checkpoint_dir", directory=True)
    if mismatch is not None:
        raise CheckpointError(mismatch)
    root, newest = job_checkpoints(train.checkpoint_dir)
    if newest is not None and not train.resume:
        held = f"is a checkpoint (step {int(newest.name[5:])} of '{root}')" if newest == Path(train.checkpoint_dir) \
            else f"already holds checkpoints (newest {newest.name})"
        raise ValueError(f"checkpoint_dir={train.checkpoint_dir!r} {held}: pass --resume to continue from it, or "
                         "another --checkpoint-dir to start afresh.")
    return root, newest if train.resume else None
