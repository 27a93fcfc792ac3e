"""The interface of a model-state memory level (``memory=``), symmetric to the strategies and the FP8 backends: what
it refuses to combine with, how it changes the config, what it does to the model around FP8 conversion, and how it
builds the optimizer. ``wrap_model`` calls it in one fixed order:

    rules (the combination table) -> resolve -> check_optimizer -> before_convert -> (convert) -> after_convert
    -> ... -> build_optimizer
"""

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
    """The optimizer the level builds, as the memory estimate names it (its ``optimizer=`` choices: adamw, adam,
    sgd_momentum, sgd), where it builds one."""

    def resolve(self, cfg: Any, facts: StrategyFacts) -> Any:
        """``cfg`` as this level runs it (the level may fix a dtype the strategy's engine uses)."""
        return cfg

    def check_optimizer(self, spec: Any) -> None:
        """Refuse, before anything changes, an optimizer spec this level cannot build."""

    def before_convert(self, model: nn.Module) -> None:
        """On the model as given, before FP8 conversion."""

    def after_convert(self, model: nn.Module) -> None:
        """On the converted model (a backend's new modules), before activation checkpointing and sharding."""

    def build_optimizer(self, spec: Any, params: Iterable[nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
        """The optimizer from ``spec`` over the sharded model's parameters."""
        from ..pipeline.optim import build_optimizer

        return build_optimizer(spec, params)

    # accounting: what the memory estimate and the precision report ask (defaults: the standard level's answers)
    fit_way_out: ClassVar[tuple[str, Mapping[str, Any]] | None] = None
    """``(what, options)``: switching to this level is a way out the estimate tries when a rank does not fit its
    GPU; None: it is none."""
    report_master: ClassVar[str] = "n/a (the stored weight)"
    """The precision report's master-weight column where the engine keeps no master copy of its own."""

    def element_bytes(self, base: Any) -> Any:
        """Bytes per element of one parameter in each model-state category as this level holds it; ``base``: as
        the strategy holds it (fields ``weight``, ``master``, ``grad``, ``states``, ``dtypes``; a frozen dataclass
        to ``dataclasses.replace``). Default: unchanged."""
        return base

    def local_state_bytes(self, numel: int) -> int:
        """Bytes of the level's own optimizer states for a local tensor of ``numel`` elements, beyond those of
        :meth:`element_bytes`. Default: none."""
        return 0
