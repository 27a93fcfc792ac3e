"""What identifies a model's structure for the planner's caches: a planner re-plans one model per way out and rank
count (``fp8dist estimate --target``), and some rules run a meta-device forward of the whole model."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

from torch import nn

from ..fp8.order import model_structure

__all__ = ["structure_of", "per_structure"]

_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> (its structure, {key: value}): one structure kept per model; a changed (converted) one drops the rest."""


def structure_of(model: nn.Module) -> tuple:
    """Every module's name and type, and its parameters by identity, shape and requires_grad."""
    return model_structure(model)


def per_structure(model: nn.Module, key: Hashable, compute: Callable[[], Any], structure: tuple | None = None) -> Any:
    """``compute()``, remembered for ``model`` under ``key`` while its structure (:func:`structure_of`, or the one
    given) stays the same."""
    structure = structure_of(model) if structure is None else structure
    found = _MEMO.get(model)
    if found is None or found[0] != structure:
        found = (structure, {})
        _MEMO[model] = found
    if key not in found[1]:
        found[1][key] = compute()
    return found[1][key]
