"""How the wrapped model's parameters are sharded and in which dtypes, read from the tensors and the engine's own
policy objects by the strategy (:meth:`~fp8dist.strategies.base.Strategy.param_layout`, :meth:`~fp8dist.strategies.
base.Strategy.engine_dtypes`), not from the config."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config.text import plural
from ..config.dtypes import dtype_name
from ..strategies import get_strategy

__all__ = ["ShardingSummary", "sharding_summary"]


@dataclass(frozen=True)
class ShardingSummary:
    """Per-rank view of the parameters of a wrapped model."""

    layout: str
    """"DTensor Shard(0)", "FlatParameter shards", "replicated" or "not distributed"."""
    world_size: int
    total_numel: int
    """Elements of all parameters of the full model."""
    local_numel: int
    """Elements this rank stores."""
    sharded_tensors: int
    """Parameter tensors split over the ranks (of ``tensors``)."""
    tensors: int
    """Parameter tensors the engine holds on this rank (under FSDP1, its FlatParameters)."""
    storage_dtypes: tuple[str, ...]
    """The dtypes the parameters are stored in on this rank ("fp32", "bf16"), sorted."""
    compute_dtype: str
    """The dtype forward and backward compute in: the engine's mixed-precision policy, else the storage's."""
    reduce_dtype: str
    """What gradients are reduced in, in words ("fp32"); "n/a (no reduction)" for a single process."""
    replicas: int = 1
    """Whole copies of the model over the ranks: HSDP's replicate degree (1: sharded over every rank)."""

    def __str__(self) -> str:
        share = 100.0 * self.local_numel / max(self.total_numel, 1)
        copies = f" in each of {self.replicas} replicas" if self.replicas > 1 else ""
        return (f"{self.layout}: {self.sharded_tensors}/{self.tensors} tensors sharded over "
                f"{plural(self.world_size // self.replicas, 'rank')}{copies}; this rank stores {self.local_numel:,} of "
                f"{self.total_numel:,} elements ({share:.1f}%) "
                f"in {'/'.join(self.storage_dtypes)}; compute in {self.compute_dtype}, "
                f"gradients reduced in {self.reduce_dtype}")


def sharding_summary(model: nn.Module) -> ShardingSummary:
    """How the parameters of ``model``, as ``wrap_model`` returned it (any strategy), are held on this rank: the
    layout, elements stored against the whole, dtypes stored, computed and reduced in, read from the engine's tensors
    and policy objects. No collectives: call it on any rank, any time after ``wrap_model``; ``print`` it for a line.

    Raises:
        ValueError: ``model`` was not returned by ``wrap_model``.
    """
    from ..pipeline.api import get_wrap_info

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    sharding = get_wrap_info(model).sharding
    strategy = get_strategy(sharding.strategy)
    held, engine = strategy.param_layout(model), strategy.engine_dtypes(model, sharding.autocast)
    names = tuple(sorted(dtype_name(d) for d in held.storage))
    return ShardingSummary(layout=held.layout, world_size=world, total_numel=held.total_numel,
                           local_numel=held.local_numel, sharded_tensors=held.sharded_tensors, tensors=held.tensors,
                           storage_dtypes=names, replicas=held.replicas,
                           compute_dtype=dtype_name(engine.compute) if engine.compute else "/".join(names),
                           reduce_dtype=engine.reduce or "n/a (no reduction)")
