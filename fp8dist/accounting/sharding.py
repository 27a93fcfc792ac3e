"""How the wrapped model's parameters are sharded and in which dtypes, read from the tensors and the engine's own
policy objects, not from the config."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config.text import plural
from ..config.dtypes import dtype_name, dtype_names
from ..strategies.introspect import EngineDtypes, engine_dtypes

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
    tensors: int
    storage_dtypes: tuple[str, ...]
    compute_dtype: str
    reduce_dtype: str
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


def _reduce_name(engine: EngineDtypes, params: list[nn.Parameter]) -> str:
    if engine.engine == "none":
        return "n/a (no reduction)"
    if engine.reduce_hook is not None:
        return f"set by the comm hook {engine.reduce_hook}"
    return dtype_name(engine.reduce) if engine.reduce is not None else dtype_names({p.dtype for p in params})


def sharding_summary(model: nn.Module) -> ShardingSummary:
    """Summarize the parameters of a model returned by ``wrap_model`` (any strategy) on this rank."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ..pipeline.api import get_wrap_info

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    engine = engine_dtypes(model, get_wrap_info(model).sharding.autocast)
    if engine.engine == "deepspeed":
        return _deepspeed_summary(model, world, engine)
    params = list(model.parameters())
    common = dict(world_size=world, compute_dtype=dtype_name(engine.compute) if engine.compute else None,
                  reduce_dtype=_reduce_name(engine, params))
    if engine.engine == "fsdp1":
        flats = [m._flat_param for m in FullyShardedDataParallel.fsdp_modules(model) if m._flat_param is not None]
        return _summary(layout="FlatParameter shards", total_numel=sum(f._unpadded_unsharded_size.numel()
                                                                       for f in flats),
                        local_numel=sum(f.numel() for f in flats), tensors=len(flats),
                        sharded_tensors=sum(1 for f in flats if f.numel() < f._unpadded_unsharded_size.numel()),
                        storage={f.dtype for f in flats}, **common)
    if engine.engine == "fsdp":
        dtensors = [p for p in params if isinstance(p, DTensor)]
        placements = sorted({repr(pl) for p in dtensors for pl in p.placements})
        replicas = max((_replicas(p) for p in dtensors), default=1)
        return _summary(layout=f"DTensor {'/'.join(placements)}", total_numel=sum(p.numel() for p in params),
                        replicas=replicas,
                        local_numel=sum(p.to_local().numel() for p in dtensors), tensors=len(params),
                        sharded_tensors=sum(1 for p in dtensors if any(pl.is_shard() for pl in p.placements)),
                        storage={p.dtype for p in params}, **common)
    total = sum(p.numel() for p in params)
    return _summary(layout="replicated" if engine.engine == "ddp" else "not distributed", total_numel=total,
                    local_numel=total, sharded_tensors=0, tensors=len(params), storage={p.dtype for p in params},
                    **common)


def _replicas(p: DTensor) -> int:
    """How many ranks hold the same piece of ``p``: the product of its mesh dimensions that replicate it."""
    shape = p.device_mesh.shape
    copies = 1
    for dim, placement in enumerate(p.placements):
        if placement.is_replicate():
            copies *= shape[dim]
    return copies


def _summary(*, storage: set[torch.dtype], compute_dtype: str | None, **fields) -> ShardingSummary:
    """The summary; no cast means compute in the stored dtype."""
    names = tuple(sorted(dtype_name(d) for d in storage))
    return ShardingSummary(storage_dtypes=names, compute_dtype=compute_dtype or "/".join(names), **fields)


def _deepspeed_summary(engine, world: int, dtypes: EngineDtypes) -> ShardingSummary:
    """ZeRO-3 partitions parameters (``ds_tensor`` holds this rank's part); ZeRO-1/2 keep them whole and
    partition optimizer states (and gradients)."""
    params = list(engine.module.parameters())
    if dtypes.zero_stage == 3:
        local = sum(p.ds_tensor.numel() for p in params)
        total = sum(p.ds_numel for p in params)
        sharded = sum(1 for p in params if p.ds_tensor.numel() < p.ds_numel)
        storage = {p.ds_tensor.dtype for p in params}
    else:
        total = local = sum(p.numel() for p in params)
        sharded, storage = 0, {p.dtype for p in params}
    return _summary(layout=f"DeepSpeed ZeRO-{dtypes.zero_stage}", world_size=world, total_numel=total,
                    local_numel=local, sharded_tensors=sharded, tensors=len(params), storage=storage,
                    compute_dtype=dtype_name(dtypes.compute or torch.float32), reduce_dtype=dtype_name(dtypes.reduce))
