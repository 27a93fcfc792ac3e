"""How the wrapped model's parameters are sharded and in which dtypes, read from the tensors and the engine's own
policy objects, not from the config."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ShardingSummary", "sharding_summary"]

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _short(dtype: torch.dtype | None) -> str:
    return "fp32 (no cast)" if dtype is None else _SHORT.get(dtype, str(dtype).replace("torch.", ""))


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

    def __str__(self) -> str:
        share = 100.0 * self.local_numel / max(self.total_numel, 1)
        return (f"{self.layout}: {self.sharded_tensors}/{self.tensors} tensors sharded over {self.world_size} "
                f"rank(s); this rank stores {self.local_numel:,} of {self.total_numel:,} elements ({share:.1f}%) "
                f"in {'/'.join(self.storage_dtypes)}; compute in {self.compute_dtype}, "
                f"gradients reduced in {self.reduce_dtype}")


def _fsdp2_policy(model: nn.Module):
    state = getattr(model, "_get_fsdp_state", None)
    return state()._mp_policy if state is not None else None


def sharding_summary(model: nn.Module) -> ShardingSummary:
    """Summarize the parameters of a model returned by ``wrap_model`` (any strategy) on this rank."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    from .strategies.deepspeed import is_deepspeed_engine

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if is_deepspeed_engine(model):
        return _deepspeed_summary(model, world)
    if isinstance(model, FullyShardedDataParallel):
        flats = [m._flat_param for m in FullyShardedDataParallel.fsdp_modules(model) if m._flat_param is not None]
        mp = model.mixed_precision
        return ShardingSummary(
            layout="FlatParameter shards", world_size=world,
            total_numel=sum(f._unpadded_unsharded_size.numel() for f in flats),
            local_numel=sum(f.numel() for f in flats),
            sharded_tensors=sum(1 for f in flats if f.numel() < f._unpadded_unsharded_size.numel()),
            tensors=len(flats), storage_dtypes=tuple(sorted({_short(f.dtype) for f in flats})),
            compute_dtype=_short(mp.param_dtype), reduce_dtype=_short(mp.reduce_dtype))
    params = list(model.parameters())
    storage = tuple(sorted({_short(p.dtype) for p in params}))
    policy = _fsdp2_policy(model)
    if policy is not None:
        dtensors = [p for p in params if isinstance(p, DTensor)]
        placements = sorted({repr(pl) for p in dtensors for pl in p.placements})
        return ShardingSummary(
            layout=f"DTensor {'/'.join(placements)}", world_size=world,
            total_numel=sum(p.numel() for p in params), local_numel=sum(p.to_local().numel() for p in dtensors),
            sharded_tensors=sum(1 for p in dtensors if any(pl.is_shard() for pl in p.placements)),
            tensors=len(params), storage_dtypes=storage,
            compute_dtype=_short(policy.param_dtype), reduce_dtype=_short(policy.reduce_dtype))
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    autocast = getattr(inner.forward, "_fp8dist_autocast", None)
    total = sum(p.numel() for p in params)
    return ShardingSummary(
        layout="replicated" if isinstance(model, DistributedDataParallel) else "not distributed",
        world_size=world, total_numel=total, local_numel=total, sharded_tensors=0, tensors=len(params),
        storage_dtypes=storage, compute_dtype=_short(autocast) if autocast else storage[0],
        reduce_dtype=_ddp_reduce_dtype(model))


def _deepspeed_summary(engine, world: int) -> ShardingSummary:
    """ZeRO-3 partitions parameters (``ds_tensor`` holds this rank's part); ZeRO-1/2 keep them whole and
    partition optimizer states (and gradients)."""
    stage = engine.zero_optimization_stage()
    params = list(engine.module.parameters())
    if stage == 3:
        local = sum(p.ds_tensor.numel() for p in params)
        total = sum(p.ds_numel for p in params)
        sharded = sum(1 for p in params if p.ds_tensor.numel() < p.ds_numel)
        storage = tuple(sorted({_short(p.ds_tensor.dtype) for p in params}))
    else:
        total = local = sum(p.numel() for p in params)
        sharded, storage = 0, tuple(sorted({_short(p.dtype) for p in params}))
    compute = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    return ShardingSummary(layout=f"DeepSpeed ZeRO-{stage}", world_size=world, total_numel=total, local_numel=local,
                           sharded_tensors=sharded, tensors=len(params), storage_dtypes=storage,
                           compute_dtype=compute, reduce_dtype=_short(engine.communication_data_type))


def _ddp_reduce_dtype(model: nn.Module) -> str:
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return "n/a (no reduction)"
    hook = getattr(model, "_comm_hook", None)  # DDP keeps the registered Python hook here
    name = getattr(hook, "__name__", "")
    if name.startswith("bf16"):
        return "bf16"
    if name.startswith("fp16"):
        return "fp16"
    grads = {p.dtype for p in model.parameters()}
    return "/".join(sorted(_short(d) for d in grads))
