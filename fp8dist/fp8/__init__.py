"""FP8 backends, one module each, each an :class:`FP8Backend` subclass composing five roles (conversion, plan
advice, accounting, checkpoint state, tooling: :mod:`.base`). ``wrap_model`` calls the hooks in one order: rules,
unavailable_reason, the plan's hooks, check_plan, convert, engine_hooks, (the strategy shards), after_shard.
A backend knows no sharding engine (it reads ``plan.facts``) and imports its library only inside methods. Importing
this package imports no engine: the built-ins' names and knobs (``Config``) are known before torch is imported."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config.axis import BACKENDS
from ..config.lazy import lazy_names
from .msamp_config import MSAMPConfig
from .te_config import TEConfig
from .torchao_config import TorchaoConfig

if TYPE_CHECKING:
    from torch import nn

    from .base import FP8Backend

__all__ = ["FP8Backend", "FP8Wiring", "EngineHooks", "HealthCasts", "NO_FP8", "get_backend", "register_backend",
           "BACKENDS", "SELECTION_OPTIONS", "dims_reason", "linear_reason", "fp8_hardware_reason", "converted_by_hand",
           "register_builtins"]


def register_builtins() -> None:
    """Register fp8dist's backends (te, torchao, msamp), each imported when first chosen; its knobs and the bench's
    variant options (variant_option, then more_variant_options) known before, checked against its own on import.
    :data:`BACKENDS` calls it through the ``fp8dist.fp8_backends`` entry point when first read."""
    for name, knobs, variants in (("te", TEConfig, ()), ("torchao", TorchaoConfig, ("torchao_recipe", "torchao_api")),
                                  ("msamp", MSAMPConfig, ())):
        BACKENDS.register_module(name, f"{__name__}.{name}", "BACKEND", Config=knobs,
                                 variant_option=next(iter(variants), None), more_variant_options=variants[1:])


def _load() -> dict[str, Any]:
    """The names of :mod:`.base` (it imports torch), imported when first read."""
    from .base import (NO_FP8, SELECTION_OPTIONS, EngineHooks, FP8Backend, FP8Wiring, HealthCasts, dims_reason,
                       fp8_hardware_reason, linear_reason)

    return locals()


def register_backend(backend: FP8Backend) -> FP8Backend:
    """Make ``backend`` (an instance of an :class:`FP8Backend` subclass) what ``fp8=<its name>`` selects
    everywhere (``wrap_model``, config files, the CLI, the plan, the estimate, the bench); returns it."""
    from .base import FP8Backend

    return BACKENDS.register(backend, FP8Backend)


def get_backend(name: str | None) -> FP8Backend:
    """The backend ``fp8=name`` selects (names are validated by the config); None or "none": :data:`NO_FP8`."""
    from .base import NO_FP8

    return NO_FP8 if name in (None, NO_FP8.name) else BACKENDS[name]


def converted_by_hand(model: nn.Module) -> tuple[str, str, str] | None:
    """The first module of ``model`` whose class comes from an FP8 backend's library (converted before
    ``wrap_model``, or built from that library's layers): ``(name, backend, class name)``; None: there is none."""
    packages = {get_backend(name).package: name for name in BACKENDS}
    for fqn, module in model.named_modules():
        library = type(module).__module__.partition(".")[0]
        if library in packages:
            return fqn, packages[library], type(module).__name__
        for pname, param in module.named_parameters(recurse=False):  # a weight wrapped in place (torchao's quantize_)
            library = type(param).__module__.partition(".")[0]
            if library in packages:
                return f"{fqn}.{pname}" if fqn else pname, packages[library], type(param).__name__
    return None


__getattr__ = lazy_names(globals(), _load)
