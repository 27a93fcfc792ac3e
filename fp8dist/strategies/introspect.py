"""What a wrapped model's engine computes and communicates in, read from the engine's own objects: FSDP2's
``MixedPrecisionPolicy``, FSDP1's ``MixedPrecision``, DDP's registered comm hook, DeepSpeed's config accessors.
The one place that knows where each engine keeps them (sharding summaries and the precision report both read it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .deepspeed import is_deepspeed_engine

__all__ = ["EngineDtypes", "engine_dtypes", "ddp_reduce_dtype"]


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
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if is_deepspeed_engine(model):
        compute = torch.bfloat16 if model.bfloat16_enabled() else torch.float16 if model.fp16_enabled() else None
        return EngineDtypes("deepspeed", compute, model.communication_data_type,
                            zero_stage=model.zero_optimization_stage())
    if isinstance(model, FullyShardedDataParallel):
        mp = model.mixed_precision
        return EngineDtypes("fsdp1", mp.param_dtype, mp.reduce_dtype or mp.param_dtype)
    state = getattr(model, "_get_fsdp_state", None)
    if state is not None:
        policy = state()._mp_policy
        return EngineDtypes("fsdp", policy.param_dtype, policy.reduce_dtype or policy.param_dtype)
    if isinstance(model, DistributedDataParallel):
        reduce, hook = ddp_reduce_dtype(model)
        return EngineDtypes("ddp", autocast, reduce, reduce_hook=hook)
    return EngineDtypes("none", autocast, None)
