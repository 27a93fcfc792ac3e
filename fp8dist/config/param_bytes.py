"""What a parameter costs, in the words every axis and the memory estimate share: its bytes per element in each
category (:class:`ElementBytes`, which a memory level and an FP8 backend adjust) and a parameter as a strategy's
layout sees it (:class:`ParamInfo`, which ``Strategy.rank_state_bytes`` lays out over the ranks). Plain data, below
the axes, so that none of them reaches up to ``fp8dist.accounting`` for them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ElementBytes", "ParamInfo"]


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per parameter element in each category, and the dtype names shown."""

    weight: int
    """Bytes of the weight as the engine stores it."""
    master: int
    """Bytes of its master copy (0: none kept)."""
    grad: int
    """Bytes of its gradient (0 for a frozen parameter)."""
    states: int
    """Bytes of its optimizer states, all of them."""
    dtypes: tuple[str, str, str, str]
    """The dtype names of the four, as the estimate's table shows them."""


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as the layouts need it; ``unit``: its FSDP unit (block), "" for the root."""

    name: str
    """The parameter's name in the model."""
    numel: int
    """Its elements."""
    shape: tuple[int, ...]
    """Its full shape."""
    unit: str
    bytes: ElementBytes
    """Its bytes per element in each category."""
    trains: bool = True
    """Whether it has ``requires_grad`` (a frozen one keeps only its weight)."""
