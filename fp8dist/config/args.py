"""Checks of plain Python arguments of fp8dist's public functions (config fields go through :mod:`.schema`)."""

from __future__ import annotations

from typing import Any

__all__ = ["require_bool"]


def require_bool(name: str, value: Any) -> None:
    """A TypeError naming ``name`` unless ``value`` is True or False: a string such as ``'no'`` is truthy, and
    would silently mean yes."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False, not {type(value).__name__}.")
