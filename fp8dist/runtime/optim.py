"""Optimizer specs (for engines that own the optimizer, and one-call users), and :data:`STEP_HOOKS`, the one registry
of what fp8dist does around an optimizer's step (stop an optimizer built before ``wrap_model``, torchao's precompute
of scales)."""

from __future__ import annotations

import difflib
import inspect
import types
import typing
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["OptimizerSpec", "build_optimizer", "check_optimizer_spec", "optimizer_classes", "STEP_HOOKS", "StepAction",
           "watch_replaced_parameters", "StaleOptimizerError", "param_count"]

OptimizerSpec = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | Mapping[str, Any]
"""What ``wrap_model(optimizer=...)`` takes where the engine owns the optimizer: a callable ``params -> Optimizer``
(``functools.partial(torch.optim.AdamW, lr=3e-4)``) or a mapping ``{"type": "AdamW", "lr": 3e-4, ...}`` naming a
``torch.optim`` class (or an engine's own type) and its keyword arguments."""


def build_optimizer(spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Build an optimizer over ``params`` from ``spec``: a callable ``params -> Optimizer``
    (``functools.partial(torch.optim.AdamW, lr=3e-4)``) or a mapping ``{"type": "AdamW", "lr": 3e-4, ...}`` naming a
    class of ``torch.optim``. Call it after conversion and sharding, on the parameters the wrapped model holds.

    Raises:
        TypeError: the callable returned something other than a ``torch.optim.Optimizer``, or ``spec`` is neither a
            callable nor a mapping.
        ValueError: what :func:`check_optimizer_spec` refuses (an unknown type, key or value).
    """
    if callable(spec):
        optimizer = spec(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(optimizer).__name__}, not a torch.optim.Optimizer.")
        return optimizer
    cls = check_optimizer_spec(spec)
    return cls(params, **{k: v for k, v in spec.items() if k != "type"})


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every optimizer class of ``torch.optim`` by its lower-case name: the types an optimizer spec names."""
    base = torch.optim.Optimizer
    return {name.lower(): value for name, value in vars(torch.optim).items()
            if isinstance(value, type) and issubclass(value, base) and value is not base}


# keys that pick an implementation for the parameters' device: left out of the trial on a meta parameter
_IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def check_optimizer_spec(spec: OptimizerSpec, *, who: str = "",
                         engine_keys: Mapping[str, Any] | None = None) -> type[torch.optim.Optimizer] | None:
    """Refuse, before anything changes, a mapping spec that would fail later: an unknown ``type``, a key or a value
    type its class's signature does not take (``lr="1e-3"``), a value torch refuses (tried on a stand-in parameter).
    ``who`` starts the message (``"memory='lean': "``); ``engine_keys``: the typed keys an engine that builds the
    optimizer takes beside torch's (DeepSpeed's ``torch_adam``), a ``type`` torch lacks then left to the engine.
    Returns the torch.optim class; None for an engine's own type or a callable (checked when called).

    Raises:
        TypeError: ``spec`` is neither a callable nor a mapping.
        ValueError: an unknown ``type`` (naming the choices), a key its class does not take (with the closest
            one), a value of the wrong type, or one torch refuses.
    """
    if callable(spec):
        return None
    if not isinstance(spec, Mapping):
        raise TypeError(f"optimizer must be a callable params -> Optimizer or a mapping with 'type', got "
                        f"{type(spec).__name__}.")
    kwargs = dict(spec)
    name = kwargs.pop("type", None)
    classes = optimizer_classes()
    if not isinstance(name, str) or name.lower() not in classes:
        if engine_keys is not None and isinstance(name, str) and name:
            return None
        from ..config.schema import choice_error

        raise choice_error(f"{who}optimizer type", name, sorted(c.__name__ for c in classes.values()),
                           'Pass {"type": "AdamW", "lr": ...} or a callable params -> optimizer.')
    cls = classes[name.lower()]
    hints, defaults = _signature(cls)
    extra = dict(engine_keys or {})
    known = [*hints, *extra]
    for key, value in kwargs.items():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            raise ValueError(f"{who}optimizer key {key!r} is not an option of torch.optim.{cls.__name__}; it takes "
                             f"{', '.join(known)}." + (f" Did you mean {close[0]!r}?" if close else " Remove it."))
        hint = hints.get(key, extra.get(key))
        if not _matches(value, hint):
            shown = f", e.g. {key}={defaults[key]!r} (torch's default)" if defaults.get(key) is not None else ""
            owner = f"torch.optim.{cls.__name__}" if key in hints else "the engine that builds it"
            size = f" of {len(value)}" if isinstance(value, (tuple, list)) else ""
            raise ValueError(f"{who}optimizer {key}={value!r} is a {type(value).__name__}{size}: {owner} takes "
                             f"{_describe(hint)} there: pass one{shown}.")
    _trial(cls, {k: v for k, v in kwargs.items() if k in hints and k not in _IMPLEMENTATION_FLAGS}, who)
    return cls


def _trial(cls: type, kwargs: dict[str, Any], who: str) -> None:
    """Build ``cls`` over a meta parameter to run torch's range checks; names the first key refused alone, else all."""
    def refusal(options: dict[str, Any]) -> Exception | None:
        try:
            cls([nn.Parameter(torch.zeros(1, 1, device="meta"))], **options)
        except (ValueError, TypeError, RuntimeError) as err:
            return err
        return None

    err = refusal(kwargs)
    if err is None:
        return
    key = next((k for k in kwargs if refusal({k: kwargs[k]}) is not None), None)
    shown = f"{key}={kwargs[key]!r}" if key else ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    raise ValueError(f"{who}optimizer {shown}: torch.optim.{cls.__name__} refuses it ({err}). Change "
                     f"{'that value' if key else 'these values'}.")


def _signature(cls: type) -> tuple[dict[str, Any], dict[str, Any]]:
    hints = typing.get_type_hints(cls.__init__)
    parameters = [p for name, p in inspect.signature(cls.__init__).parameters.items() if name not in ("self", "params")
                  and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return ({p.name: hints.get(p.name, Any) for p in parameters},
            {p.name: None if p.default is p.empty else p.default for p in parameters})


# an optimizer signature's types: as the error says them, and the check (an int is a float, a bool is neither)
_TYPES = {type(None): ("None", lambda v: v is None), bool: ("True or False", lambda v: isinstance(v, bool)),
          int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
          float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
          str: ("a string", lambda v: isinstance(v, str)),
          torch.Tensor: ("a tensor", lambda v: isinstance(v, torch.Tensor))}


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in args)
    if origin is tuple:
        return isinstance(value, (tuple, list)) and len(value) == len(args) and \
            all(_matches(v, a) for v, a in zip(value, args))
    return _TYPES[hint][1](value) if hint in _TYPES else True  # a hint not listed here: torch checks it


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is tuple:
        return f"a list of {len(args)} ({', '.join(_describe(a) for a in args)})"
    return _TYPES[hint][0] if hint in _TYPES else str(hint)


def param_count(optimizer: torch.optim.Optimizer) -> int:
    """Parameters the optimizer steps over now (``add_param_group`` changes it)."""
    return sum(len(group["params"]) for group in optimizer.param_groups)


StepAction = Callable[[nn.Module, torch.optim.Optimizer], None]
"""An action :data:`STEP_HOOKS` runs around an optimizer step, called as ``action(model, optimizer)``."""


class _StepHooks:
    """One process-wide pre- and post-step hook of torch's, dispatching to each model's actions for the optimizers
    holding its parameters: process-wide as fp8dist never sees the user's optimizer; never removed as torch iterates
    its hook dict while calling them. Held weakly: a dropped model or optimizer takes its entries with it."""

    def __init__(self) -> None:
        self._actions: "weakref.WeakKeyDictionary[nn.Module, dict[str, list[StepAction]]]" = \
            weakref.WeakKeyDictionary()
        # per optimizer: its parameter count when its models were found, and which registered models it steps
        self._owners: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, weakref.WeakSet]]" = \
            weakref.WeakKeyDictionary()
        self._handles: list[Any] = []

    def add(self, model: nn.Module, *, pre: StepAction | None = None, post: StepAction | None = None) -> None:
        """Run ``pre`` before / ``post`` after every step of an optimizer holding ``model``'s parameters."""
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
            known = self._owners[optimizer] = (count, mine)
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
"""The process-wide optimizer-step hooks: ``STEP_HOOKS.add(model, pre=..., post=...)`` runs each
:data:`StepAction` before / after every ``step()`` of any optimizer holding ``model``'s parameters (a backend's scale
precompute, telemetry). Once a model is added, every optimizer step in the process first checks that the optimizer
holds no parameter ``wrap_model`` replaced (:class:`StaleOptimizerError`). Entries live as long as the model."""


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


def watch_replaced_parameters(before: Iterable[nn.Parameter], after: Iterable[nn.Parameter], model: nn.Module) -> None:
    """Make any optimizer stepping over a parameter of ``before`` not in ``after`` (the model's, before and after
    ``wrap_model``) raise :class:`StaleOptimizerError`."""
    kept = {id(p) for p in after}
    replaced = {id(p): p for p in before if id(p) not in kept}
    _REPLACED.update(replaced)
    if replaced:
        STEP_HOOKS.add(model)  # installs the process-wide hooks, which check every optimizer before its step
