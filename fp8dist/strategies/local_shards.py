"""What each rank holds of every parameter of a wrapped model (FSDP2, FSDP1, ZeRO-3, DDP, a plain module), read from
the engine's own objects, and the full tensors gathered back one at a time; for loading ``pretrained=`` and exports.
Names are the user's: wrapper attributes (FSDP1's, activation checkpointing's, torch.compile's) are dropped."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .deepspeed import is_deepspeed_engine
from ..runtime.names import plain_name
from ..runtime.weight_layout import checkpoint_transposed, transposed_params

__all__ = ["flat_params", "Region", "LocalParam", "local_params",
           "gather_full", "original_class"]


def original_class(module: nn.Module) -> type:
    """The user's class of ``module``, under the subclass FSDP2 swaps in (``FSDPLlamaForCausalLM``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


@dataclass(frozen=True)
class Region:
    """The part of a full tensor one rank holds: a box (``(start, length)`` per dim) or a range ``[start, stop)`` of
    the flattened tensor (FSDP1, ZeRO-3)."""

    box: tuple[tuple[int, int], ...] | None = None
    flat: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        """Elements of the region: the range's length, or the product of the box's lengths."""
        return self.flat[1] - self.flat[0] if self.flat is not None else math.prod(n for _, n in self.box or ())


@dataclass(frozen=True)
class LocalParam:
    """One parameter of the model (tied parameters once) as this rank holds it."""

    names: tuple[str, ...]  # its plain names; several when tied
    shape: tuple[int, ...]  # the full shape
    local: torch.Tensor
    """This rank's part, shaped as the region (1-D for a flat range): the engine's storage, to write under no_grad."""
    region: Region
    transposed: bool = False
    """It holds the transpose of what checkpoints hold (a GPT-2 Conv1D run by Transformer Engine); ``shape`` and
    ``region`` are its own."""

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        """The full shape as a checkpoint stores it (a transposed weight's reversed)."""
        return self.shape[::-1] if self.transposed else self.shape


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """The weight inside torchao's tensor subclass (FP8 all-gather's ``_tensor``, the MoE wrapper's ``_data``)."""
    for attr in ("_tensor", "_data"):
        inner = getattr(t, attr, None)
        if isinstance(inner, torch.Tensor):
            return inner
    return t


def _inner(model: nn.Module) -> tuple[nn.Module, dict[int, list[str]]]:
    """The module inside DDP or the DeepSpeed engine (FSDP1's root kept), with every FSDP2 unit resharded (the root
    stays gathered after a forward), and the plain names of each of its parameters by id."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) or is_deepspeed_engine(model) else model
    for module in inner.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    names: dict[int, list[str]] = {}
    for name, p in inner.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(plain_name(name))
    return inner, names


def _dtensor_piece(p: torch.Tensor) -> tuple[torch.Tensor, Region]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return _plain_tensor(p.data), Region(box=tuple((0, s) for s in p.shape))
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return _plain_tensor(p.to_local()), Region(box=tuple(zip(offset, shape)))


def flat_params(model: nn.Module) -> list[torch.Tensor]:
    """FSDP1's FlatParameters in ``model`` (a unit without parameters of its own has none)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [m._flat_param for m in FullyShardedDataParallel.fsdp_modules(model) if m._flat_param is not None]


def _fsdp1_params(model: nn.Module, names: dict[int, list[str]]) -> list[LocalParam]:
    out = []
    for flat in flat_params(model):
        for info, shape, shard in zip(flat._param_infos, flat._shapes, flat._shard_param_infos):
            view = getattr(info.module, info.param_name)
            start, stop = (shard.intra_param_start_idx, shard.intra_param_end_idx + 1) if shard.in_shard else (0, 0)
            transposed = info.param_name == "weight" and checkpoint_transposed(info.module)
            out.append(LocalParam(tuple(names.get(id(view), ())), tuple(shape), view.data, Region(flat=(start, stop)),
                                  transposed))
    return out


def _zero3_piece(p: torch.Tensor) -> tuple[torch.Tensor, Region]:
    import torch.distributed as dist

    size = p.ds_tensor.ds_numel
    start = min(dist.get_rank(group=p.ds_process_group) * size, p.ds_numel)
    stop = min(start + size, p.ds_numel)
    return p.ds_tensor.data[: stop - start], Region(flat=(start, stop))


def local_params(model: nn.Module) -> list[LocalParam]:
    """Every parameter of ``model`` (wrapped or not) with this rank's part of it, in the model's order."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    inner, names = _inner(model)
    if any(isinstance(m, FullyShardedDataParallel) for m in inner.modules()):
        return _fsdp1_params(inner, names)
    transposed = transposed_params(inner)
    out = []
    for p in dict.fromkeys(inner.parameters()):
        zero3 = hasattr(p, "ds_tensor")  # a ZeRO-3 partition
        local, region = _zero3_piece(p) if zero3 else _dtensor_piece(p)
        out.append(LocalParam(tuple(names[id(p)]), tuple(p.ds_shape if zero3 else p.shape), local, region,
                              id(p) in transposed))
    return out


def gather_full(model: nn.Module, *, to_rank0: bool = True) -> Iterator[tuple[tuple[str, ...], torch.Tensor | None]]:
    """``(names, full tensor)`` of every parameter, one at a time, on the CPU in the checkpoints' layout; None on
    ranks but 0 when ``to_rank0``. A collective: every rank iterates it to the end. Peak memory: one FSDP1 unit or
    one parameter beyond the shards. ZeRO-3 yields its fp32 master weights when it has them."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    engine = model if is_deepspeed_engine(model) else None
    inner, names = _inner(model)
    transposed = transposed_params(inner)

    def keep(t: torch.Tensor, flip: bool) -> torch.Tensor | None:
        if rank != 0 and to_rank0:
            return None
        plain = _plain_tensor(t).detach().cpu()
        return plain.t() if flip else plain

    units = FullyShardedDataParallel.fsdp_modules(inner)
    if units:
        for unit in units:
            if unit._flat_param is None:
                continue
            infos = list(unit._flat_param._param_infos)
            with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
                for info in infos:  # views of the unit's gathered storage, freed on leaving: copied out
                    p = getattr(info.module, info.param_name)
                    full = keep(p, info.param_name == "weight" and checkpoint_transposed(info.module))
                    yield tuple(names.get(id(p), ())), None if full is None else full.clone()
        return
    from torch.distributed.tensor import DTensor

    for p in dict.fromkeys(inner.parameters()):
        full = _zero3_full(p, engine) if hasattr(p, "ds_tensor") else p.full_tensor() if isinstance(p, DTensor) else p
        yield tuple(names[id(p)]), keep(full, id(p) in transposed)


def _zero3_full(p: torch.Tensor, engine) -> torch.Tensor:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    if engine is not None and engine.optimizer is not None:
        full = safe_get_full_fp32_param(p)
        if full is not None:
            return full
    with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
        return p.data.clone()
