"""The plan-advice role of an FP8 backend (:class:`PlanAdvice`): what the plan's advisors ask of it — the header
line, its speed recipes (the speed model's ``fp8_select="auto"``), the recipe each layer runs, how it casts each
operand (the numerics probe's emulation) — never testing its name."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol

from ..config.axis import BACKENDS, StrategyFacts, When
from ..runtime.hardware import Hardware
from .casts import Casts
from .speed_recipe import Recipe

if TYPE_CHECKING:
    from ..config.resolve import Config
    from ..plan.precision import PlanEntry

__all__ = ["PlanAdvice", "SELECTION_OPTIONS", "backends_with_casts"]

SELECTION_OPTIONS: Mapping[str, When] = {"fp8_select": When(), "micro_batch_size": When(), "seq_len": When(),
                                         "fp8_select_margin": When({"fp8_select": (None, "auto")})}
"""The ``options`` the plan's choice of FP8 layers by predicted speed reads, in every backend the speed model covers."""


class PlanAdvice(Protocol):
    """The plan-advice role: what ``plan_precision`` (``wrap_model``'s step 3, ``fp8dist plan``, the estimate), the
    speed model and the numerics probe ask a backend. Every hook has the default of a backend without a speed model
    or a cast model; :class:`~fp8dist.fp8.base.FP8Backend` composes it."""

    name: ClassVar[str]
    speed_recipes: ClassVar[tuple[Recipe, ...]] = ()
    """The recipes this backend runs, as the speed model sees them (:class:`~fp8dist.fp8.speed_recipe.Recipe`: which
    GEMMs run in FP8, the cast kernels of each operand): its Linears' (``plan --compare-recipes`` compares them) and,
    ``grouped=True``, its MoE experts'. The speed model (``fp8dist.plan.speed.RECIPES``) reads every registered
    backend's; a name must be unique among them. :meth:`speed_recipe` names the one a config runs; a backend with
    recipes reads :data:`SELECTION_OPTIONS` (put them in its ``options``). Empty: no speed model."""
    variant_option: ClassVar[str | None] = None
    """The option naming the recipe a layer runs (``torchao_recipe``): a layer's own recipe
    (``PlanEntry.recipe``) is set in it by :meth:`layer_config`, and the bench runs each of its values as a cell of
    its own. None: one recipe per model, one bench cell."""

    def describe(self, cfg: Config, facts: StrategyFacts) -> str:
        """One line for the plan header (recipe, knobs) under ``cfg`` and a strategy with ``facts``; called once per
        plan. Default: empty (the header names the backend only)."""
        return ""

    def read_weight_gather(self, reader: str, cfg: Config, facts: StrategyFacts) -> str | None:
        """How an FP8 layer whose weight ``reader`` reads outside its GEMM (PEFT's DoRA weight norm) is all-gathered
        instead of the backend's FP8 all-gather, and why; None: as any other. The plan calls it per such layer under
        ``cfg`` and ``facts`` and records the answer as ``PlanEntry.high_precision_gather``."""
        return None

    def speed_recipe(self, cfg: Config, hardware: Hardware, *, grouped: bool = False) -> tuple[str | None, str]:
        """``(recipe name, "")``: the :attr:`speed_recipes` entry the Linears (``grouped``: the MoE experts) run under
        ``cfg`` on ``hardware``; ``(None, why not)``: no prediction, they convert as under ``fp8_select='all'`` and
        the plan says why. Asked by the plan's selection (``fp8_select="auto"``), the tail rule and the step-time
        prediction. Default: ``(None, "fp8=<name> has no speed model")``."""
        return None, f"fp8={self.name!r} has no speed model"

    def mixed_recipes(self, cfg: Config, hardware: Hardware, facts: StrategyFacts) -> tuple[str, ...]:
        """The speed model's recipes the plan picks among per layer (the fastest predicted; the strategy's precision
        where none pays) when ``cfg`` asks for it: those the backend can run side by side in one model on
        ``hardware`` under ``facts``; the first is every eligible layer's where nothing is predicted (a CPU). Empty:
        one recipe for the model (:meth:`speed_recipe`). Default: empty."""
        return ()

    def layer_config(self, cfg: Config, entry: PlanEntry) -> Config:
        """``cfg`` as the plan ``entry``'s layer runs: its own recipe (``PlanEntry.recipe``) in :attr:`variant_option`
        (``cfg`` itself where it has none); call it for each FP8 entry before converting, costing or probing it."""
        recipe = entry.recipe
        if recipe is None:
            return cfg
        return dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, **{self.variant_option: recipe}))

    def numerics_casts(self, cfg: Config, facts: StrategyFacts, hardware: Hardware, *, grouped: bool = False) -> Casts:
        """How the backend casts each operand of a layer's GEMMs under ``cfg`` (a layer's own: :meth:`layer_config`)
        on ``hardware`` (``grouped``: its MoE experts'): for every ``(operand, gemm)`` of
        :data:`~fp8dist.fp8.casts.USES`, a :class:`~fp8dist.fp8.casts.CastEmulation` — a
        :class:`~fp8dist.fp8.casts.CastSpec` of the built-in scalings, or an emulation of the backend's own — or
        None where that GEMM takes the operand in high precision. The numerics probe (``measure_fp8_numerics``)
        emulates them on a CPU per planned FP8 layer; the FP8 export reads the weight's. Raises
        NotImplementedError where the casts are not modelled (the default, naming the backends that are)."""
        raise NotImplementedError(f"fp8={self.name!r}: the numerics probe has no model of this backend's FP8 casts "
                                  f"({type(self).__name__}.numerics_casts is not implemented). Probe with "
                                  f"{' or '.join(f'fp8={n!r}' for n in backends_with_casts())}.")

    def numerics_note(self, cfg: Config) -> str:
        """What the probe's report says about how it emulated the backend's casts under ``cfg`` (what the emulation
        leaves out); empty: nothing to say. Default: empty."""
        return ""


def backends_with_casts() -> list[str]:
    """The registered backends whose casts the numerics probe models (their ``numerics_casts`` is their own), in
    registration order: what an error offers instead of a backend without a cast model."""
    return [name for name in BACKENDS
            if type(BACKENDS[name]).numerics_casts is not PlanAdvice.numerics_casts]
