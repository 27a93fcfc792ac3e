"""Gradient accumulation and clipping, one call each for every strategy (each engine does them its own way).

    for i, batch in enumerate(micro_batches):            # accumulate N micro-batches, reduce once
        with fp8dist.no_sync(model, last=i == len(micro_batches) - 1):
            (model(**batch).loss / len(micro_batches)).backward()
    norm = fp8dist.clip_grad_norm_(model, max_norm=1.0)    # the global norm, before clipping
    optimizer.step()

DeepSpeed accumulates and clips inside its engine (``grad_accum`` and ``gradient_clipping`` in the config): there
both calls are errors naming that way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..config.args import require_bool

__all__ = ["no_sync", "clip_grad_norm_"]

_DEEPSPEED = ("strategy='deepspeed': the DeepSpeed engine {what} itself; {how}")


def _strategy(model: nn.Module) -> str:
    from .api import get_wrap_info

    return get_wrap_info(model).config.parallel.strategy


@contextlib.contextmanager
def no_sync(model: nn.Module, last: bool = False) -> Iterator[None]:
    """Backward passes inside skip the gradient reduction; gradients accumulate locally (unsharded under FSDP1
    and DDP, as each engine does). ``last=True`` does reduce (the micro-batch that completes the step), so a loop
    can wrap every micro-batch the same way.

    fsdp: ``set_requires_gradient_sync(False)`` (FSDP2); fsdp1 and ddp: their ``no_sync()``; none: nothing to skip.
    ``last`` must be True or False (TypeError otherwise: ``'no'`` would be truthy).
    """
    require_bool("last", last)
    strategy = _strategy(model)
    if strategy == "deepspeed":
        raise ValueError(_DEEPSPEED.format(what="accumulates gradients over grad_accum micro-batches",
                                           how="pass grad_accum=N to wrap_model and call engine.backward(loss) and "
                                               "engine.step() for every micro-batch, without no_sync"))
    if last or strategy == "none":
        yield
        return
    if strategy == "fsdp":
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    with model.no_sync():  # fsdp1, ddp
        yield


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient so that their global norm (over all ranks' shards) is at most ``max_norm``; returns
    that norm as computed before clipping (a plain tensor, the same on every rank). Call after backward (and after
    the last accumulated micro-batch), before ``optimizer.step()``."""
    if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm > 0
            and math.isfinite(max_norm)):
        raise ValueError(f"max_norm={max_norm!r} must be a positive number (the largest global gradient norm kept).")
    strategy = _strategy(model)
    if strategy == "deepspeed":
        raise ValueError(_DEEPSPEED.format(what="clips gradients in engine.step()",
                                           how="pass gradient_clipping=X to wrap_model; engine.get_global_grad_norm() "
                                               "gives the norm of the last step"))
    if strategy == "fsdp1":
        return model.clip_grad_norm_(max_norm, norm_type).detach()
    norm: Any = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm,
                                               norm_type)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor reduced over the shards
        norm = norm.full_tensor()
    return norm.detach()
