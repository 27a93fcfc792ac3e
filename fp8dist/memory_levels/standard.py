"""The ``standard`` memory level: fp32 master weights (or what the strategy keeps), the optimizer you choose."""

from __future__ import annotations

from .base import MemoryLevel

__all__ = ["LEVEL"]


class _Standard(MemoryLevel):
    """fp32 master weights (or what the strategy keeps), the optimizer you choose: every hook is the default."""

    name = "standard"


LEVEL = _Standard()
"""The level ``memory='standard'`` selects, the default (registered by
:func:`fp8dist.memory_levels.register_builtins`)."""
