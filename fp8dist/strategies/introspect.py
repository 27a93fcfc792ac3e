"""Which engine wrapped a model, read from the engine's own objects, and where a model was already wrapped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .deepspeed import is_deepspeed_engine

__all__ = ["engine_of", "Wrapping", "find_wrapping", "mark_wrapped"]

_WRAPPED_ATTR = "_fp8dist_wrapped_by"  # the strategy's name, on every module of what wrap_model returned
_ENGINE_NAMES = {"ddp": "wrapped in DistributedDataParallel (DDP)",
                 "fsdp1": "wrapped in FullyShardedDataParallel (FSDP1)",
                 "fsdp": "sharded by fully_shard (FSDP2)",
                 "deepspeed": "a DeepSpeed engine (deepspeed.initialize)"}
# a parameter sharded or held by an engine whose wrapper is not in the model
_PARAMETER_STATES = {"dtensor": "a DTensor (sharded by hand: fully_shard or tensor parallel)",
                     "deepspeed_param": "held by DeepSpeed (deepspeed.initialize or zero.Init by hand)"}
# set by DeepSpeed on the parameters it holds: ZeRO-3's partition id, ZeRO-1/2's link to its fp32 master (0.19)
_DEEPSPEED_PARAM_ATTRS = ("ds_id", "_hp_mapping")


def engine_of(module: Any) -> str | None:
    """The engine that wrapped or sharded ``module`` itself: "deepspeed", "fsdp1", "fsdp", "ddp"; None: none."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if is_deepspeed_engine(module):
        return "deepspeed"
    engines = {"fsdp1": FullyShardedDataParallel, "fsdp": FSDPModule, "ddp": DistributedDataParallel}
    return next((name for name, cls in engines.items() if isinstance(module, cls)), None)


@dataclass(frozen=True)
class Wrapping:
    """Where a model was already wrapped or sharded, and by what (:func:`find_wrapping`)."""

    where: str  # the module's (or parameter's) name in the model given; "" for the model itself
    engine: str
    """An :func:`engine_of` name, "dtensor" or "deepspeed_param" (a parameter sharded or held by hand), or
    "fp8dist" (returned by wrap_model, with its ``strategy``)."""
    strategy: str | None = None

    def describe(self, model: nn.Module) -> str:
        """E.g. "model.layers.0 (FSDPLlamaDecoderLayer) of LlamaForCausalLM is already sharded by fully_shard"."""
        if self.engine in _PARAMETER_STATES:
            return f"parameter {self.where!r} of {type(model).__name__} is already {_PARAMETER_STATES[self.engine]}"
        what = (f"the model given ({type(model).__name__})" if not self.where else
                f"{self.where} ({type(model.get_submodule(self.where)).__name__}) of {type(model).__name__}")
        if self.engine == "fp8dist":
            return f"{what} is already wrapped by fp8dist.wrap_model (strategy={self.strategy!r})"
        return f"{what} is already {_ENGINE_NAMES[self.engine]}"


def mark_wrapped(model: nn.Module, strategy: str) -> None:
    """Mark every module of what ``wrap_model`` returned as wrapped by ``strategy``: a DDP or DeepSpeed model's
    inner module carries no engine state, yet wrapping it again would put a second engine over its parameters."""
    for module in model.modules():
        setattr(module, _WRAPPED_ATTR, strategy)


def find_wrapping(model: nn.Module) -> Wrapping | None:
    """The first module of ``model`` (itself included) that an engine or ``wrap_model`` already wrapped or sharded,
    else the first parameter sharded by hand; None: ``model`` is as built."""
    for name, module in model.named_modules():
        strategy = getattr(module, _WRAPPED_ATTR, None)
        if strategy is not None:
            return Wrapping(name, "fp8dist", strategy)
        engine = engine_of(module)
        if engine is not None:
            return Wrapping(name, engine)
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            return Wrapping(name, "dtensor")
        if any(hasattr(param, attr) for attr in _DEEPSPEED_PARAM_ATTRS):
            return Wrapping(name, "deepspeed_param")
    return None
