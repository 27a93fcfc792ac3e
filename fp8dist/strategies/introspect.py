"""Which engine wrapped a model, and what it computes and communicates in, read from the engine's own objects:
the wrapper classes and FSDP2's module state (:func:`engine_of`), FSDP2's ``MixedPrecisionPolicy``, FSDP1's
``MixedPrecision``, DDP's registered comm hook, DeepSpeed's config accessors. The one place that knows where each
engine keeps them: ``unwrap_model``, the check of a model already wrapped (:func:`find_wrapping`: ``wrap_model``
and the numerics probe), sharding summaries and the precision report all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .deepspeed import is_deepspeed_engine

__all__ = ["EngineDtypes", "engine_dtypes", "ddp_reduce_dtype", "engine_of", "Wrapping", "find_wrapping",
           "mark_wrapped"]

_WRAPPED_ATTR = "_fp8dist_wrapped_by"
"""Set by :func:`mark_wrapped` on every module of what ``wrap_model`` returned: the strategy's name."""

_ENGINE_NAMES = {"ddp": "wrapped in DistributedDataParallel (DDP)",
                 "fsdp1": "wrapped in FullyShardedDataParallel (FSDP1)",
                 "fsdp": "sharded by fully_shard (FSDP2)",
                 "deepspeed": "a DeepSpeed engine (deepspeed.initialize)"}
"""What :func:`find_wrapping` says each engine did."""

_PARAMETER_STATES = {"dtensor": "a DTensor (sharded by hand: fully_shard or tensor parallel)",
                     "deepspeed_param": "held by DeepSpeed (deepspeed.initialize or zero.Init by hand)"}
"""What :func:`find_wrapping` says of a parameter sharded or held by an engine whose wrapper is not in the model."""

_DEEPSPEED_PARAM_ATTRS = ("ds_id", "_hp_mapping")
"""What DeepSpeed sets on the parameters it holds: ZeRO-3's partition id (``zero.Init``), the link to the fp32
master of ZeRO-1/2 and the bf16 optimizer (``link_hp_params``, DeepSpeed 0.19)."""


def engine_of(module: Any) -> str | None:
    """The engine that wrapped or sharded ``module`` itself: "deepspeed" (its engine), "fsdp1"
    (``FullyShardedDataParallel``), "fsdp" (``fully_shard``: an ``FSDPModule``), "ddp"; None: none did."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if is_deepspeed_engine(module):
        return "deepspeed"
    if isinstance(module, FullyShardedDataParallel):
        return "fsdp1"
    if isinstance(module, FSDPModule):
        return "fsdp"
    if isinstance(module, DistributedDataParallel):
        return "ddp"
    return None


@dataclass(frozen=True)
class Wrapping:
    """Where a model was already wrapped or sharded, and by what (:func:`find_wrapping`)."""

    where: str
    """The module's (or parameter's) name in the model given; "" for the model itself."""
    engine: str
    """"ddp", "fsdp1", "fsdp", "deepspeed", "dtensor" (a DTensor parameter: tensor parallel or fully_shard by
    hand), "deepspeed_param" (a parameter DeepSpeed holds: the inner module of an engine built by hand, or built
    under ``zero.Init``) or "fp8dist" (returned by wrap_model)."""
    strategy: str | None = None
    """The strategy ``wrap_model`` used (engine "fp8dist")."""

    def describe(self, model: nn.Module) -> str:
        """"model.layers.0 (FSDPLlamaDecoderLayer) of LlamaForCausalLM is already sharded by fully_shard (FSDP2)"."""
        if self.engine in _PARAMETER_STATES:
            how = _PARAMETER_STATES[self.engine]
            return f"parameter {self.where!r} of {type(model).__name__} is already {how}"
        what = (f"the model given ({type(model).__name__})" if not self.where else
                f"{self.where} ({type(model.get_submodule(self.where)).__name__}) of {type(model).__name__}")
        if self.engine == "fp8dist":
            return f"{what} is already wrapped by fp8dist.wrap_model (strategy={self.strategy!r})"
        return f"{what} is already {_ENGINE_NAMES[self.engine]}"


def mark_wrapped(model: nn.Module, strategy: str) -> None:
    """Mark every module of ``model`` (what ``wrap_model`` returned: its wrapper, the user's model inside, their
    submodules) as wrapped by ``strategy``: a DDP or DeepSpeed model's inner module carries no engine state of its
    own, yet wrapping it again would put a second engine over the same parameters."""
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


@dataclass(frozen=True)
class EngineDtypes:
    """The dtypes a wrapped model's engine uses."""

    engine: str
    """"fsdp" (FSDP2), "fsdp1", "ddp", "deepspeed" or "none"."""
    compute: torch.dtype | None
    """What high-precision GEMMs compute in (the cast or autocast dtype); None: the stored dtype."""
    reduce: torch.dtype | None
    """What gradients travel in when reduced; None: their own dtype (or nothing is reduced: "none")."""
    reduce_hook: str | None = None
    """A DDP comm hook that is not one of torch's compression hooks: it decides the reduce dtype."""
    zero_stage: int | None = None
    """DeepSpeed's ZeRO stage."""


def ddp_reduce_dtype(ddp: nn.Module) -> tuple[torch.dtype | None, str | None]:
    """The dtype DDP's registered compression hook reduces in (``(None, None)`` without a hook: the gradients'
    own dtype), or ``(None, hook name)`` for a hook of the user's."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = [hook for hook, _state in getattr(ddp, "_comm_hooks", ())]  # DDP.register_comm_hook keeps them here
    if not hooks:
        return None, None
    compress = {default_hooks.bf16_compress_hook: torch.bfloat16, default_hooks.fp16_compress_hook: torch.float16}
    if hooks[-1] in compress:
        return compress[hooks[-1]], None
    return None, getattr(hooks[-1], "__qualname__", repr(hooks[-1]))


def engine_dtypes(model: Any, autocast: torch.dtype | None) -> EngineDtypes:
    """The engine dtypes of ``model`` as :func:`fp8dist.wrap_model` returned it; ``autocast`` is the dtype the
    strategy runs the forward under (``WrapInfo.sharding.autocast``: ddp, none)."""
    engine = engine_of(model)
    if engine == "deepspeed":
        compute = torch.bfloat16 if model.bfloat16_enabled() else torch.float16 if model.fp16_enabled() else None
        return EngineDtypes("deepspeed", compute, model.communication_data_type,
                            zero_stage=model.zero_optimization_stage())
    if engine == "fsdp1":
        mp = model.mixed_precision
        return EngineDtypes("fsdp1", mp.param_dtype, mp.reduce_dtype or mp.param_dtype)
    if engine == "fsdp":
        policy = model._get_fsdp_state()._mp_policy
        return EngineDtypes("fsdp", policy.param_dtype, policy.reduce_dtype or policy.param_dtype)
    if engine == "ddp":
        reduce, hook = ddp_reduce_dtype(model)
        return EngineDtypes("ddp", autocast, reduce, reduce_hook=hook)
    return EngineDtypes("none", autocast, None)
