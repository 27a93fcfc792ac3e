"""Model-state bytes on every rank from parameter shapes alone, each engine's layout followed exactly (the estimate is
tested against :func:`fp8dist.report` to the byte). ``params``: the estimate's records (``name``, ``numel``, ``shape``,
``unit``, ``trains``, ``bytes`` per element of weight, master, grad, states); a frozen one has no gradient nor state."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from torch import nn

from ..config.text import byte_size
from .padding import shard_padding

__all__ = ["replicated_state_bytes", "fsdp2_state_bytes", "fsdp1_state_bytes", "zero_state_bytes",
           "gathered_blocks_note", "UNSHARDED_ITEM", "ROOT_WEIGHTS_ITEM"]

UNSHARDED_ITEM = "unsharded weights kept (reshard_after_forward=False)"
"""The activation estimate's item for the weights an FSDP engine keeps gathered after the forward
(``reshard_after_forward=False``)."""
ROOT_WEIGHTS_ITEM = "weights outside the blocks, kept gathered"
"""The activation estimate's item for the weights outside the blocks, which FSDP keeps gathered."""


def _trains(p: Any) -> bool:
    return getattr(p, "trains", True)


def _spread(per_rank: list[int], start: int, stop: int, size: int, value_of: Callable[[int], int]) -> None:
    """Add ``value_of(overlap)`` to every rank whose range [r*size, (r+1)*size) meets [start, stop)."""
    for rank in range(start // size, min((stop - 1) // size + 1, len(per_rank))):
        overlap = min(stop, (rank + 1) * size) - max(start, rank * size)
        if overlap > 0:
            per_rank[rank] += value_of(overlap)


def replicated_state_bytes(params: list[Any], world: int, step: int,
                           level_states: Callable[[int], int]) -> list[dict[str, int]]:
    """Every rank holds everything; ``step``: the optimizer's step bytes per tensor; ``level_states``: a memory
    level's own state bytes for n elements."""
    one = {"parameters": sum(p.numel * p.bytes.weight for p in params),
           "master_weights": sum(p.numel * p.bytes.master for p in params),
           "gradients": sum(p.numel * p.bytes.grad for p in params),
           "optimizer_states": sum(p.numel * p.bytes.states + step + level_states(p.numel) for p in params
                                   if _trains(p))}
    return [dict(one) for _ in range(world)]


def fsdp2_state_bytes(params: list[Any], world: int, step: int,
                      level_states: Callable[[int], int]) -> list[dict[str, int]]:
    """Storage padded to the first ``torch.chunk`` along dim 0 (:mod:`~fp8dist.strategies.padding`), optimizer
    states on each rank's real rows (summed through a difference array, so 1024 ranks cost no more than 2)."""
    padding = shard_padding({p.name: p.shape for p in params}, world)
    change = [0] * (world + 1)
    for p, pad in zip(params, padding):
        full = pad.dim0 // pad.rows_per_rank if pad.rows_per_rank else 0
        change[0] += pad.padded_numel * p.bytes.states
        change[full] -= pad.padded_numel * p.bytes.states
        if full < world:
            rest = pad.rows_on(full) * pad.row_numel * p.bytes.states
            change[full] += rest
            change[full + 1] -= rest
    states = list(itertools.accumulate(change[:world]))
    held = {kind: sum(pad.padded_numel * getattr(p.bytes, kind) for p, pad in zip(params, padding))
            for kind in ("weight", "master", "grad")}  # per parameter: a backend may hold some in another dtype
    out = [{"parameters": held["weight"], "master_weights": held["master"], "gradients": held["grad"],
            "optimizer_states": s + step * sum(map(_trains, params))} for s in states]
    for p, pad in zip(params, padding):  # a level's own states follow each rank's rows; none: skipped (per rank)
        if _trains(p) and level_states(pad.row_numel):
            for rank, held in enumerate(out):
                held["optimizer_states"] += level_states(pad.rows_on(rank) * pad.row_numel)
    return out


def _fsdp1_unit(unit: list[Any], world: int, align: int) -> tuple[list[tuple[int, int]], int]:
    """Offsets of a FlatParameter's pieces (alignment padding before a piece, world-size padding at the end)
    and its shard size."""
    segments, total = [], 0
    for p in unit:
        total += -total % align if align else 0
        segments.append((total, total + p.numel))
        total += p.numel
    return segments, -(-total // world)


def fsdp1_state_bytes(params: list[Any], world: int, step: int, compute_bytes: int) -> list[dict[str, int]]:
    """Each unit flattened (each piece aligned to 16 bytes, as ``use_orig_params=True`` does), padded to a multiple
    of W and cut in W shards; one flat gradient spans the shard if any piece trains; states follow the pieces."""
    units: dict[str, list[Any]] = {}
    for p in params:
        units.setdefault(p.unit, []).append(p)
    b = params[0].bytes
    shard_total = grads = 0
    states = [0] * world
    for unit in units.values():
        segments, shard = _fsdp1_unit(unit, world, 16 // compute_bytes)
        shard_total += shard
        grads += shard * max(p.bytes.grad for p in unit)  # one flat gradient, frozen pieces too, if any piece trains
        for (start, stop), p in zip(segments, unit):
            if _trains(p):
                _spread(states, start, stop, shard, lambda overlap, p=p: overlap * p.bytes.states + step)
    return [{"parameters": shard_total * b.weight, "master_weights": 0, "gradients": grads,
             "optimizer_states": s} for s in states]


def _zero12(params: list[Any], world: int) -> list[dict[str, int]]:
    """One flat group of the trained parameters padded to a multiple of 2W (frozen ones stay whole), an fp32 master
    partition of 1/W, gradients of the whole parameters overlapping the partition."""
    trained = [p for p in params if _trains(p)]
    b = (trained or params)[0].bytes
    total = sum(p.numel for p in trained)
    aligned = -(-total // (2 * world)) * (2 * world)
    part = aligned // world
    grads = [0] * world
    start = 0
    for p in trained:
        _spread(grads, start, start + p.numel, part, lambda overlap, p=p: p.numel * b.grad)
        start += p.numel
    frozen = sum(p.numel * p.bytes.weight for p in params if not _trains(p))
    return [{"parameters": aligned * b.weight + frozen, "master_weights": part * b.master, "gradients": g,
             "optimizer_states": part * b.states} for g in grads]


def _zero_per_param(params: list[Any], world: int, stage: int, persistence: int = -1) -> list[dict[str, int]]:
    """ZeRO-3 (``ceil(numel / W)`` each; numel <= ``persistence`` also kept whole), or an FP8 backend's own ZeRO
    optimizer partitioning each parameter by ``stage``."""
    def share(numel: int, partitioned: bool) -> int:
        return -(-numel // world) if partitioned else numel
    out = {"parameters": sum((share(p.numel, stage >= 3) + (p.numel if p.numel <= persistence else 0)) * p.bytes.weight
                             for p in params),
           "master_weights": sum(share(p.numel, True) * p.bytes.master for p in params),
           "gradients": sum(share(p.numel, stage >= 2) * p.bytes.grad for p in params),
           "optimizer_states": sum(share(p.numel, True) * p.bytes.states for p in params)}
    return [dict(out) for _ in range(world)]


def zero_state_bytes(params: list[Any], world: int, *, stage: int, persistence: int, step: int,
                     backend_optimizer: bool) -> list[dict[str, int]]:
    """ZeRO-1/2/3 by ``stage``; ``step``: the step state of the one flat partition torch's Adam updates (a CPU
    run); ``backend_optimizer``: an FP8 backend's own ZeRO optimizer partitions each parameter."""
    if backend_optimizer:
        return _zero_per_param(params, world, stage)
    out = _zero_per_param(params, world, 3, persistence) if stage == 3 else _zero12(params, world)
    for states in out:
        states["optimizer_states"] += step * any(map(_trains, params))
    return out


def gathered_blocks_note(model: nn.Module, blocks: list[str], compute_bytes: int) -> list[str]:
    """The transient an engine that gathers block by block leaves out of the model states."""
    if not blocks:
        return []
    biggest = max(sum(p.numel() for p in model.get_submodule(b).parameters()) for b in blocks)
    return [f"transient, not counted: all-gathered weights of about 2 blocks at a time "
            f"({byte_size(2 * biggest * compute_bytes)} in the compute dtype)"]
