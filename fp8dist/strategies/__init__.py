"""Strategies: how the model is replicated or sharded, each with its mixed-precision policy.

``apply_strategy`` is the single entry point ``wrap_model`` calls; the ``apply_*`` functions it dispatches to
take explicit dtypes and devices, not the whole config, so they can be used on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..config import StrategyConfig, torch_dtype
from ..env import DistEnv
from .common import cast_buffers, find_blocks
from .ddp import apply_ddp, apply_single
from .fsdp import apply_fsdp, apply_fsdp1, build_fsdp1_policy, build_fsdp_policy

__all__ = ["apply_strategy", "ShardingInfo", "build_fsdp_policy", "build_fsdp1_policy", "find_blocks"]

@dataclass(frozen=True)
class ShardingInfo:
    """What the strategy did: which blocks were sharded and how they were found."""

    strategy: str
    blocks: tuple[str, ...]
    blocks_found_by: str


def apply_strategy(model: nn.Module, cfg: StrategyConfig, env: DistEnv) -> tuple[nn.Module, ShardingInfo]:
    """Shard or replicate ``model`` as ``cfg`` says; returns the model to train and what was done."""
    param, reduce, buffer = (torch_dtype(d) for d in (cfg.param_dtype, cfg.reduce_dtype, cfg.buffer_dtype))
    if cfg.strategy in ("fsdp", "fsdp1"):
        found, how = find_blocks(model, cfg.block_classes)
        names, blocks = tuple(n for n, _ in found), [m for _, m in found]
        if cfg.strategy == "fsdp":
            cast_buffers(model, buffer)
            model = apply_fsdp(model, blocks, mesh=None, device=env.device,
                               mp_policy=build_fsdp_policy(param_dtype=param, reduce_dtype=reduce),
                               reshard_after_forward=cfg.reshard_after_forward)
        else:
            model = apply_fsdp1(model, blocks, device=env.device,
                                mixed_precision=build_fsdp1_policy(param_dtype=param, reduce_dtype=reduce,
                                                                   buffer_dtype=buffer),
                                reshard_after_forward=cfg.reshard_after_forward)
        return model, ShardingInfo(cfg.strategy, names, how)
    cast_buffers(model, buffer)
    if cfg.strategy == "ddp":
        return apply_ddp(model, device=env.device, compute_dtype=param, reduce_dtype=reduce), \
            ShardingInfo("ddp", (), "replicated (DDP)")
    return apply_single(model, device=env.device, compute_dtype=param), ShardingInfo("none", (), "single process")
