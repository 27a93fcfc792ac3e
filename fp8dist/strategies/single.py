"""strategy="none": one process, no wrapper, no process group, the forward under autocast."""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from ..config.axis import Rule, StrategyFacts
from ..config.dtypes import torch_dtype
from ..runtime.env import DistEnv, LaunchEnv
from .base import (FP16_RULE, EngineDtypes, ParamLayout, Sharded, ShardingInfo, ShardJob, Strategy, fill_whole,
                   prepared)
from .common import apply_autocast, cast_buffers

__all__ = ["Single", "apply_single", "STRATEGY"]


def apply_single(model: nn.Module, *, device: torch.device, compute_dtype: torch.dtype) -> nn.Module:
    """One process, no wrapper: move to ``device`` and run the forward under autocast to ``compute_dtype``."""
    model.to(device)
    apply_autocast(model, device.type, compute_dtype)
    return model


class Single(Strategy):
    """One process: the model as it is, on the device, under autocast."""

    name = "none"
    accelerate = {"distributed_type": "NO"}
    process_group = False
    # cli/train, accounting/estimate: a tool asked for several ranks refuses, as it knows the world size
    rules = (FP16_RULE, Rule(
        ("world_size", "strategy"), lambda cfg, facts: (facts.world_size or 1) > 1,
        "'none' trains in one process: each rank would train its own copy, with no gradient sync",
        "Use one process (world_size=1, fp8dist train --nproc 1), or strategy='ddp', 'fsdp', 'fsdp1' or "
        "'deepspeed' to train on several ranks."))

    def facts(self, cfg, world_size=None) -> StrategyFacts:
        """One process: fp32 parameters, the forward under autocast, nothing sharded."""
        return StrategyFacts(autocast_forward=True, shard_degree=1)

    def environment(self, cfg, launch: LaunchEnv, device: torch.device) -> DistEnv:
        """No process group: a world of one; a launch of several processes gets a warning (each rank
        trains its own copy)."""
        if launch.world_size > 1:
            warnings.warn(f"strategy='none' in a {launch.world_size}-process launch: every rank trains its own "
                          "copy with no gradient sync. Use strategy='ddp' or 'fsdp'.", UserWarning, stacklevel=3)
        return DistEnv(launch.rank, launch.world_size, launch.local_rank, device, None, launch.launcher)

    def shard(self, model: nn.Module, job: ShardJob) -> Sharded:
        """Nothing to shard: the model allocated and filled whole, moved to the device, its forward
        autocast to ``param_dtype``."""
        p, device = job.cfg.parallel, job.env.device
        loaded, how = fill_whole(model, job, self.name, warn=False)
        model, built = prepared(model, job)
        param = torch_dtype(p.param_dtype)
        cast_buffers(model, torch_dtype(p.buffer_dtype))
        autocast = param if param != torch.float32 else None
        return Sharded(apply_single(model, device=device, compute_dtype=param),
                       ShardingInfo(self.name, (), "single process", autocast=autocast), loaded, how, built)

    def engine_dtypes(self, model: nn.Module, autocast) -> EngineDtypes:
        """The autocast dtype; nothing is reduced or gathered."""
        return EngineDtypes(autocast, None, "none")

    def param_layout(self, model: nn.Module) -> ParamLayout:
        """Every parameter whole in one process: "not distributed"."""
        return dataclasses.replace(super().param_layout(model), layout="not distributed")


STRATEGY = Single()
"""The strategy ``strategy='none'`` (one process) selects (registered by
:func:`fp8dist.strategies.register_builtins`)."""
