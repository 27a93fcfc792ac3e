"""Model-state memory levels (``memory=``), each a :class:`~fp8dist.memory_levels.base.MemoryLevel`: ``standard``
(fp32 master weights, your optimizer) and ``lean`` (bf16 weights, 8-bit AdamW states). Importing this package
imports no engine: the built-ins' names are known before torch is imported."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config.axis import LEVELS

if TYPE_CHECKING:
    from .base import MemoryLevel

__all__ = ["MemoryLevel", "LEVELS", "get_level", "register_level", "STANDARD"]

for _name in ("standard", "lean"):  # each module's LEVEL, imported when first chosen
    LEVELS.register_module(_name, f"{__name__}.{_name}", "LEVEL")


_loaded = False  # the names below imported


def __getattr__(name: str) -> Any:
    """``MemoryLevel`` and ``STANDARD`` (they import torch), imported when first read."""
    global _loaded
    if name.startswith("__") or _loaded:  # Python's probes (__wrapped__, ...); a name deleted since stays deleted
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .base import MemoryLevel
    from .standard import LEVEL as STANDARD

    _loaded = True
    for key, value in locals().items():
        if key in __all__:
            globals().setdefault(key, value)  # a name set before it loaded (a test's monkeypatch) is kept
    if name not in globals():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return globals()[name]


def register_level(level: MemoryLevel) -> MemoryLevel:
    """Make ``level`` (an instance of a :class:`MemoryLevel` subclass) what ``memory=<its name>`` selects, in
    ``wrap_model``, config files, the CLI's choices, the plan, the estimate and the bench; returns it."""
    from .base import MemoryLevel

    return LEVELS.register(level, MemoryLevel)


def get_level(name: str) -> MemoryLevel:
    """The level ``memory=name`` selects (names are validated by the config)."""
    return LEVELS[name]
