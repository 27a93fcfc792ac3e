"""The training job's steps: each optimizer step over its micro-batches through the strategy's step
(:func:`backward_and_step`), and the loop over the steps with its logging, evaluations and checkpoints
(:func:`train_steps`)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..accounting import report
from ..config.resolve import Config
from ..pipeline.api import get_wrap_info
from ..pipeline.grads import clip_grad_norm_
from ..strategies import get_strategy
from ..strategies.grad_fp8 import describe_tally, fp8_wire_words, model_grad_wire
from .checks import LossWatch
from .config import TrainConfig
from .data.job import JobBatches, eval_steps, lm_loss
from .log import JobLog
from .saving import save_step
from .schedule import lr_schedule, set_lr

__all__ = ["backward_and_step", "train_steps", "grad_wire_line", "NORM_ONLY"]


NORM_ONLY = float(torch.finfo(torch.float32).max)
"""A max norm with which ``clip_grad_norm_`` scales by exactly 1.0: clipping off, the norm still shown."""


def backward_and_step(wrapped: Any, optimizer: Any, micro: list[torch.Tensor], *, engine: bool, clip: float,
                      windows: bool, show_report: Callable[[str], Any] | None) -> tuple[torch.Tensor, Any]:
    """One optimizer step over the micro-batches (reduced at the last, clipped to ``clip``, 0: not; ``engine``: the
    engine clips itself), through the strategy's step (:meth:`~fp8dist.strategies.base.Strategy.backward`,
    ``optimizer_step``, ``global_grad_norm``); (mean loss, grad norm before clipping). ``show_report`` gets the
    report while gradients and optimizer states are both held (the strategy's ``while_held``)."""
    strategy = get_strategy(get_wrap_info(wrapped).sharding.strategy)
    total = torch.zeros((), device=micro[0].device)
    for i, ids in enumerate(micro):
        last = i == len(micro) - 1
        with strategy.accumulating(wrapped, last=last):
            loss = lm_loss(wrapped, ids, windows=windows)
            strategy.backward(wrapped, loss, micro_batches=len(micro), last=last)
        total += loss.detach().float()
    norm = None if engine else clip_grad_norm_(wrapped, clip if clip > 0 else NORM_ONLY)
    held = None if show_report is None else lambda: show_report(str(report(wrapped, optimizer)))
    strategy.optimizer_step(wrapped, optimizer, while_held=held)
    return total / len(micro), strategy.global_grad_norm(wrapped) if norm is None else norm


def _bar(done: int, total: int) -> str:
    filled = int(20 * done / total)
    return "[" + "#" * filled + "." * (20 - filled) + f"] {100 * done / total:3.0f}%"


def grad_wire_line(wrapped: Any, steps: int) -> str:
    """``reduce_dtype='fp8'``: the gradient bytes per step over ``steps`` steps, counted at the collectives, in
    words; "" where nothing is counted."""
    wire = model_grad_wire(wrapped)
    return describe_tally(wire.total.per_step(steps), fp8_wire_words(wire)) if wire is not None and steps else ""


def train_steps(config: Config, train: TrainConfig, wrapped: Any, optimizer: Any, batches: JobBatches,
                start: tuple[int, int], job_log: JobLog, log: Callable[[str], Any] | None,
                progress: Callable[[int], Any] | None) -> tuple[list, list, list]:
    """Steps ``start[0]`` .. ``train.steps``: each one's loss (mean over ranks) and time, and each evaluation's
    held-out loss. The lr follows the optimizer steps applied (``start[1]`` before): a step the guard skipped leaves
    the schedule where it was, as DeepSpeed's engine does. ``config`` as asked (grad_accum, gradient_clipping)."""
    (first, applied), info = start, get_wrap_info(wrapped)
    env = info.env
    lr_factor, engine = lr_schedule("cosine", train.steps), info.plan.facts.engine_builds_optimizer
    accum, clip = config.parallel.grad_accum, config.parallel.gradient_clipping
    watch = LossWatch(train.lr, resumable=train.checkpoint_dir is not None)
    evaluate_after = set(eval_steps(train.steps, train.eval_every)) if batches.windows else set()
    wire = model_grad_wire(wrapped)  # reduce_dtype='fp8': the bytes counted at the collectives
    # each step's loss and seconds; (step, held-out loss) of each evaluation
    losses = []
    step_times = []
    evals = []
    if progress is not None:
        progress(first)
    for step in range(first, train.steps):
        t0 = time.perf_counter()
        micro = list(batches.take(step).to(env.device).chunk(accum))
        lr = train.lr * lr_factor(applied)
        set_lr(optimizer, lr)
        skipped, sent = info.skipped_steps, wire.total if wire is not None else None
        # the precision/memory report once, after the first step (DeepSpeed: the second step's backward)
        show = log if step == min(first + (1 if engine else 0), train.steps - 1) else None
        mean_loss, norm = backward_and_step(wrapped, optimizer, micro, engine=engine, clip=clip,
                                            windows=batches.windows, show_report=show)
        applied += info.skipped_steps == skipped  # the guard counts a skip inside the optimizer's (engine's) step
        if env.world_size > 1:
            dist.all_reduce(mean_loss)
            mean_loss /= env.world_size
        losses.append(mean_loss.item())
        step_times.append(time.perf_counter() - t0)
        extra = {}
        if step + 1 in evaluate_after:
            val = batches.evaluate(wrapped, env.device)
            evals.append((step + 1, val))
            extra = {"val_loss": val, "val_perplexity": math.exp(min(val, 700.0))}
        if wire is not None:
            tally = wire.total - sent
            extra.update(grad_wire_bytes=tally.sent, grad_wire_ratio=tally.ratio)
        record = job_log.step(step=step + 1, loss=losses[-1], tokens=train.batch_size * train.seq_len,
                              step_time_s=step_times[-1], grad_norm=norm, lr=lr, skipped_steps=info.skipped_steps,
                              extra=extra)
        if log is not None:
            eta = sum(step_times) / len(step_times) * (train.steps - step - 1)
            log(f"step {step + 1:>4}/{train.steps} {_bar(step + 1, train.steps)} | {record.figures()} | "
                f"eta {eta:.1f}s")
        watch.update(step, losses[-1])  # the same loss on every rank: every rank stops at the same step
        try:
            save_step(train, wrapped, optimizer, step + 1, applied, batches, log)
        except BaseException:  # Ctrl-C, a rank gone: the step is done, only its checkpoint was cut short
            if progress is not None:
                progress(step + 1)
            raise
        if progress is not None:
            progress(step + 1)
    return losses, step_times, evals
