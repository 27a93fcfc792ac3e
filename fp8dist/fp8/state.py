"""The checkpoint-state role of an FP8 backend (:class:`CheckpointHooks`): what ``save_checkpoint`` and
``load_checkpoint`` ask of it — whether fp8dist's checkpoints can hold its state, what it keeps in ``_extra_state``,
and what to recompute after a load."""

from __future__ import annotations

from typing import ClassVar, Protocol

from torch import nn

from .conversion import FP8Wiring

__all__ = ["CheckpointHooks"]


class CheckpointHooks(Protocol):
    """The checkpoint-state role; the defaults: a backend whose state is its weights' (nothing refused, nothing to
    recompute). :class:`~fp8dist.fp8.base.FP8Backend` composes it."""

    checkpoint_refusal: ClassVar[str | None] = None
    """Why fp8dist's checkpoints cannot hold this backend's state yet, and the way out: ``save_checkpoint`` and
    ``load_checkpoint`` raise with it before writing or reading anything; None: they can."""
    extra_state: ClassVar[str | None] = None
    """What the backend keeps in modules' ``_extra_state`` (TE's scales and amax history), as the refusal to drop it
    names it (a checkpoint loaded into another backend, or a non-strict load); None: nothing."""

    def after_load(self, model: nn.Module, wiring: FP8Wiring) -> None:
        """Recompute what derives from the weights (torchao's precomputed FP8 scales) after ``load_checkpoint``
        filled the sharded ``model``; ``wiring``: what ``after_shard`` did. Default: nothing derives."""
