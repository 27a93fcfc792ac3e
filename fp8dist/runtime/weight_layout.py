"""Which module classes hold ``weight`` transposed relative to their checkpoints (the TE backend's ``TEConv1D`` holds
GPT-2's Conv1D weight as (out, in)): the one record every tool that reads or writes parameters by name consults."""

from __future__ import annotations

from torch import nn

__all__ = ["register_transposed", "checkpoint_transposed", "transposed_params"]

_TRANSPOSED: set[type] = set()


def register_transposed(cls: type) -> type:
    """Record that modules of ``cls`` hold ``weight`` as the transpose of what checkpoints hold."""
    _TRANSPOSED.add(cls)
    return cls


def checkpoint_transposed(module: nn.Module) -> bool:
    """Whether ``module``'s ``weight`` is held transposed relative to its checkpoints."""
    return bool(_TRANSPOSED) and isinstance(module, tuple(_TRANSPOSED))


def transposed_params(model: nn.Module) -> set[int]:
    """``id`` of every parameter of ``model`` held transposed relative to its checkpoints."""
    return {id(m.weight) for m in model.modules() if checkpoint_transposed(m)}
