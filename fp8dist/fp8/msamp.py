"""MS-AMP: ``msamp.initialize(model, optimizer, opt_level)`` converts every nn.Linear and the Adam/AdamW optimizer
(under DeepSpeed ``msamp.deepspeed.initialize``), so wrap_model takes an optimizer spec and returns MS-AMP's. Written
against its documented API; it needs CUDA, so here only a stand-in tests the wiring, never proof that MS-AMP works."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch
from torch import nn

from ..config.axis import Rule, StrategyFacts
from ..runtime.hardware import Hardware
from ..runtime.optim import build_optimizer
from .base import EngineHooks, FP8Backend
from .msamp_config import MSAMPConfig


_RULES = (
    Rule(("fp8", "strategy"), lambda cfg, facts: facts.shards_params,
         "MS-AMP has no integration for FSDP's sharded parameters here"),
    Rule(("opt_level", "strategy"),
         lambda cfg, facts: cfg.precision.opt_level == "O3" and not facts.engine_builds_optimizer,
         "MS-AMP O3 is its ZeRO optimizer and runs only inside DeepSpeed's engine"),
    Rule(("compile", "fp8"), lambda cfg, facts: cfg.parallel.compile is True,
         "MS-AMP's ScalingTensor weights do not trace under torch.compile",
         "Use compile=False (or None: auto decides)."),
    Rule(("activation_checkpointing", "fp8"), lambda cfg, facts: cfg.parallel.activation_checkpointing != "none",
         "MS-AMP's FP8 weights and gradients are not verified under activation checkpointing",
         "Use activation_checkpointing='none'."),
)


class MSAMPBackend(FP8Backend):
    """MS-AMP (``fp8='msamp'``): its ``initialize`` converts the model and builds the optimizer (O1-O3); it cannot be
    installed on any current stack, so its wiring is tested through a stand-in only."""
    name = "msamp"
    package = "msamp"
    owns_optimizer = True
    rules = _RULES
    meta_model_refusal = ("MS-AMP converts real weights. Build the model on the CPU (with pretrained=, wrap_model "
                          "loads it there), or use fp8='torchao' / 'te'")

    def describe(self, cfg, facts: StrategyFacts) -> str:
        """The opt_level (O1-O3), for the plan header."""
        return f"opt_level {cfg.precision.opt_level}"

    def missing_reason(self, cfg) -> str | None:
        """Why MS-AMP cannot be used here: ``msamp`` not importable (it is built from its repository); None when it
        is."""
        if importlib.util.find_spec("msamp") is None:
            return ("MS-AMP is not installed (not on the package index: build it from its repository on a CUDA "
                    "machine)")

    def converted_class(self, module: nn.Module, cfg, hardware: Hardware) -> str:
        """"msamp FP8 Linear": ``msamp.initialize`` swaps each nn.Linear for its own."""
        return "msamp FP8 Linear"

    def check_plan(self, plan) -> None:
        """ValueError where the plan keeps an nn.Linear in high precision: ``msamp.initialize`` has no layer filter."""
        kept = [e.name for e in plan if e.module_type == "Linear" and e.converted_to is None]
        if kept:
            raise ValueError(
                f"fp8='msamp' converts every nn.Linear (msamp.initialize has no layer filter), but the plan keeps "
                f"{kept} in high precision. Use fp8='te' or 'torchao' for per-layer fallback, or remove the "
                "exclusion / make the dims multiples of 16.")

    def engine_hooks(self, optimizer, cfg, facts: StrategyFacts) -> EngineHooks:
        """``msamp.initialize`` before the engine wraps the model; an engine that builds the optimizer goes through
        the config's "msamp" block and ``msamp.deepspeed.initialize`` instead (O3: MS-AMP's FP8 ZeRO)."""
        if facts.engine_builds_optimizer:
            from msamp import deepspeed as msamp_deepspeed

            return EngineHooks(entry=({"msamp": {"enabled": True, "opt_level": cfg.precision.opt_level}},
                                      msamp_deepspeed.initialize))
        return EngineHooks(prepare=lambda model: _initialize(model, optimizer, cfg.precision.opt_level))

    accelerate_backend = "MSAMP"

    checkpoint_refusal = ("MS-AMP's optimizer keeps ScalingTensor state that fp8dist cannot yet save safely. Use "
                          "fp8='te' or 'torchao', or MS-AMP's own checkpointing")

    derived_bytes = True
    saved_weight_bytes = 1

    def element_bytes(self, cfg, base, converted: bool, n_states: int):
        """MS-AMP's precision chart: converted weights FP16 (O3: FP8 with an FP16 master), FP8 gradients; O2/O3 Adam
        states FP8 + FP16 for every parameter."""
        level = cfg.precision.opt_level
        states, state_name = (base.states, base.dtypes[3]) if level == "O1" or n_states != 2 else (3, "fp8/fp16")
        if not converted:
            return dataclasses.replace(base, states=states, dtypes=base.dtypes[:3] + (state_name,))
        if level == "O3":
            return dataclasses.replace(base, weight=1, master=2, grad=1, states=states,
                                       dtypes=("fp8", "fp16", "fp8", state_name))
        return dataclasses.replace(base, weight=2, master=0, grad=1, states=states,
                                   dtypes=("fp16", "none", "fp8", state_name))

    def fp8_state_bytes(self, cfg, plan) -> int:
        """A ScalingMeta (scale, scale_inv and a 1-long amax window, fp32: 12 bytes) for each of the weight, input,
        wgrad and ograd of every converted Linear."""
        return 4 * 12 * sum(not e.grouped for e in plan.fp8)

    Config = MSAMPConfig


def _initialize(model: nn.Module, optimizer: Any, opt_level: str) -> tuple[nn.Module, Any]:
    import msamp

    built = build_optimizer(optimizer, model.parameters())
    if not isinstance(built, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"fp8='msamp' needs torch.optim.Adam or AdamW (MS-AMP swaps it for its own), got "
                         f"{type(built).__name__}.")
    return msamp.initialize(model, built, opt_level=opt_level)


BACKEND = MSAMPBackend()
"""The MS-AMP backend ``fp8='msamp'`` selects (registered by :func:`fp8dist.fp8.register_builtins`)."""
