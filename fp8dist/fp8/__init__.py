"""FP8 backends, one module each, behind the same small interface (module-level functions):

- ``NAME``; ``describe(cfg)`` one line for the plan header
- ``unavailable_reason(cfg, device) -> str | None``: not installed / no FP8 hardware (None: runs here)
- ``supports(module) -> bool``: the module types the backend replaces
- ``model_exclusions(model, cfg) -> {fqn: reason}``: model-level rules (torchao's first/last Linear)
- ``ineligible_reason(module, fqn, cfg) -> str | None``: per-layer rules (dims divisible by 16, ...)
- ``converted_class(module) -> str`` and ``computes_in_fp8(module) -> bool``: what the plan records
- ``check_plan(plan)``: refuse, before anything changes, a plan the backend cannot follow
- ``convert(model, plan, cfg)``: swap exactly the plan's converted modules; called before sharding
- ``after_shard(model, plan, cfg, env, group)``: FP8 autocast / hooks on the sharded model

Backend modules import their library only inside functions, so configs validate where it is not installed.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import nn

__all__ = ["get_backend", "dims_reason", "fp8_hardware_reason"]

_MODULES = {"torchao": "torchao", "te": "te", "msamp": "msamp"}


def get_backend(name: str) -> ModuleType:
    """The backend module for ``name`` ("torchao", "te", "msamp")."""
    return importlib.import_module(f"{__name__}.{_MODULES[name]}")


def dims_reason(module: nn.Linear) -> str | None:
    """FP8 GEMMs need both Linear dims divisible by 16; the reason when they are not."""
    bad = [f"{n}={getattr(module, n)}" for n in ("in_features", "out_features") if getattr(module, n) % 16]
    return f"{' and '.join(bad)} not divisible by 16 (FP8 GEMM tiles)" if bad else None


def fp8_hardware_reason(device: torch.device, *, min_capability: tuple[int, int] = (8, 9)) -> str | None:
    """None on a CUDA device with FP8 tensor cores (sm_89+ by default); else why not."""
    if device.type != "cuda":
        return f"needs a CUDA GPU with FP8 tensor cores (sm_{min_capability[0]}{min_capability[1]}+), device is " \
               f"{device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < min_capability:
        return (f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}; FP8 needs "
                f"sm_{min_capability[0]}{min_capability[1]}+")
    return None
