"""Optimizer specs, for engines that own the optimizer (MS-AMP, DeepSpeed) and for users who like one call."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["OptimizerSpec", "build_optimizer"]

OptimizerSpec = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | Mapping[str, Any]


def build_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Build an optimizer from ``spec``: a callable ``params -> Optimizer`` (e.g. ``functools.partial(
    torch.optim.AdamW, lr=3e-4)``) or a mapping ``{"type": "AdamW", "lr": 3e-4, ...}`` naming a class of
    ``torch.optim``.
    """
    if callable(spec):
        optimizer = spec(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(optimizer).__name__}, not a torch.optim.Optimizer.")
        return optimizer
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        name = kwargs.pop("type", None)
        classes = {n.lower(): getattr(torch.optim, n) for n in dir(torch.optim)
                   if isinstance(getattr(torch.optim, n), type) and issubclass(getattr(torch.optim, n),
                                                                              torch.optim.Optimizer)}
        if not isinstance(name, str) or name.lower() not in classes:
            from ._schema import choice_error

            raise choice_error("optimizer type", name, sorted(c.__name__ for c in set(classes.values())),
                               'Pass {"type": "AdamW", "lr": ...} or a callable params -> optimizer.')
        return classes[name.lower()](params, **kwargs)
    raise TypeError(f"optimizer must be a callable params -> Optimizer or a mapping with 'type', got "
                    f"{type(spec).__name__}.")
