"""MS-AMP: ``msamp.initialize(model, optimizer, opt_level)`` converts every nn.Linear to FP8 and the Adam/AdamW
optimizer to MS-AMP's (O1: FP8 weights and gradients; O2: also FP8/FP16 optimizer states). MS-AMP owns the
optimizer, so wrap_model takes an optimizer spec and returns the optimizer MS-AMP built. Under DeepSpeed it goes
through ``msamp.deepspeed.initialize`` with an "msamp" config block (O1/O2, and O3 with ZeRO).

Written against MS-AMP's documented API; MS-AMP is not on the package index and needs CUDA, so on CPU the wiring is
tested through a stand-in of that API, never counted as proof that MS-AMP works.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from . import dims_reason, fp8_hardware_reason

NAME = "msamp"


def describe(cfg) -> str:
    return f"opt_level {cfg.precision.opt_level}"


def unavailable_reason(cfg, device: torch.device) -> str | None:
    if importlib.util.find_spec("msamp") is None:
        return "MS-AMP is not installed (not on the package index: build it from its repository on a CUDA machine)"
    return fp8_hardware_reason(device)


def supports(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def converted_class(module: nn.Module) -> str:
    return "msamp FP8 Linear"


def computes_in_fp8(module: nn.Module) -> bool:
    return True


def model_exclusions(model: nn.Module, cfg) -> dict[str, str]:
    return {}


def ineligible_reason(module: nn.Module, fqn: str, cfg) -> str | None:
    return dims_reason(module)


def convert(model: nn.Module, plan, cfg) -> None:
    """Nothing to do before the optimizer exists: :func:`initialize` converts."""


def check_plan(plan) -> None:
    """Refuse a plan MS-AMP cannot follow: ``msamp.initialize`` converts every nn.Linear, with no layer filter."""
    kept = [e.name for e in plan if e.module_type == "Linear" and e.converted_to is None]
    if kept:
        raise ValueError(
            f"fp8='msamp' converts every nn.Linear (msamp.initialize has no layer filter), but the plan keeps "
            f"{kept} in high precision. Use fp8='te' or 'torchao' for per-layer fallback, or remove the exclusion "
            "/ make the dims multiples of 16.")


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, cfg) -> tuple[nn.Module, Any]:
    """``msamp.initialize`` on the unwrapped model and its Adam/AdamW optimizer; before DDP."""
    import msamp

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"fp8='msamp' needs torch.optim.Adam or AdamW (MS-AMP swaps it for its own), got "
                         f"{type(optimizer).__name__}.")
    return msamp.initialize(model, optimizer, opt_level=cfg.precision.opt_level)


def deepspeed_hooks(cfg) -> tuple[dict, Any]:
    """Under DeepSpeed, MS-AMP goes through its own entry point: the config's "msamp" block and
    ``msamp.deepspeed.initialize`` (O3 is MS-AMP's FP8 ZeRO optimizer)."""
    from msamp import deepspeed as msamp_deepspeed

    return {"msamp": {"enabled": True, "opt_level": cfg.precision.opt_level}}, msamp_deepspeed.initialize


def after_shard(model: nn.Module, plan, cfg, env, group) -> None:
    """MS-AMP needs nothing after DDP wrapping."""
