"""Model-state memory levels (``memory=``), each a :class:`~fp8dist.memory_levels.base.MemoryLevel`: ``standard``
(fp32 master weights, your optimizer) and ``lean`` (bf16 weights, 8-bit AdamW states). Importing this package
imports no engine: the built-ins' names are known before torch is imported."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config.axis import LEVELS
from ..config.lazy import lazy_names

if TYPE_CHECKING:
    from .base import MemoryLevel

__all__ = ["MemoryLevel", "LEVELS", "get_level", "register_level", "STANDARD", "register_builtins"]


def register_builtins() -> None:
    """Register fp8dist's memory levels (standard, lean), each module's LEVEL imported when first chosen.
    :data:`LEVELS` calls it through the ``fp8dist.memory_levels`` entry point when first read."""
    for name in ("standard", "lean"):
        LEVELS.register_module(name, f"{__name__}.{name}", "LEVEL")


def _load() -> dict[str, Any]:
    """``MemoryLevel`` and ``STANDARD`` (they import torch), imported when first read."""
    from .base import MemoryLevel
    from .standard import LEVEL as STANDARD

    return locals()


def register_level(level: MemoryLevel) -> MemoryLevel:
    """Make ``level`` (an instance of a :class:`MemoryLevel` subclass) what ``memory=<its name>`` selects, in
    ``wrap_model``, config files, the CLI's choices, the plan, the estimate and the bench; returns it."""
    from .base import MemoryLevel

    return LEVELS.register(level, MemoryLevel)


def get_level(name: str) -> MemoryLevel:
    """The level ``memory=name`` selects (names are validated by the config)."""
    return LEVELS[name]


__getattr__ = lazy_names(globals(), _load)
