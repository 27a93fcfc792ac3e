"""The interface of a model-state memory level (``memory=``). ``wrap_model`` calls it in one fixed order: rules ->
resolve -> check_optimizer -> before_convert -> (FP8 conversion) -> after_convert -> ... -> build_optimizer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from ..config.axis import Rule, StrategyFacts, When

__all__ = ["MemoryLevel"]


class MemoryLevel(Protocol):
    """A memory level. Subclass it: the defaults are those of the standard level (fp32 master weights, any
    optimizer, nothing done to the model)."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    """What the level is, in the plan's and the estimate's header ("" for the standard level)."""
    rules: ClassVar[tuple[Rule, ...]] = ()
    """What this level refuses to combine with (its rows of the combination table)."""
    options: ClassVar[Mapping[str, When]] = {}
    """Options only this level reads, each with the condition under which it is read."""
    builds_optimizer: ClassVar[bool] = False
    """The level builds the optimizer itself: ``wrap_model`` needs an optimizer spec."""
    estimate_optimizer: ClassVar[str] = "adamw"
    """The optimizer the level builds, by the memory estimate's ``optimizer=`` name (adamw, adam, sgd_momentum, sgd:
    the keys of ``OPTIMIZER_STATES``)."""

    def resolve(self, cfg: Any, facts: StrategyFacts) -> Any:
        """``cfg`` as this level runs it (the level may fix a dtype the strategy's engine uses)."""
        return cfg

    def check_optimizer(self, spec: Any) -> None:
        """Refuse, before anything changes, an optimizer spec this level cannot build."""

    def before_convert(self, model: nn.Module) -> None:
        """On the model as given, before FP8 conversion."""

    def after_convert(self, model: nn.Module) -> None:
        """On the converted model, before activation checkpointing and sharding."""

    def build_optimizer(self, spec: Any, params: Iterable[nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
        """The optimizer from ``spec`` over the sharded model's parameters."""
        from ..runtime.optim import build_optimizer

        return build_optimizer(spec, params)

    # accounting: what the memory estimate and the precision report ask
    fit_way_out: ClassVar[tuple[str, Mapping[str, Any]] | None] = None
    """``(what, options)``: a way out the estimate tries when a rank does not fit its GPU; None: none."""
    report_master: ClassVar[str] = "n/a (the stored weight)"
    """The precision report's master-weight column where the engine keeps no master copy of its own."""

    def element_bytes(self, base: Any) -> Any:
        """Bytes per element of a parameter in each model-state category at this level; ``base``: the strategy's
        (a frozen dataclass with ``weight``, ``master``, ``grad``, ``states``, ``dtypes``)."""
        return base

    def local_state_bytes(self, numel: int) -> int:
        """Bytes of the level's own optimizer states for a local tensor of ``numel`` elements, beyond
        :meth:`element_bytes`."""
        return 0
