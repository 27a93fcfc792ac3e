"""Optimizers: specs for engines that own the optimizer (MS-AMP, DeepSpeed) and for users who like one call, and
the one registry of what fp8dist does around an optimizer's step (:data:`STEP_HOOKS`: an optimizer built before
``wrap_model`` is stopped; torchao's scale precompute after each step)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["OptimizerSpec", "build_optimizer", "STEP_HOOKS", "StepAction", "watch_replaced_parameters",
           "StaleOptimizerError", "param_count"]

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


StepAction = Callable[[nn.Module, torch.optim.Optimizer], None]
"""``(model, optimizer) -> None``: what fp8dist does around a step of an optimizer that holds the model's
parameters."""


class _StepHooks:
    """fp8dist's optimizer-step hooks: one process-wide pre-step and one post-step hook (torch's
    ``register_optimizer_step_pre_hook`` / ``_post_hook``), registered on first use and never removed, dispatching
    to the actions registered for each model, for the optimizers that hold that model's parameters.

    Why process-wide rather than on one optimizer: the README's loop builds its own optimizer after ``wrap_model``
    (``torch.optim.AdamW(model.parameters())``), which fp8dist never sees, and fp8dist must still act on its steps
    (torchao's scale precompute, the check for an optimizer built too early): "nothing to call". Why never removed:
    torch iterates its global hook dict while calling the hooks, so a hook that removes itself there raises
    "OrderedDict mutated during iteration" in the next model's first step. Everything here is held weakly: a model or
    an optimizer dropped in any order takes its entries with it.
    """

    def __init__(self) -> None:
        self._actions: "weakref.WeakKeyDictionary[nn.Module, dict[str, list[StepAction]]]" = \
            weakref.WeakKeyDictionary()
        # per optimizer: its parameter count when its models were found, and which registered models it steps
        self._owners: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, weakref.WeakSet]]" = \
            weakref.WeakKeyDictionary()
        self._handles: list[Any] = []

    def add(self, model: nn.Module, *, pre: StepAction | None = None, post: StepAction | None = None) -> None:
        """Run ``pre`` before / ``post`` after every step of an optimizer holding ``model``'s parameters, while
        ``model`` lives."""
        actions = self._actions.setdefault(model, {"pre": [], "post": []})
        for when, action in (("pre", pre), ("post", post)):
            if action is not None:
                actions[when].append(action)
        self._owners.clear()  # a new model: every optimizer's models are found again
        if not self._handles:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            self._handles = [register_optimizer_step_pre_hook(lambda opt, a, k: self._run(opt, "pre")),
                             register_optimizer_step_post_hook(lambda opt, a, k: self._run(opt, "post"))]

    def _models_of(self, optimizer: torch.optim.Optimizer) -> list[nn.Module]:
        count = param_count(optimizer)
        known = self._owners.get(optimizer)
        if known is None or known[0] != count:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
            mine = weakref.WeakSet(m for m in list(self._actions) if any(id(p) in ids for p in m.parameters()))
            known = (count, mine)
            self._owners[optimizer] = known
        return list(known[1])

    def _run(self, optimizer: torch.optim.Optimizer, when: str) -> None:
        if when == "pre":
            _check_not_stale(optimizer)
        if not self._actions:
            return
        for model in self._models_of(optimizer):
            for action in self._actions.get(model, {}).get(when, ()):
                action(model, optimizer)


STEP_HOOKS = _StepHooks()
"""The one registry of fp8dist's optimizer-step actions (see :class:`_StepHooks`)."""


class StaleOptimizerError(RuntimeError):
    """An optimizer steps over parameters that ``wrap_model`` replaced: it would train nothing."""


# parameters wrap_model replaced (FSDP2's DTensors, a backend's new modules), by id; the entry goes with the object
_REPLACED: "weakref.WeakValueDictionary[int, nn.Parameter]" = weakref.WeakValueDictionary()
# optimizers already checked, with the parameter count they had then
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


def _check_not_stale(optimizer: torch.optim.Optimizer) -> None:
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


def watch_replaced_parameters(before: Iterable[nn.Parameter], after: Iterable[nn.Parameter], model: nn.Module) -> int:
    """Remember the parameters of ``before`` that are not in ``after`` (the model's parameters before and after
    ``wrap_model``): any optimizer that steps over one of them raises :class:`StaleOptimizerError` at its first
    step. Returns how many were replaced."""
    kept = {id(p) for p in after}
    replaced = [p for p in before if id(p) not in kept]
    for p in replaced:
        _REPLACED[id(p)] = p
    if replaced:
        STEP_HOOKS.add(model)  # installs the process-wide hooks, which check every optimizer before its step
    return len(replaced)
