"""Model-state memory levels (``memory=``), each a :class:`~fp8dist.memory_levels.base.MemoryLevel`: ``standard``
(fp32 master weights, your optimizer) and ``lean`` (bf16 weights, 8-bit AdamW states)."""

from __future__ import annotations

from ..config.axis import LEVELS
from .base import MemoryLevel
from .lean import LEVEL as _LEAN

__all__ = ["MemoryLevel", "LEVELS", "get_level", "register_level", "STANDARD"]


class _Standard(MemoryLevel):
    """fp32 master weights (or what the strategy keeps), the optimizer you choose: every hook is the default."""

    name = "standard"


STANDARD = _Standard()


def register_level(level: MemoryLevel) -> MemoryLevel:
    """Make ``level`` (an instance of a :class:`MemoryLevel` subclass) what ``memory=<its name>`` selects, in
    ``wrap_model``, config files, the CLI's choices, the plan, the estimate and the bench; returns it."""
    return LEVELS.register(level, MemoryLevel)


for _builtin in (STANDARD, _LEAN):
    register_level(_builtin)


def get_level(name: str) -> MemoryLevel:
    """The level ``memory=name`` selects (names are validated by the config)."""
    return LEVELS[name]
