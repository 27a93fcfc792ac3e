"""The dtype columns of the precision report, read from the wrapped model's policy objects, modules and tensors."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .tensors import leaves
from ..config.dtypes import dtype_name, dtype_names as _names
from ..memory_levels import get_level
from ..strategies import get_strategy
from ..strategies.base import EngineDtypes
from ..fp8 import get_backend
from .rows import Members, Part, PrecisionRow

__all__ = ["wrapped_run", "row_for"]


def wrapped_run(model: nn.Module, optimizer: Any) -> tuple[Any, Any, EngineDtypes, dict[str, list[Any]]]:
    """The wrap info, the strategy, its engine's dtypes and the tensors it holds per category: what :func:`row_for`
    reads."""
    from ..pipeline.api import get_wrap_info

    info = get_wrap_info(model)
    strategy = get_strategy(info.sharding.strategy)
    return (info, strategy, strategy.engine_dtypes(model, info.sharding.autocast),
            strategy.state_tensors(model, optimizer))


def _stored(strategy: Any, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """What holds this rank's part of ``params``: the engine's own parts (ZeRO-3), else their non-empty leaves."""
    return strategy.stored_parts(params) or [leaf for p in params for leaf in leaves(p) if leaf.numel() > 0] or \
        list(params)


def _fp8_grouped_gemm(modules: list[nn.Module]) -> str:
    """The formats of MoE experts' FP8 grouped GEMMs, read from torchao's wrapper on each module's weights."""
    from ..fp8.moe import experts_gemm_formats

    return " / ".join(sorted({experts_gemm_formats(m) or "not wrapped (high precision)" for m in modules}))


def _all_gather(info: Any, params: list[nn.Parameter], engine: EngineDtypes, stored: list[torch.Tensor]) -> str:
    from torch.distributed.tensor import DTensor

    if engine.gather is not None:
        return engine.gather
    shards = [p.to_local() for p in params if isinstance(p, DTensor)]
    own = get_backend(info.plan.backend).all_gather_words(shards) if shards else None
    return own or (dtype_name(engine.compute) if engine.compute is not None else _names({t.dtype for t in stored}))


def _optimizer_states(optimizer: Any, params: list[nn.Parameter], engine: EngineDtypes,
                      held: dict[str, list[Any]]) -> str:
    if engine.holder is not None:  # the engine's own optimizer, keyed by its partitions: not per row
        states = [value for state in held["optimizer_states"] for value in state.values()]
    else:
        state = getattr(optimizer, "state", None) or {}
        states = [state[p] for p in params if p in state]
    kinds = sorted({_join([_state_kind(v) for k, v in s.items() if k != "step"]) for s in states})
    return ", ".join(k for k in kinds if k) or "none yet (after the first step)"


# torchao's low-bit optimizer states (memory="lean"): blockwise codes with an fp32 scale per block
_LOW_BIT = {"OptimState8bit": "8-bit", "OptimStateFp8": "fp8 e4m3", "OptimState4bit": "4-bit"}


def _state_kind(value: Any) -> str:
    """One optimizer state's dtype name; torchao's low-bit states as their format and scale block."""
    local = getattr(value, "_local_tensor", value)
    kind = _LOW_BIT.get(type(local).__name__)
    if kind is not None:
        return f"{kind} (fp32 scale/{local.block_size})"
    return "+".join(dtype_name(leaf.dtype) for leaf in leaves(value))


def _join(kinds: list[str]) -> str:
    """``"fp32+fp32"``; low-bit states alike as ``"8-bit x2 (fp32 scale/256)"``."""
    if len(set(kinds)) == 1 and len(kinds) > 1 and " (" in kinds[0]:
        name, _, rest = kinds[0].partition(" (")
        return f"{name} x{len(kinds)} ({rest}"
    return "+".join(kinds)


def _weight_grad(params: list[nn.Parameter], engine: EngineDtypes, held: dict[str, list[Any]]) -> str:
    """The row's parameters' gradients, and those an engine holds itself (ZeRO's partitions: not per row)."""
    grads = {leaf.dtype for p in params for leaf in leaves(p.grad) if leaf.untyped_storage().nbytes()}
    if engine.holder is not None:
        grads |= {leaf.dtype for leaf in leaves(held["gradients"]) if leaf.untyped_storage().nbytes()}
    return _names(grads, "none held now (report after backward)")


def _master(info: Any, engine: EngineDtypes, held: dict[str, list[Any]]) -> str:
    """The engine's own master partitions, else what the memory level keeps (lean: none)."""
    masters = {leaf.dtype for leaf in leaves(held["master_weights"])}
    if masters:
        return f"{_names(masters)} (ZeRO partition)"
    return "none" if engine.holder is not None else get_level(info.config.parallel.memory).report_master


def row_for(run: tuple[Any, Any, EngineDtypes, dict[str, list[Any]]], optimizer: Any, part: Part,
            members: Members) -> PrecisionRow:
    """The report's row for ``part`` (:class:`~fp8dist.accounting.rows.Part`) of the model ``run``
    (:func:`wrapped_run`) describes: its ``members`` (modules and parameters) and, from the engine's tensors and
    ``optimizer`` (None: no optimizer state), what each holds and computes in."""
    info, strategy, engine, held = run
    params = [h.param for h in members.params]
    stored = _stored(strategy, params)
    weight = _names({t.dtype for t in stored})
    if part is Part.FP8_GEMM:
        words = get_backend(info.plan.backend).gemm_words  # the FP8 formats, from the module or its wiring
        gemm = " / ".join(dict.fromkeys(words(m, info.fp8) or f"fp8 ({info.plan.backend})" for m in members.modules))
    elif part is Part.FP8_GROUPED_GEMM:
        gemm = _fp8_grouped_gemm(members.modules)
    elif part is Part.GEMM:
        gemm = dtype_name(engine.compute) if engine.compute is not None else weight
    else:
        gemm = "no GEMM"
    return PrecisionRow(part=part, modules=len(members.modules), params=sum(h.numel for h in members.params),
                        gemm=gemm, all_gather=_all_gather(info, params, engine, stored),
                        reduce=engine.reduce or "none", weight=weight, master_weight=_master(info, engine, held),
                        weight_grad=_weight_grad(params, engine, held),
                        optimizer_states=_optimizer_states(optimizer, params, engine, held))
