"""FSDP2 (``fully_shard``) and FSDP1 (``FullyShardedDataParallel``): policies and their application."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import CustomPolicy

from .padding import padding_note, shard_padding

__all__ = ["build_fsdp_policy", "build_fsdp1_policy", "apply_fsdp", "apply_fsdp1", "fsdp_padding_notes"]


def build_fsdp_policy(*, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2 mixed precision: gathered parameters in ``param_dtype``, gradients reduce-scattered in
    ``reduce_dtype``. FSDP2 leaves buffers alone (fp8dist casts them separately)."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def build_fsdp1_policy(*, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                       buffer_dtype: torch.dtype) -> MixedPrecision:
    """FSDP1 mixed precision with all three dtypes explicit (FSDP1 would otherwise cast buffers to
    ``param_dtype``, which Llama-style rotary buffers do not tolerate)."""
    return MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype)


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], *, mesh: DeviceMesh | None, device: torch.device,
               mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool) -> nn.Module:
    """Shard each block with ``fully_shard``, then the root. In place: returns ``model`` itself.
    ``reshard_after_forward`` applies to the blocks; the root keeps its gathered parameters for backward.

    Call after FP8 conversion and before building the optimizer.
    """
    if mesh is None:
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # the root's parameters (embeddings, final norm, output layer) are the first backward needs: freeing them
    # after forward only gathers them again at once (torch's default for the root, as torchtitan does)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    return model


def fsdp_padding_notes(model: nn.Module, world_size: int) -> tuple[str, ...]:
    """What FSDP2's dim-0 padding costs ``model`` on ``world_size`` ranks, with the way out, when it is large
    (:func:`fp8dist.strategies.padding.padding_note`); empty otherwise. Reads shapes only: a meta model works."""
    note = padding_note(shard_padding({n: tuple(p.shape) for n, p in model.named_parameters()}, world_size))
    return (note,) if note else ()


def apply_fsdp1(model: nn.Module, blocks: list[nn.Module], *, device: torch.device,
                mixed_precision: MixedPrecision, reshard_after_forward: bool,
                param_init_fn: Callable[[nn.Module], None] | None = None) -> FullyShardedDataParallel:
    """Wrap each block, then the root, in ``FullyShardedDataParallel``; returns the root wrapper.

    ``use_orig_params=True`` keeps the original parameter names and lets FP8 backends see real tensors;
    ``device_id`` is set for CPU too, which FSDP1 needs to run there. ``param_init_fn`` materializes a meta-device
    module, one unit at a time, before FSDP1 shards it.
    """
    block_ids = {id(b) for b in blocks}
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=CustomPolicy(lambda module: id(module) in block_ids),
        mixed_precision=mixed_precision,
        sharding_strategy=ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP,
        device_id=device,
        use_orig_params=True,
        param_init_fn=param_init_fn,
    )
