"""The learning-rate schedule of ``fp8dist train`` and ``fp8dist bench --lr-schedule``, and the one way both set
the rate on an optimizer."""

from __future__ import annotations

import math
from typing import Any, Callable

from ..config.text import plural

__all__ = ["LR_SCHEDULES", "MAX_WARMUP_STEPS", "lr_schedule", "warmup_steps", "describe_schedule", "set_lr"]


LR_SCHEDULES = ("constant", "cosine")
"""constant: the peak at every step; cosine: linear warm-up over the first 10% of the steps (at most
:data:`MAX_WARMUP_STEPS`), then cosine decay toward 10% of the peak."""

MAX_WARMUP_STEPS = 2000
"""The longest warm-up, as Llama 2's and nanoGPT's GPT-2 runs (torchtitan's default is 200): 10% of a very long run
would keep the learning rate near zero for the whole of a run stopped early."""


def warmup_steps(steps: int) -> int:
    """Warm-up steps of the cosine schedule: 10% of ``steps``, at least 1, at most MAX_WARMUP_STEPS."""
    return max(1, min(steps // 10, MAX_WARMUP_STEPS))


def describe_schedule(name: str, steps: int) -> str:
    """The learning-rate schedule ``name`` ("constant", or "cosine": linear warm-up then cosine decay to 10%) of a
    ``steps``-step run, in words."""
    if name == "constant":
        return "constant"
    return f"linear warm-up over {plural(warmup_steps(steps), 'step')}, then cosine decay to 10% at step {steps:,}"


def lr_schedule(name: str, steps: int) -> Callable[[int], float]:
    """The factor of the peak learning rate at each step (0-based) of a ``steps``-step run; set each param group's
    ``lr`` to peak x factor before the step. ValueError names an unknown ``name``."""
    if name not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {name!r} is not valid; choose one of: {', '.join(LR_SCHEDULES)}.")
    if name == "constant":
        return lambda step: 1.0
    warmup = warmup_steps(steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def set_lr(optimizer: Any, lr: float) -> None:
    """Set every param group's learning rate; call it before each optimizer step. In place where the group holds a
    tensor (torchao's low-bit AdamW, memory="lean", compiles its step for a tensor lr)."""
    import torch  # here: LR_SCHEDULES is read by fp8dist bench's flags, before any engine is imported

    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
