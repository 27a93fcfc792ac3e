"""Which modules hold a weight transposed relative to their checkpoints: the one record every tool that reads or
writes parameters by name consults (``pretrained=``, ``save_pretrained``, the optimizer's moments in checkpoints),
shared by the FP8 backends that make such modules and the strategies' shard introspection.

GPT-2's Conv1D stores its weight (in, out); Transformer Engine's te.Linear must hold (out, in). The TE backend's
``TEConv1D`` (:mod:`fp8dist.fp8.conv1d`) holds the transpose and registers its class here; its state dict already
gives the Conv1D's layout (hooks), so only tools that read the parameters themselves transpose.
"""

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
