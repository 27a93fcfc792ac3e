"""Model-state bytes on every rank from parameter shapes alone: the strategy lays the bytes out over the ranks
(:meth:`~fp8dist.strategies.base.Strategy.rank_state_bytes`), the memory level and the FP8 backend change what an
element costs and add their own state."""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Callable
from typing import Any

from ..config.dtypes import dtype_bytes
from ..config.param_bytes import ElementBytes, ParamInfo
from ..strategies.base import EngineMemory
from .optimizers import OPTIMIZER_STATES
from .tensors import CATEGORIES, ParamGroup, holds_words

__all__ = ["CATEGORIES", "element_bytes", "category_dtypes", "param_groups",
           "fp8_buffer_bytes"]



def element_bytes(engine: EngineMemory, level: Any, backend: Any, cfg: Any, optimizer: str, stored_dtype: str,
                  converted: bool, trains: bool = True) -> ElementBytes:
    """Bytes per element of one parameter as the strategy's ``engine`` holds it (its dtypes, else the model's
    ``stored_dtype``; states in the master dtype, else the weight's), then the memory ``level`` and the FP8
    ``backend`` (``converted``: the plan converts its module). A frozen one keeps only its weight."""
    n_states = OPTIMIZER_STATES[optimizer]
    weight = engine.dtype or stored_dtype
    states = engine.master or weight
    base = ElementBytes(dtype_bytes(weight), dtype_bytes(engine.master) if engine.master else 0, dtype_bytes(weight),
                        dtype_bytes(states) * n_states,
                        (weight, engine.master or "none", weight, states if n_states else "none"))
    held = backend.element_bytes(cfg, level.element_bytes(base), converted, n_states)
    return held if trains else replace(held, master=0, grad=0, states=0,
                                       dtypes=(held.dtypes[0], "none", "none", "none"))


def category_dtypes(params: list[ParamInfo], fp8_bytes: int, kept_fp8: bool = False) -> dict[str, str]:
    """The dtypes each category holds, as ``"bf16/fp32"``; ``kept_fp8``: the FP8 buffers hold frozen weights'
    FP8 copies too (e4m3, as the report names them)."""
    found: dict[str, set[str]] = {c: set() for c in CATEGORIES}
    for p in params:
        for category, name in zip(CATEGORIES[:4], p.bytes.dtypes):
            if name != "none":
                found[category].add(name)
    if fp8_bytes:
        found["fp8_buffers"].update(("fp32", "fp8 e4m3") if kept_fp8 else ("fp32",))
    return {c: "/".join(sorted(names)) or "none" for c, names in found.items()}


def param_groups(params: list[ParamInfo], rank_bytes: Callable[[list[ParamInfo]], dict[str, int]],
                 model_state: int) -> tuple[ParamGroup, ...]:
    """The frozen and the trained parameters apart on the rank described: the frozen as ``rank_bytes`` lays them
    out alone, the trained as the rest of ``model_state`` (so FSDP1's flat gradient over frozen pieces counts as
    trained); () where every parameter trains."""
    if all(p.trains for p in params):
        return ()
    frozen = [p for p in params if not p.trains]
    frozen_bytes = sum(rank_bytes(frozen).values())
    out = []
    for label, trains, held in (("frozen", False, frozen_bytes), ("trained", True, model_state - frozen_bytes)):
        group = [p for p in params if p.trains is trains]
        holds = holds_words([{p.bytes.dtypes[i] for p in group} for i in range(4)])
        out.append(ParamGroup(label, sum(p.numel for p in group), held, holds))
    return tuple(out)


def fp8_buffer_bytes(backend: Any, cfg: Any, plan: Any, params: list[ParamInfo],
                     rank_bytes: Callable[[list[ParamInfo]], dict[str, int]]) -> tuple[int, bool]:
    """(bytes, whether kept FP8 copies are among them) of the FP8 backend's state on the rank described: its
    scaling state for ``plan``'s FP8 modules, except that a frozen weight whose cast the backend keeps
    (``frozen_weights``) costs that copy, laid out by ``rank_bytes`` as the weight, and its scale instead."""
    from ..plan.precision import PrecisionPlan

    entries = {f"{e.name}.weight": e for e in plan.fp8}
    kept = {p.name: backend.frozen_weights(backend.layer_config(cfg, entries[p.name]), plan.facts)
            for p in params if not p.trains and p.name in entries}  # each layer as its own entry configures it
    frozen = [p for p in params if kept.get(p.name) and kept[p.name].cached_bytes]
    if not frozen:
        return backend.fp8_state_bytes(cfg, plan), False
    modules = {entries[p.name].name for p in frozen}
    trained = PrecisionPlan([e for e in plan if e.name not in modules], backend=plan.backend,
                            strategy=plan.strategy, memory=plan.memory, hardware=plan.hardware, facts=plan.facts)
    copies = [replace(p, bytes=ElementBytes(kept[p.name].cached_bytes, 0, 0, 0, ("fp8", "none", "none", "none")))
              for p in frozen]
    kept_bytes = rank_bytes(copies)["parameters"] + sum(kept[p.name].scale_bytes for p in frozen)
    return backend.fp8_state_bytes(cfg, trained) + kept_bytes, True
