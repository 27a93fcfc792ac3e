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

from dataclasses import dataclass
from typing import Any

from ..strategies.base import EngineMemory
from .tensors import CATEGORIES

__all__ = ["CATEGORIES", "OPTIMIZER_STATES", "DTYPE_BYTES", "ParamInfo", "ElementBytes", "element_bytes",
           "STEP_BYTES", "category_dtypes", "worst_rank"]

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



def element_bytes(engine: EngineMemory, level: Any, backend: Any, cfg: Any, optimizer: str, stored_dtype: str,
                  converted: bool) -> ElementBytes:
    """Bytes per element of one parameter: as the strategy's ``engine`` holds it (its module dtype, else the
    model's own ``stored_dtype``; its master dtype, else none and the states in the weights' dtype), then as the
    memory ``level`` and the FP8 ``backend`` change it (``converted``: the plan converts its module)."""
    n_states = OPTIMIZER_STATES[optimizer]
    weight = engine.dtype or stored_dtype
    states = engine.master or weight
    base = ElementBytes(DTYPE_BYTES[weight], DTYPE_BYTES[engine.master] if engine.master else 0, DTYPE_BYTES[weight],
                        DTYPE_BYTES[states] * n_states,
                        (weight, engine.master or "none", weight, states if n_states else "none"))
    return backend.element_bytes(cfg, level.element_bytes(base), converted, n_states)


def category_dtypes(params: list[ParamInfo], fp8_bytes: int) -> dict[str, str]:
    """The dtypes each category holds, as ``"bf16/fp32"``."""
    found: dict[str, set[str]] = {c: set() for c in CATEGORIES}
    for p in params:
        for category, name in zip(CATEGORIES[:4], p.bytes.dtypes):
            if name != "none":
                found[category].add(name)
    if fp8_bytes:
        found["fp8_buffers"].add("fp32")
    return {c: "/".join(sorted(names)) or "none" for c, names in found.items()}


def worst_rank(per_rank: list[dict[str, int]]) -> int:
    """The rank holding the most model-state bytes (the lowest such rank)."""
    return max(range(len(per_rank)), key=lambda r: sum(per_rank[r].values()))

