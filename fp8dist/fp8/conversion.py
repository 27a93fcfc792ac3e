"""The conversion role of an FP8 backend (:class:`Conversion`): what ``wrap_model`` asks of it, in its order — the
rules (step 2), whether it runs here (step 2), which layers it can take (step 3, the plan), the plan check, the
conversion itself (step 6, before sharding), its steps inside the strategy's sharding (step 8) and its wiring of the
sharded model (step 9) — with the records of that wiring and the eligibility checks every backend shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from ..config.axis import Rule, StrategyFacts
from ..runtime.hardware import Hardware, hardware_of
from .conv1d import conv1d_dims, is_conv1d
from .linear import plain_linear_reason

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ..config.resolve import Config
    from ..plan.precision import PrecisionPlan
    from ..runtime.optim import OptimizerSpec

__all__ = ["Conversion", "FP8Wiring", "EngineHooks", "linear_reason", "dims_reason", "fp8_hardware_reason"]


@dataclass(frozen=True)
class FP8Wiring:
    """What a backend did to the sharded model after conversion, as data (``WrapInfo.fp8``)."""

    autocast_recipe: object | None = None
    """The recipe the forward runs under (Transformer Engine's recipe object), or None."""
    amax_group: ProcessGroup | None = None
    """The process group FP8 amax is reduced over, or None."""
    scale_precompute: bool = False
    """FP8 weight scales are recomputed after every optimizer step (torchao's FP8 all-gather)."""


@dataclass(frozen=True)
class EngineHooks:
    """A backend's own steps inside the strategy's sharding, handed over as data (the strategy runs them)."""

    prepare: Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer | None]] | None = None
    """On the filled, unwrapped model before the engine wraps it; returns the model and the optimizer it built."""
    entry: tuple[Mapping[str, object], Callable[..., tuple[object, ...]]] | None = None
    """``(extra engine config, initialize)``: the backend's entry into an engine that builds the optimizer (MS-AMP's
    ``msamp.deepspeed.initialize`` in place of ``deepspeed.initialize``, taking the same arguments)."""


class Conversion(Protocol):
    """The conversion role: how a backend checks, plans and converts a model and wires the sharded one. Every hook
    has the default of a backend without that step; :class:`~fp8dist.fp8.base.FP8Backend` composes it."""

    name: ClassVar[str]
    package: ClassVar[str | None] = None
    """The library whose modules the backend swaps in: a model given to ``wrap_model`` holding one of its modules was
    converted by hand and is refused; the commands quiet its loggers on a CPU; the version records list it."""
    rules: ClassVar[tuple[Rule, ...]] = ()
    """What this backend refuses to combine with (its rows of the combination table), checked by ``wrap_model``'s
    step 2, the CLI, the estimate and the bench before anything changes."""
    owns_optimizer: ClassVar[bool] = False
    """The backend builds the optimizer itself (in :attr:`EngineHooks.prepare`, from the optimizer spec):
    ``wrap_model`` then needs an optimizer spec and returns the optimizer the backend built."""
    takes_amax_group: ClassVar[bool] = False
    """The backend reduces FP8 amax over a process group the user may choose (``fp8_group=``, handed to
    :meth:`after_shard`); False: a ``fp8_group`` given has no effect, and ``wrap_model`` warns so."""
    meta_model_refusal: ClassVar[str | None] = None
    """Why the backend cannot convert a meta-device model (``wrap_model`` raises ValueError with it); None: it can."""

    def missing_reason(self, cfg: Config | None) -> str | None:
        """Why the backend's library cannot be used on this machine (not installed, built wrong), the install
        command in it; None when it can. ``cfg``: the resolved Config, None when asked of the backend's defaults
        (the commands choosing their default backend). Called through :meth:`unavailable_reason`."""
        return None

    def hardware_reason(self, cfg: Config | None, hardware: Hardware) -> str | None:
        """Why the backend cannot compute FP8 on ``hardware`` under ``cfg`` (None: its defaults), with the way out;
        None when it can. Default: :func:`fp8_hardware_reason` (a CUDA GPU of sm_89+). Called through
        :meth:`unavailable_reason`, also for a planned target (``fp8dist plan --target h100``)."""
        return fp8_hardware_reason(hardware)

    def unavailable_reason(self, cfg: Config | None, device: torch.device | Hardware, *,
                           check_installed: bool = True) -> str | None:
        """:meth:`missing_reason` (unless ``check_installed`` is False: planning for another machine), then
        :meth:`hardware_reason` on ``device``'s hardware record; None when the backend can run there. The plan
        (``wrap_model``'s step 3, ``plan``, ``estimate``) calls it once per model; a backend overrides those two,
        not this one."""
        return (check_installed and self.missing_reason(cfg)) or self.hardware_reason(cfg, hardware_of(device))

    def supports(self, module: nn.Module) -> bool:
        """Whether the backend replaces modules of ``module``'s kind; the plan asks it of every module and judges
        each one it supports (:meth:`ineligible_reason`). Default: any ``nn.Linear``."""
        return isinstance(module, nn.Linear)

    def converted_class(self, module: nn.Module, cfg: Config, hardware: Hardware) -> str:
        """What the plan records as ``module``'s replacement under ``cfg`` on ``hardware`` (``PlanEntry.converted_to``,
        shown in the plan table). Default: the module's own class name."""
        return type(module).__name__

    def computes_in_fp8(self, module: nn.Module) -> bool:
        """Whether a supported ``module`` runs FP8 GEMMs once converted; False for modules swapped without FP8
        compute (TE's norms), which the plan converts but neither counts nor predicts. Default: True."""
        return True

    def model_exclusions(self, model: nn.Module, cfg: Config) -> dict[str, str]:
        """Model-level rules, asked once per plan before the per-layer ones: ``{fqn: reason}`` of modules kept in high
        precision (torchao's first/last Linear, MoE routers, tied weights). Default: none."""
        return {}

    def ineligible_reason(self, module: nn.Module, fqn: str, cfg: Config, hardware: Hardware,
                          facts: StrategyFacts) -> str | None:
        """Per-layer rules, asked by the plan of each supported module not excluded before: why ``module`` (at
        ``fqn``) cannot run FP8 on ``hardware`` under ``cfg`` and the strategy's ``facts``; None when it can.
        Default: :func:`linear_reason`."""
        return linear_reason(module)

    def check_plan(self, plan: PrecisionPlan) -> None:
        """Refuse (ValueError, with the way out), before anything changes, a ``plan`` the backend cannot follow
        (MS-AMP converts every Linear or none). ``wrap_model`` and the estimate call it after planning. Default:
        every plan is followed."""

    def convert(self, model: nn.Module, plan: PrecisionPlan, cfg: Config) -> None:
        """Swap exactly ``plan``'s converted modules of ``model``, in place, as planned for ``plan.hardware`` (each
        FP8 entry as :meth:`~fp8dist.fp8.advice.PlanAdvice.layer_config` configures it). ``wrap_model`` calls it at
        step 6, on the unsharded model after ``memory.before_convert``, before activation checkpointing, compile
        and sharding. Raises where a planned layer cannot be converted after all. Default: nothing to swap."""

    def engine_hooks(self, optimizer: OptimizerSpec | None, cfg: Config, facts: StrategyFacts) -> EngineHooks:
        """The backend's own steps inside the strategy's sharding (step 8), as data the strategy runs: a backend that
        owns the optimizer builds it there from ``optimizer`` (the spec given to ``wrap_model``, or None). Called
        once, after conversion and blocks, before the strategy shards. Default: no steps."""
        return EngineHooks()

    def after_shard(self, model: nn.Module, inner: nn.Module, plan: PrecisionPlan, cfg: Config,
                    group: ProcessGroup | None) -> FP8Wiring:
        """Wire the sharded model (FP8 autocast, scale hooks) at ``wrap_model``'s step 9: ``model`` is what the
        strategy returned, ``inner`` the user's model inside it, ``group`` the amax reduction group (None: the world
        group). Returns what was done, recorded as ``WrapInfo.fp8``. Default: nothing wired."""
        return FP8Wiring()

    def runs_held_fp8(self, cfg: Config) -> bool:
        """Whether the frozen Linears it converts under ``cfg`` multiply with e4m3 bits given to them (a LoRA base
        loaded in FP8: :mod:`fp8dist.pipeline.fp8_base`, the bits on the weight, their scale beside); asked before a
        base held in FP8 is loaded. Default: False (such a base is dequantized into high precision)."""
        return False


def linear_reason(module: nn.Linear) -> str | None:
    """Why an ``nn.Linear`` (of any class) cannot run as an FP8 Linear (its math, its dims); None when it can."""
    return plain_linear_reason(module) or dims_reason(module)


def dims_reason(module: nn.Module, multiple: int = 16, why: str = "FP8 GEMM tiles") -> str | None:
    """Why a Linear's (or GPT-2 Conv1D's) dims do not suit an FP8 GEMM (both divisible by ``multiple``); None: they
    do."""
    dims = conv1d_dims(module) if is_conv1d(module) else (module.in_features, module.out_features)
    bad = [f"{n}={d}" for n, d in zip(("in_features", "out_features"), dims) if d % multiple]
    return f"{' and '.join(bad)} not divisible by {multiple} ({why})" if bad else None


def fp8_hardware_reason(device: torch.device | Hardware, *, min_capability: tuple[int, int] = (8, 9)) -> str | None:
    """None on a CUDA device with FP8 tensor cores (sm_89+ by default); else why not."""
    hardware, need = hardware_of(device), f"sm_{min_capability[0]}{min_capability[1]}+"
    if hardware.type != "cuda":
        return f"needs a CUDA GPU with FP8 tensor cores ({need}), device is {hardware.type}"
    if hardware.capability < min_capability:
        return f"this FP8 recipe needs {need}, not {hardware}" if min_capability > (8, 9) else \
            f"{hardware} has no FP8 tensor cores: FP8 needs {need}"
    return None
