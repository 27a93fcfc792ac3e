"""What each rank holds of every parameter of a wrapped model, read from the engine's own objects, and the full
tensors gathered back one piece at a time: the one place that knows how FSDP2 (DTensor), FSDP1 (flat parameters),
DeepSpeed ZeRO-3 (``ds_tensor`` partitions), DDP and a plain module lay parameters out. Loading a pretrained
checkpoint into the shards and exporting the trained model both read it.

Names are the user's module names: the wrappers' attributes (FSDP1's ``_fsdp_wrapped_module``, activation
checkpointing's ``_checkpoint_wrapped_module``, torch.compile's ``_orig_mod``) are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .deepspeed import is_deepspeed_engine
from ..pipeline.weight_layout import checkpoint_transposed, transposed_params

__all__ = ["WRAPPER_ATTRS", "plain_name", "fsdp1_full_shapes", "Region", "LocalParam", "local_params",
           "gather_full", "original_class"]

WRAPPER_ATTRS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Attributes through which wrappers hold the module they wrap: absent from the user's module names."""


def plain_name(name: str) -> str:
    """A wrapped module's or parameter's name as it is on the unwrapped model (and in its checkpoints)."""
    return ".".join(a for a in name.split(".") if a not in WRAPPER_ATTRS)


def original_class(module: nn.Module) -> type:
    """The user's class of ``module``: FSDP2 swaps in a subclass (``FSDPLlamaForCausalLM``) whose ``__new__``
    also runs ``__init__``."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def fsdp1_full_shapes(model: nn.Module) -> dict[tuple[int, str], tuple[int, ...]]:
    """FSDP1's original parameters are flat views of this rank's shard; their full shapes are in the flat
    parameters (tied ones under their shared entries). Keyed by ``(id(module), parameter name)``."""
    full: dict[tuple[int, str], tuple[int, ...]] = {}
    for flat in _flat_params(model):
        for info, shape in zip(flat._param_infos, flat._shapes):
            full[(id(info.module), info.param_name)] = tuple(shape)
        for shared in flat._shared_param_infos or ():
            full[(id(shared.module), shared.param_name)] = full[(id(shared.prim_module), shared.prim_param_name)]
    return full


@dataclass(frozen=True)
class Region:
    """The part of a full tensor one rank holds: a box (``(start, length)`` per dim: FSDP2, a whole tensor) or a
    range ``[start, stop)`` of the flattened tensor (FSDP1, ZeRO-3)."""

    box: tuple[tuple[int, int], ...] | None = None
    flat: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return self.flat[1] - self.flat[0] if self.flat is not None else math.prod(n for _, n in self.box or ())


@dataclass(frozen=True)
class LocalParam:
    """One parameter of the model (tied parameters once) as this rank holds it."""

    names: tuple[str, ...]
    """Its plain names; several when tied (``model.embed_tokens.weight`` and ``lm_head.weight``)."""
    shape: tuple[int, ...]
    """The full shape."""
    local: torch.Tensor
    """This rank's part, shaped as the region (a box, or 1-D for a flat range): written into under no_grad, it
    is the engine's storage."""
    region: Region
    transposed: bool = False
    """The parameter holds the transpose of what checkpoints hold (:func:`fp8dist.pipeline.weight_layout.
    checkpoint_transposed`: a GPT-2 Conv1D run by Transformer Engine): ``shape`` and ``region`` are the parameter's
    own."""

    @property
    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape checkpoints hold it in."""
        return self.shape[::-1] if self.transposed else self.shape


def _whole(shape: tuple[int, ...]) -> Region:
    return Region(box=tuple((0, s) for s in shape))


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """torchao wraps the high-precision weight in a tensor subclass (FP8 all-gather's
    ``WeightWithDynamicFloat8CastTensor`` holds it as ``_tensor``, the MoE training wrapper as ``_data``): the
    tensor inside is the weight trained."""
    for attr in ("_tensor", "_data"):
        inner = getattr(t, attr, None)
        if isinstance(inner, torch.Tensor):
            return inner
    return t


def _inner(model: nn.Module) -> tuple[nn.Module, dict[int, list[str]]]:
    """The module whose parameter names are the user's (inside DDP and the DeepSpeed engine; FSDP1's root wrapper
    is kept, its flat parameter one of the units, its prefixes dropped by :func:`plain_name`), resharded, and the
    plain names of each of its parameters by id. FSDP2 keeps the root's parameters gathered after a forward (in the
    compute dtype, as plain tensors, until backward): every unit is put back to its sharded DTensors first."""
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
        return _plain_tensor(p.data), _whole(tuple(p.shape))
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return _plain_tensor(p.to_local()), Region(box=tuple(zip(offset, shape)))


def _flat_params(model: nn.Module) -> list[torch.Tensor]:
    """FSDP1's FlatParameters in ``model`` (a unit whose modules hold no parameters of their own has none)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [m._flat_param for m in FullyShardedDataParallel.fsdp_modules(model) if m._flat_param is not None]


def _fsdp1_params(model: nn.Module, names: dict[int, list[str]]) -> list[LocalParam]:
    out = []
    for flat in _flat_params(model):
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
    """Every parameter of ``model`` (as :func:`fp8dist.wrap_model` returned it, or the user's module) with this
    rank's part of it, in the model's parameter order."""
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
    """The full value of every parameter, one at a time (a collective: every rank must iterate it to the end):
    ``(names, tensor)``, the tensor on the CPU in the layout checkpoints hold (a transposed parameter transposed
    back), None on ranks other than 0 when ``to_rank0``. Peak memory is one FSDP1 unit or one parameter (FSDP2,
    ZeRO-3) beyond the shards. ZeRO-3 yields the optimizer's fp32 master weights when it has them (DeepSpeed's
    ``safe_get_full_fp32_param``), the module's weights otherwise."""
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
        if hasattr(p, "ds_tensor"):
            yield tuple(names[id(p)]), keep(_zero3_full(p, engine), id(p) in transposed)
        elif isinstance(p, DTensor):
            yield tuple(names[id(p)]), keep(p.full_tensor(), id(p) in transposed)
        else:
            yield tuple(names[id(p)]), keep(p, id(p) in transposed)


def _zero3_full(p: torch.Tensor, engine) -> torch.Tensor:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    if engine is not None and engine.optimizer is not None:
        full = safe_get_full_fp32_param(p)
        if full is not None:
            return full
    with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
        return p.data.clone()
