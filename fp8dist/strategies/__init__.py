"""Strategies: how the model is replicated or sharded, each with its mixed-precision policy.

``apply_strategy`` is the single entry point ``wrap_model`` calls; the ``apply_*`` functions it dispatches to
take explicit dtypes and devices, not the whole config, so they can be used on their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import StrategyConfig, torch_dtype
from ..env import DistEnv
from .common import cast_buffers, find_blocks
from .ddp import apply_ddp, apply_single
from .deepspeed import apply_deepspeed, build_deepspeed_config, is_deepspeed_engine, zero_config
from .fsdp import apply_fsdp, apply_fsdp1, build_fsdp1_policy, build_fsdp_policy, fsdp_mesh, fsdp_padding_notes

__all__ = ["apply_strategy", "ShardingInfo", "unwrap_model", "build_fsdp_policy", "build_fsdp1_policy", "find_blocks",
           "zero_config", "deepspeed_config_for", "is_deepspeed_engine"]

@dataclass(frozen=True)
class ShardingInfo:
    """What the strategy did: which blocks were sharded and how they were found, and the autocast it put around
    the forward (ddp, none)."""

    strategy: str
    blocks: tuple[str, ...]
    blocks_found_by: str
    autocast: torch.dtype | None = None
    """The dtype the forward runs under ``torch.autocast`` in (ddp, none); None: no autocast."""
    notes: tuple[str, ...] = ()
    """What the user should know (a model sharded as one unit, FSDP2's padding of short dim-0 parameters)."""


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside what :func:`fp8dist.wrap_model` returned: the ``.module`` of DDP, FSDP1 and the
    DeepSpeed engine; the model itself under FSDP2 (sharded in place) and strategy "none"."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, FullyShardedDataParallel)) or is_deepspeed_engine(model):
        return model.module
    return model


def deepspeed_config_for(model: nn.Module, cfg: StrategyConfig, env: DistEnv, optimizer: Any = None) -> dict:
    """The DeepSpeed config ``wrap_model`` uses: :func:`build_deepspeed_config` for this job's world size, validated
    (the memory estimate calls the same builder)."""
    return build_deepspeed_config(model, cfg, world_size=env.world_size, optimizer=optimizer)


def apply_strategy(model: nn.Module, cfg: StrategyConfig, env: DistEnv, optimizer: Any = None,
                   ds_entry: tuple[Mapping[str, Any], Any] | None = None,
                   blocks: tuple[list[tuple[str, nn.Module]], str] | None = None,
                   param_init_fn: Any = None) -> tuple[nn.Module, ShardingInfo]:
    """Shard or replicate ``model`` as ``cfg`` says; returns the model to train (the engine for DeepSpeed, whose
    ``.optimizer`` is the one it built from ``optimizer``) and what was done. ``ds_entry`` = (extra config,
    initialize function) lets an FP8 backend with its own DeepSpeed entry point (MS-AMP) take over
    ``deepspeed.initialize``. ``blocks`` = (``[(name, module), ...]``, how they were found): the blocks FSDP shards
    when an earlier step already found (and wrapped) them; None: found here from ``cfg.block_classes``.
    ``param_init_fn`` (FSDP1) materializes a meta-device module unit by unit before it is sharded."""
    param, reduce, buffer = (torch_dtype(d) for d in (cfg.param_dtype, cfg.reduce_dtype, cfg.buffer_dtype))
    if cfg.strategy == "deepspeed":
        extra, initialize = ds_entry or ({}, None)
        config = {**deepspeed_config_for(model, cfg, env, optimizer), **extra}
        if "optimizer" not in config and not callable(optimizer):
            raise ValueError("strategy='deepspeed' builds the optimizer inside deepspeed.initialize: pass "
                             "optimizer={'type': 'AdamW', 'lr': ...} (or a callable params -> optimizer), or a "
                             "ds_config with an 'optimizer' block.")
        cast_buffers(model, buffer)
        engine, _ = apply_deepspeed(model, config, optimizer=optimizer if callable(optimizer) else None,
                                    local_rank=env.local_rank, initialize=initialize)
        return engine, ShardingInfo("deepspeed", (), f"DeepSpeed ZeRO-{config['zero_optimization']['stage']}")
    if cfg.strategy in ("fsdp", "fsdp1"):
        found, how = blocks if blocks is not None else find_blocks(model, cfg.block_classes)
        names, blocks = tuple(n for n, _ in found), [m for _, m in found]
        if cfg.strategy == "fsdp":
            cast_buffers(model, buffer)
            model = apply_fsdp(model, blocks, mesh=fsdp_mesh(env.device, env.world_size, cfg.replicate_degree),
                               device=env.device,
                               mp_policy=build_fsdp_policy(param_dtype=param, reduce_dtype=reduce),
                               reshard_after_forward=cfg.reshard_after_forward, block_names=names)
        else:
            model = apply_fsdp1(model, blocks, device=env.device,
                                mixed_precision=build_fsdp1_policy(param_dtype=param, reduce_dtype=reduce,
                                                                   buffer_dtype=buffer),
                                reshard_after_forward=cfg.reshard_after_forward, param_init_fn=param_init_fn)
        notes = () if names else (f"{type(model).__name__}: {how}. All parameters are gathered at once; pass "
                                  "block_classes=[...] to shard block by block.",)
        if cfg.strategy == "fsdp":
            notes += fsdp_padding_notes(model, env.world_size // cfg.replicate_degree)
        return model, ShardingInfo(cfg.strategy, names, how, notes=notes)
    cast_buffers(model, buffer)
    autocast = param if param != torch.float32 else None
    if cfg.strategy == "ddp":
        return apply_ddp(model, device=env.device, compute_dtype=param, reduce_dtype=reduce), \
            ShardingInfo("ddp", (), "replicated (DDP)", autocast=autocast)
    return apply_single(model, device=env.device, compute_dtype=param), \
        ShardingInfo("none", (), "single process", autocast=autocast)
