"""Sharding strategies, one module each implementing :class:`~fp8dist.strategies.base.Strategy`. Their ``apply_*``
functions take explicit dtypes and devices, not the whole config, so they can be used on their own."""

from __future__ import annotations

from torch import nn

from ..config.axis import STRATEGIES
from .base import Sharded, ShardingInfo, ShardJob, Strategy
from .common import cast_buffers, find_blocks
from .ddp import STRATEGY as _DDP, apply_ddp
from .deepspeed import STRATEGY as _DEEPSPEED, build_deepspeed_config, is_deepspeed_engine, zero_config
from .fsdp import STRATEGY as _FSDP2, apply_fsdp, build_fsdp_policy, fsdp_mesh
from .fsdp1 import STRATEGY as _FSDP1, apply_fsdp1, build_fsdp1_policy
from .introspect import engine_of
from .single import STRATEGY as _SINGLE, apply_single

__all__ = ["STRATEGIES", "get_strategy", "register_strategy", "Strategy", "ShardJob", "Sharded", "ShardingInfo",
           "unwrap_model", "build_fsdp_policy", "build_fsdp1_policy", "find_blocks", "zero_config",
           "build_deepspeed_config", "is_deepspeed_engine", "apply_fsdp", "apply_fsdp1", "apply_ddp", "apply_single",
           "fsdp_mesh", "cast_buffers"]


def register_strategy(strategy: Strategy) -> Strategy:
    """Make ``strategy`` (an instance of a :class:`Strategy` subclass) what ``strategy=<its name>`` selects, in
    ``wrap_model``, config files, the CLI's choices, the plan, the estimate and the bench; returns it."""
    return STRATEGIES.register(strategy, Strategy)


for _builtin in (_SINGLE, _DDP, _FSDP2, _FSDP1, _DEEPSPEED):  # the order choices are listed in
    register_strategy(_builtin)


def get_strategy(name: str) -> Strategy:
    """The strategy ``strategy=name`` selects (names are validated by the config)."""
    return STRATEGIES[name]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside what :func:`fp8dist.wrap_model` returned: the ``.module`` of DDP, FSDP1 and the
    DeepSpeed engine; the model itself under FSDP2 (sharded in place) and strategy "none"."""
    if engine_of(model) in ("ddp", "fsdp1", "deepspeed"):  # the wrappers (fully_shard shards in place)
        return model.module
    return model

