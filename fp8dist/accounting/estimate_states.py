"""Model-state bytes on every rank, from parameter shapes alone (the private half of :mod:`fp8dist.estimate`).

Each axis answers for itself: the strategy says what its engine holds beside the parameters
(:meth:`~fp8dist.strategies.base.Strategy.estimate_engine`: DeepSpeed's module dtype and fp32 masters) and lays
the bytes out over the ranks (:meth:`~fp8dist.strategies.base.Strategy.rank_state_bytes`, written out in
:mod:`fp8dist.strategies.state_bytes`); the memory level changes what each element costs and adds its own
optimizer states per local tensor (lean's 8-bit AdamW); the FP8 backend changes the bytes of the weights it
converts (MS-AMP's chart) and adds its FP8 scaling state (TE's ``fp8_meta``, MS-AMP's scaling metas, torchao's
precomputed scales). TE and MS-AMP figures are derived from their documentation, not measured (neither runs here).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any

from ..strategies.base import EngineMemory
from .tensors import CATEGORIES, ParamGroup, holds_words

__all__ = ["CATEGORIES", "OPTIMIZER_STATES", "DTYPE_BYTES", "ParamInfo", "ElementBytes", "element_bytes",
           "STEP_BYTES", "category_dtypes", "param_groups", "fp8_buffer_bytes", "worst_rank"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
"""States per parameter element: Adam/AdamW exp_avg and exp_avg_sq, SGD's momentum buffer, plain SGD none."""
STEP_BYTES = {"adamw": 4, "adam": 4}
"""torch's Adam/AdamW keep one fp32 ``step`` tensor per parameter (DeepSpeed's FusedAdam: in the group)."""


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per parameter element in each category, and the dtype names shown."""

    weight: int
    master: int
    grad: int
    states: int
    dtypes: tuple[str, str, str, str]


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the model as the layouts need it."""

    name: str
    numel: int
    shape: tuple[int, ...]
    unit: str
    """The FSDP unit (block) that owns it; "" for the root."""
    bytes: ElementBytes
    trains: bool = True
    """``requires_grad``: a frozen parameter has no gradient, optimizer state nor step of its own."""


def element_bytes(engine: EngineMemory, level: Any, backend: Any, cfg: Any, optimizer: str, stored_dtype: str,
                  converted: bool, trains: bool = True) -> ElementBytes:
    """Bytes per element of one parameter: as the strategy's ``engine`` holds it (its module dtype, else the
    model's own ``stored_dtype``; its master dtype, else none and the states in the weights' dtype), then as the
    memory ``level`` and the FP8 ``backend`` change it (``converted``: the plan converts its module). A frozen
    parameter (``trains`` False) keeps only its weight: every engine here keeps masters, gradients and optimizer
    states for what trains alone (FSDP1's flat gradient, which spans frozen pieces too, is its layout's matter)."""
    n_states = OPTIMIZER_STATES[optimizer]
    weight = engine.dtype or stored_dtype
    states = engine.master or weight
    base = ElementBytes(DTYPE_BYTES[weight], DTYPE_BYTES[engine.master] if engine.master else 0, DTYPE_BYTES[weight],
                        DTYPE_BYTES[states] * n_states,
                        (weight, engine.master or "none", weight, states if n_states else "none"))
    held = backend.element_bytes(cfg, level.element_bytes(base), converted, n_states)
    return held if trains else _frozen(held)  # whatever the backend keeps, it keeps no training state of a frozen one


def _frozen(held: ElementBytes) -> ElementBytes:
    return replace(held, master=0, grad=0, states=0, dtypes=(held.dtypes[0], "none", "none", "none"))


def category_dtypes(params: list[ParamInfo], fp8_bytes: int, kept_fp8: bool = False) -> dict[str, str]:
    """The dtypes each category holds, as ``"bf16/fp32"``; ``kept_fp8``: the FP8 buffers include frozen weights'
    kept FP8 copies (:meth:`~fp8dist.fp8.FP8Backend.frozen_weights`), e4m3 as the report names them."""
    found: dict[str, set[str]] = {c: set() for c in CATEGORIES}
    for p in params:
        for category, name in zip(CATEGORIES[:4], p.bytes.dtypes):
            if name != "none":
                found[category].add(name)
    if fp8_bytes:
        found["fp8_buffers"].update(("fp32", "fp8 e4m3") if kept_fp8 else ("fp32",))
    return {c: "/".join(sorted(names)) or "none" for c, names in found.items()}


def worst_rank(per_rank: list[dict[str, int]]) -> int:
    """The rank holding the most model-state bytes (the lowest such rank)."""
    return max(range(len(per_rank)), key=lambda r: sum(per_rank[r].values()))


def param_groups(params: list[ParamInfo], rank_bytes: Callable[[list[ParamInfo]], dict[str, int]],
                 model_state: int) -> tuple[ParamGroup, ...]:
    """The frozen and the trained parameters apart, on the rank described: the frozen ones as ``rank_bytes`` lays
    them out alone, the trained ones the rest of the ``model_state`` bytes (FP8 buffers aside) -- the same as laid
    out alone where each parameter is held on its own, and, under FSDP1, with the flat gradient a unit holds for its
    frozen pieces too, which it holds only because some piece trains; () where every parameter trains."""
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
    """The FP8 backend's own state on the rank described: its scaling state for ``plan``'s FP8 modules, where a
    frozen converted weight (a LoRA base) costs what a trained one does; where the backend keeps the FP8 cast of a
    frozen weight instead (its ``frozen_weights`` answer), that copy -- its bytes per element on each element the
    rank holds, laid out by ``rank_bytes`` as the weight -- and its scale, and no scaling state of its own. Returns
    the bytes and whether such kept copies are among them."""
    from ..plan.precision import PrecisionPlan

    entries = {f"{e.name}.weight": e for e in plan.fp8}
    kept = {p.name: backend.frozen_weights(backend.layer_config(cfg, entries[p.name].recipe), plan.facts)
            for p in params if not p.trains and p.name in entries}  # each layer as its own recipe answers
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
