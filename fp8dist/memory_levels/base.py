"""The interface of a model-state memory level (``memory=``). ``wrap_model`` calls it in one fixed order: rules ->
resolve -> check_optimizer -> before_convert -> (FP8 conversion) -> after_convert -> ... -> build_optimizer; the
memory estimate reads its accounting."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from ..config.axis import Rule, StrategyFacts, When

if TYPE_CHECKING:
    from ..config.param_bytes import ElementBytes
    from ..config.resolve import Config
    from ..runtime.optim import OptimizerSpec

__all__ = ["MemoryLevel"]


class MemoryLevel(Protocol):
    """A memory level. Subclass it: the defaults are those of the standard level (fp32 master weights, any
    optimizer, nothing done to the model)."""

    name: ClassVar[str]
    """What ``memory=`` takes to select the level."""
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

    def resolve(self, cfg: Config, facts: StrategyFacts) -> Config:
        """``cfg`` as this level runs it under a strategy with ``facts`` (the level may fix a dtype the strategy's
        engine uses); ``wrap_model`` calls it once after the combination check, before planning. Default: ``cfg``."""
        return cfg

    def check_optimizer(self, spec: OptimizerSpec | None) -> None:
        """Refuse (ValueError naming the way out), before anything changes, an optimizer ``spec`` (the one given to
        ``wrap_model``, or None) this level cannot build. Default: any spec."""

    def before_convert(self, model: nn.Module) -> None:
        """On the model as given, just before FP8 conversion (``wrap_model``'s step 5; e.g. cast its weights to bf16).
        Default: nothing."""

    def after_convert(self, model: nn.Module) -> None:
        """On the converted model, before activation checkpointing and sharding (the backend's new modules included).
        Default: nothing."""

    def build_optimizer(self, spec: OptimizerSpec, params: Iterable[nn.Parameter],
                        device: torch.device) -> torch.optim.Optimizer:
        """The optimizer from ``spec`` over the sharded model's ``params`` on ``device``; ``wrap_model`` calls it last,
        after sharding and the FP8 wiring (parameters have changed identity by then). Raises what
        :func:`fp8dist.runtime.optim.build_optimizer` raises for a bad spec. Default: that function."""
        from ..runtime.optim import build_optimizer

        return build_optimizer(spec, params)

    # accounting: what the memory estimate and the precision report ask
    fit_way_out: ClassVar[tuple[str, Mapping[str, object]] | None] = None
    """``(what, options)``: a way out the estimate tries when a rank does not fit its GPU; None: none."""
    report_master: ClassVar[str] = "n/a (the stored weight)"
    """The precision report's master-weight column where the engine keeps no master copy of its own."""

    def element_bytes(self, base: ElementBytes) -> ElementBytes:
        """Bytes per element of a parameter in each model-state category at this level; ``base``: the strategy's
        (weight, master, grad, states, dtypes). Asked by the estimate per parameter, before the backend's
        ``element_bytes``. Default: ``base``."""
        return base

    def local_state_bytes(self, numel: int) -> int:
        """Bytes of the level's own optimizer states for a local tensor of ``numel`` elements, beyond
        :meth:`element_bytes`; asked by the estimate per local tensor. Default: 0."""
        return 0
