"""The interface of an FP8 backend (:class:`FP8Backend`): the composition of five small roles, each with the
defaults of a backend without that step, each in its own module —

- :class:`~.conversion.Conversion`: rules, availability, which layers it takes, ``convert`` (before sharding),
  ``engine_hooks`` (inside the strategy's sharding), ``after_shard`` (on the sharded model);
- :class:`~.advice.PlanAdvice`: the plan header, speed recipes, per-layer recipes, the casts the numerics probe
  emulates;
- :class:`~.costs.Accounting`: the bytes and formats the memory estimate and the precision report read;
- :class:`~.state.CheckpointHooks`: what checkpoints can hold and what to recompute after a load;
- :class:`~.tooling.Tooling`: what the commands, the bench, the Accelerate translator and the FP8 health telemetry
  ask.

A backend subclasses :class:`FP8Backend` and overrides what it does; ``register_backend`` makes ``fp8=<name>`` select
it. The records and shared checks of those roles are re-exported here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Protocol

from torch import nn

from ..config.axis import StrategyFacts, When
from .advice import SELECTION_OPTIONS, PlanAdvice
from .conversion import Conversion, EngineHooks, FP8Wiring, dims_reason, fp8_hardware_reason, linear_reason
from .costs import Accounting, FrozenWeights
from .state import CheckpointHooks
from .tooling import HandConverted, HealthCasts, Tooling

__all__ = ["FP8Backend", "FP8Wiring", "EngineHooks", "HandConverted", "FrozenWeights", "HealthCasts", "NO_FP8",
           "SELECTION_OPTIONS", "Conversion", "PlanAdvice", "Accounting", "CheckpointHooks", "Tooling",
           "dims_reason", "linear_reason", "fp8_hardware_reason"]


class FP8Backend(Conversion, PlanAdvice, Accounting, CheckpointHooks, Tooling, Protocol):
    """The interface of an FP8 backend: its name, its knobs and the five roles it composes. Subclass it (the
    registry checks the subclass): every hook defaults to the no-op of a backend without that step.

    ``wrap_model`` calls the hooks in one order: ``rules`` and ``unavailable_reason`` (step 2), the plan's hooks
    (``model_exclusions``, ``supports``, ``ineligible_reason``, ``converted_class``, ``speed_recipe`` /
    ``mixed_recipes`` and ``read_weight_gather``: step 3), ``check_plan``, ``convert`` (step 6), ``engine_hooks``
    (step 8, the strategy runs them), ``after_shard`` (step 9). ``plan_precision`` and ``fp8dist plan`` call the
    plan's hooks only; ``estimate_memory`` those and the accounting role; ``measure_fp8_numerics`` the plan's,
    ``layer_config`` and ``numerics_casts``."""

    name: ClassVar[str]
    """What ``fp8=`` takes to select the backend (not "none")."""
    options: ClassVar[Mapping[str, When]] = {}
    """Options it reads beyond its ``Config``, each with the ``When`` it is read under (set but unread: reported)."""
    Config: ClassVar[type | None] = None
    """A frozen kw-only dataclass of the knobs this backend owns (typed, defaulted, a docstring under each): flat keys
    of ``wrap_model``, files, flags and ``cfg.precision``, read as ``cfg.precision.knobs(name)``. Field metadata:
    ``when`` (:class:`~fp8dist.config.axis.When` it is read under), ``min``, ``refused``, ``aliases``. None: none."""


class _NoFP8(FP8Backend):
    """No FP8: every hook is the default; the bench's hand-wired cell converts nothing."""

    name = "none"

    def convert_by_hand(self, model: nn.Module, facts: StrategyFacts) -> HandConverted:
        """Nothing to convert: the bench's hand-wired reference without FP8."""
        return HandConverted()


NO_FP8 = _NoFP8()
"""No FP8 (none asked for, or none possible here): every hook is the Protocol's no-op."""
