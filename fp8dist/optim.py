"""Optimizers: specs for engines that own the optimizer (MS-AMP, DeepSpeed) and for users who like one call, and
the process-wide optimizer-step hooks fp8dist needs (an optimizer built before ``wrap_model``; torchao's scale
precompute after each step)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["OptimizerSpec", "build_optimizer", "ProcessStepHook", "watch_replaced_parameters",
           "StaleOptimizerError"]

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


def param_count(optimizer: torch.optim.Optimizer) -> int:
    """Parameters the optimizer steps over now (``add_param_group`` changes it)."""
    return sum(len(group["params"]) for group in optimizer.param_groups)


class ProcessStepHook:
    """A process-wide ``optimizer.step()`` hook, registered on first use and never removed.

    torch iterates its global hook dict while calling the hooks, so a hook that removes itself there raises
    "OrderedDict mutated during iteration" in the *next* model's first step. A hook that stays, and reads what
    it acts on from weak references, never needs removing.
    """

    def __init__(self, hook: Callable[[torch.optim.Optimizer, Any, Any], None], *, pre: bool) -> None:
        self._hook = hook
        self._pre = pre
        self._handle: Any = None

    def ensure_registered(self) -> None:
        if self._handle is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register = register_optimizer_step_pre_hook if self._pre else register_optimizer_step_post_hook
        self._handle = register(self._hook)


class StaleOptimizerError(RuntimeError):
    """An optimizer steps over parameters that ``wrap_model`` replaced: it would train nothing."""


# parameters wrap_model replaced (FSDP2's DTensors, a backend's new modules), by id; the entry goes with the object
_REPLACED: "weakref.WeakValueDictionary[int, nn.Parameter]" = weakref.WeakValueDictionary()
# optimizers already checked, with the parameter count they had then
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


def _check_not_stale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    count = param_count(optimizer)
    if not _REPLACED or _CHECKED.get(optimizer) == count:
        return
    stale = sum(1 for group in optimizer.param_groups for p in group["params"] if _REPLACED.get(id(p)) is p)
    if stale:
        raise StaleOptimizerError(
            f"{type(optimizer).__name__} steps over {stale} of its {count} parameters that fp8dist.wrap_model "
            "replaced (sharding and FP8 conversion make new parameters): it was built before wrap_model and "
            "would update nothing the model uses. Build the optimizer after wrap_model, from the returned "
            "model: optimizer = torch.optim.AdamW(model.parameters(), ...).")
    _CHECKED[optimizer] = count


_STALE_CHECK = ProcessStepHook(_check_not_stale, pre=True)


def watch_replaced_parameters(before: Iterable[nn.Parameter], after: Iterable[nn.Parameter]) -> int:
    """Remember the parameters of ``before`` that are not in ``after`` (the model's parameters before and after
    ``wrap_model``): any optimizer that steps over one of them raises :class:`StaleOptimizerError` at its first
    step. Returns how many were replaced."""
    kept = {id(p) for p in after}
    replaced = [p for p in before if id(p) not in kept]
    for p in replaced:
        _REPLACED[id(p)] = p
    if replaced:
        _STALE_CHECK.ensure_registered()
    return len(replaced)
