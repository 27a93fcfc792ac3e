"""Gradient accumulation and clipping, one call each for every strategy (each engine does them its own way; DeepSpeed
does both inside its engine, from its config, and refuses these calls naming that way)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from ..config.args import require_bool
from ..strategies import Strategy, get_strategy
from .api import get_wrap_info

__all__ = ["no_sync", "clip_grad_norm_"]


def _strategy(model: nn.Module) -> Strategy:
    return get_strategy(get_wrap_info(model).config.parallel.strategy)


@contextlib.contextmanager
def no_sync(model: nn.Module, last: bool = False) -> Iterator[None]:
    """Backward passes inside skip the gradient reduction; gradients accumulate locally (unsharded under FSDP1 and
    DDP, as each engine does): FSDP2 ``set_requires_gradient_sync(False)``, FSDP1's and DDP's ``no_sync()``, one
    process nothing. ``model``: what ``wrap_model`` returned; ``last=True`` (the micro-batch that completes the step;
    a bool, else TypeError) does reduce. Wrap every micro-batch's forward and backward in it.

    Raises:
        TypeError: ``last`` is not a bool.
        ValueError: ``model`` was not returned by ``wrap_model``, or its strategy accumulates gradients itself
            (DeepSpeed: pass ``grad_accum=N`` to ``wrap_model``; the message says so).

    Example::

        for i, batch in enumerate(micro_batches):
            with fp8dist.no_sync(model, last=i == len(micro_batches) - 1):
                (model(**batch).loss / len(micro_batches)).backward()
    """
    require_bool("last", last)
    skip = _strategy(model).no_sync(model)  # an engine that accumulates itself refuses here, last or not
    with contextlib.nullcontext() if last else skip:
        yield


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient so that their global norm (over all ranks' shards) is at most ``max_norm``; returns the
    norm before clipping (a plain tensor, the same on every rank). A non-finite norm makes the optimizer step that
    follows a non-finite one for the guard (``nonfinite_step``: skipped on every rank, said, counted). Call it on
    every rank (it is collective), after the last backward of a step and before ``optimizer.step()``.

    Args:
        model: what ``wrap_model`` returned.
        max_norm: the largest global gradient norm kept; a positive finite number.
        norm_type: the norm's order, as ``torch.nn.utils.clip_grad_norm_`` takes it (2.0: Euclidean).

    Raises:
        ValueError: ``max_norm`` is not a positive finite number, ``model`` was not returned by ``wrap_model``, or its
            strategy clips inside its own step (DeepSpeed: pass ``gradient_clipping=X`` to ``wrap_model``).

    Example::

        norm = fp8dist.clip_grad_norm_(model, max_norm=1.0)  # after the last backward, before optimizer.step()
    """
    if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and max_norm > 0
            and math.isfinite(max_norm)):
        raise ValueError(f"max_norm={max_norm!r} must be a positive number (the largest global gradient norm kept).")
    norm = _strategy(model).clip_grad_norm_(model, max_norm, norm_type)
    guard = get_wrap_info(model).guard
    if guard is not None:  # clipping by an inf norm zeroed every gradient: the guard alone can no longer see it
        guard.saw_norm(norm)
    return norm
