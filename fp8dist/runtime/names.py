"""Parameter and module names as the user's model has them: the engines' wrapper attributes (FSDP1's, activation
checkpointing's, torch.compile's) left out, as checkpoints and the plan name them."""

from __future__ import annotations

__all__ = ["WRAPPER_ATTRS", "plain_name"]

WRAPPER_ATTRS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
"""Attribute names under which FSDP1, activation checkpointing and torch.compile hold the module they
wrap: parameter names are read with them left out."""


def plain_name(name: str) -> str:
    """A wrapped module's or parameter's name as it is on the unwrapped model (and in its checkpoints)."""
    return ".".join(a for a in name.split(".") if a not in WRAPPER_ATTRS)
