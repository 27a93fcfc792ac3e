"""FP8 backends, one module each, each a class that implements :class:`FP8Backend` (explicitly subclassing it,
so every hook it does not need is the Protocol's documented no-op). ``wrap_model`` calls the hooks in one fixed
order, the same for every backend:

    unavailable_reason (missing_reason, hardware_reason)
    -> (plan: supports, model_exclusions, ineligible_reason, converted_class, computes_in_fp8)
    -> check_plan -> convert -> before_shard (or deepspeed_entry under DeepSpeed) -> shard -> after_shard

A backend knows no sharding engine: the pipeline hands it the module to convert, the DeepSpeed entry point to use
and, after sharding, the user's model inside whatever wrapper the strategy made. Backend modules import their
library only inside methods, so configs validate where it is not installed.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from ..hardware import Hardware, hardware_of

__all__ = ["FP8Backend", "FP8Wiring", "NO_FP8", "get_backend", "BACKENDS", "dims_reason", "fp8_hardware_reason"]

BACKENDS = {"torchao": "torchao", "te": "te", "msamp": "msamp"}
"""Backend name -> module of fp8dist.fp8 that holds its class."""


@dataclass(frozen=True)
class FP8Wiring:
    """What a backend did to the sharded model after conversion, as data (``WrapInfo.fp8``): nothing reads it back
    from the modules' attributes or forwards."""

    autocast_recipe: Any = None
    """The recipe the forward runs under (Transformer Engine), or None."""
    amax_group: Any = None
    """The process group FP8 amax is reduced over, or None."""
    scale_precompute: bool = False
    """FP8 weight scales are recomputed after every optimizer step (torchao's FP8 all-gather)."""


class FP8Backend(Protocol):
    """The interface of an FP8 backend. Subclass it: the defaults below are the no-ops of a backend that needs no
    such step."""

    name: ClassVar[str]
    owns_optimizer: ClassVar[bool] = False
    """The backend builds the optimizer itself (in :meth:`before_shard`, from the optimizer spec)."""
    compile_refusal: ClassVar[str | None] = None
    """Why this backend's modules cannot run in torch.compile'd blocks; None: they can."""
    checkpointing_refusal: ClassVar[str | None] = None
    """Why this backend cannot run under torch's activation checkpointing; None: it can."""

    def describe(self, cfg: Any) -> str:
        """One line for the plan header (recipe, knobs)."""
        return ""

    def missing_reason(self, cfg: Any) -> str | None:
        """Why the backend's library cannot be used on this machine (not installed); None when it can."""
        return None

    def hardware_reason(self, cfg: Any, hardware: Hardware) -> str | None:
        """Why the backend cannot compute FP8 on ``hardware`` (no FP8 tensor cores); None when it can."""
        return fp8_hardware_reason(hardware)

    def unavailable_reason(self, cfg: Any, device: torch.device | Hardware, *, check_installed: bool = True) -> \
            str | None:
        """Why the backend cannot run on ``device``: :meth:`missing_reason` (skipped when ``check_installed`` is
        False: planning for another machine), then :meth:`hardware_reason`; None when it can. Backends override
        those two, not this."""
        missing = self.missing_reason(cfg) if check_installed else None
        return missing or self.hardware_reason(cfg, hardware_of(device))

    def supports(self, module: nn.Module) -> bool:
        """Whether the backend replaces modules of this type."""
        return type(module) is nn.Linear

    def converted_class(self, module: nn.Module, cfg: Any, hardware: Hardware) -> str:
        """What the plan records as the module's replacement (under ``cfg`` on ``hardware``: a recipe may name it)."""
        return type(module).__name__

    def computes_in_fp8(self, module: nn.Module) -> bool:
        """False for modules swapped without FP8 compute (TE's norms)."""
        return True

    def model_exclusions(self, model: nn.Module, cfg: Any) -> dict[str, str]:
        """Model-level rules: ``{fqn: reason}`` of modules kept in high precision (torchao's first/last Linear)."""
        return {}

    def ineligible_reason(self, module: nn.Module, fqn: str, cfg: Any, hardware: Hardware) -> str | None:
        """Per-layer rules: why this supported module cannot run FP8 on ``hardware`` (dims not divisible by 16,
        no grouped GEMM for MoE experts there), or None."""
        return dims_reason(module)

    def check_plan(self, plan: Any) -> None:
        """Refuse, before anything changes, a plan the backend cannot follow."""

    def convert(self, model: nn.Module, plan: Any, cfg: Any) -> None:
        """Swap exactly the plan's converted modules, in place (as planned for ``plan.hardware``); called before
        sharding."""

    def before_shard(self, model: nn.Module, optimizer: Any, cfg: Any) -> tuple[nn.Module, Any]:
        """After conversion, before sharding: ``(model, built optimizer or None)``; a backend that owns the
        optimizer (MS-AMP) builds it here from the optimizer spec."""
        return model, None

    def deepspeed_entry(self, cfg: Any) -> tuple[Mapping[str, Any], Callable[..., Any]] | None:
        """``(extra DeepSpeed config, initialize function)`` for a backend with its own DeepSpeed entry point."""
        return None

    def after_shard(self, model: nn.Module, inner: nn.Module, plan: Any, cfg: Any, group: Any) -> FP8Wiring:
        """On the sharded model: FP8 autocast, hooks. ``model`` is what the strategy returned (a wrapper, or the
        model itself), ``inner`` the user's model inside it; ``group`` the amax reduction group (None: the world
        group). Returns what was done."""
        return FP8Wiring()


@functools.cache
class _NoFP8(FP8Backend):
    """No FP8 (none asked for, or none possible here): every hook is the Protocol's no-op."""

    name = "none"


NO_FP8 = _NoFP8()


def get_backend(name: str) -> FP8Backend:
    """The backend for ``name`` ("torchao", "te", "msamp")."""
    module = importlib.import_module(f"{__name__}.{BACKENDS[name]}")
    return module.BACKEND


def dims_reason(module: nn.Linear) -> str | None:
    """FP8 GEMMs need both Linear dims divisible by 16; the reason when they are not."""
    bad = [f"{n}={getattr(module, n)}" for n in ("in_features", "out_features") if getattr(module, n) % 16]
    return f"{' and '.join(bad)} not divisible by 16 (FP8 GEMM tiles)" if bad else None


def fp8_hardware_reason(device: torch.device | Hardware, *, min_capability: tuple[int, int] = (8, 9)) -> str | None:
    """None on a CUDA device with FP8 tensor cores (sm_89+ by default); else why not."""
    hardware, need = hardware_of(device), f"sm_{min_capability[0]}{min_capability[1]}+"
    if hardware.type != "cuda":
        return f"needs a CUDA GPU with FP8 tensor cores ({need}), device is {hardware.type}"
    if hardware.capability < min_capability:
        return f"this FP8 recipe needs {need}, not {hardware}" if min_capability > (8, 9) else \
            f"{hardware} has no FP8 tensor cores: FP8 needs {need}"
    return None
