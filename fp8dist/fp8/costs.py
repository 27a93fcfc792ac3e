"""The accounting role of an FP8 backend (:class:`Accounting`): what the memory estimate (``estimate_memory``,
``fp8dist estimate``) and the precision report (``fp8dist.report``) ask of it — bytes per element of what it holds
and saves, its FP8 state, the formats its GEMMs and all-gathers carry. The defaults: no FP8 state of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from ..config.axis import StrategyFacts
from .conversion import FP8Wiring

if TYPE_CHECKING:
    from ..config.param_bytes import ElementBytes
    from ..config.resolve import Config
    from ..plan.precision import PrecisionPlan

__all__ = ["Accounting", "FrozenWeights"]


@dataclass(frozen=True)
class FrozenWeights:
    """What a converted Linear's frozen weight (a LoRA base) costs under a backend; default: as a trainable one."""

    cached_bytes: int = 0
    """Bytes per element a rank holds (its shard where sharded) of the FP8 copy cast once and kept; 0: none kept."""
    scale_bytes: int = 0
    """Bytes per such weight of the scale kept with that copy."""
    grad_weight_gemm: bool = True
    """The backward still runs the weight-gradient GEMM (autograd drops its result)."""
    how: str = "cast to FP8 every step, as a trainable weight"
    """One line for the plan and the report."""


class Accounting(Protocol):
    """The accounting role: bytes and formats, asked by the estimate (from the plan, before any model is built in
    FP8) and the precision report (of a wrapped model). :class:`~fp8dist.fp8.base.FP8Backend` composes it."""

    derived_bytes: ClassVar[bool] = False
    """The estimate's figures for this backend come from its documentation, not from a measured run (the estimate
    says so)."""
    saved_weight_bytes: ClassVar[int] = 0
    """Bytes per element of each converted weight's FP8 copies kept for backward (TE: the weight and its transpose)."""
    weight_scale_names: ClassVar[tuple[str, ...]] = ()
    """Inner tensors of the backend's weight subclass that hold FP8 scales, not weight data: the report counts them
    as FP8 buffers, not in the weight."""

    def saved_input_bytes(self, cfg: Config) -> float:
        """Bytes per element of the quantized copy of its input each converted Linear saves for backward in place of
        the high-precision input, under ``cfg``'s recipe; 0: it saves the high-precision input (shared with the
        other readers of that tensor) and quantizes it again in backward. Asked by the estimate's activations.
        Default: 1 (an FP8 copy) where the backend keeps FP8 weight copies (:attr:`saved_weight_bytes`), else 0."""
        return 1.0 if self.saved_weight_bytes else 0.0

    def autograd_weight_bytes(self, cfg: Config) -> float:
        """Bytes per element of each converted weight's quantized copy that autograd saves for backward under
        ``cfg`` (freed with the layer's other saves, recomputed under activation checkpointing); 0: none. Asked by
        the estimate's activations. Default: 0."""
        return 0.0

    def element_bytes(self, cfg: Config, base: ElementBytes, converted: bool, n_states: int) -> ElementBytes:
        """Bytes per element of one parameter in each model-state category under ``cfg``: ``base`` (the strategy's
        and the memory level's: weight, master, grad, states, dtypes) changed where the backend holds it otherwise;
        ``converted``: it is the weight of a module the plan converts; ``n_states``: the optimizer's states per
        element. Asked by the estimate per parameter. Default: ``base`` unchanged."""
        return base

    def frozen_weights(self, cfg: Config, facts: StrategyFacts) -> FrozenWeights:
        """What a converted Linear's frozen weight costs per step and in bytes under ``cfg`` and the strategy's
        ``facts``; asked by the estimate per FP8 layer (``cfg`` its ``layer_config``), and by a backend's own
        ``convert`` deciding whether to keep a cast. Default: as a trainable weight."""
        return FrozenWeights()

    def state_tensors(self, module: nn.Module) -> list[torch.Tensor | object | None]:
        """The FP8 state a converted ``module`` of a wrapped model keeps beside its weights (scales, amax history,
        kept FP8 casts: tensors, or objects holding them such as TE's ``fp8_meta``; None entries skipped), which
        the report counts as FP8 buffers. Default: its own buffers."""
        return list(module.buffers(recurse=False))

    def fp8_state_bytes(self, cfg: Config, plan: PrecisionPlan) -> int:
        """Bytes of FP8 scaling state on every rank (replicated) for ``plan`` under ``cfg``; asked by the estimate.
        Default: 0."""
        return 0

    def all_gather_words(self, shards: list[torch.Tensor]) -> str | None:
        """What an all-gather of these local weight shards of a wrapped model carries in the backend's own format,
        for the report; None: the compute dtype. Default: None."""
        return None

    def gemm_words(self, module: nn.Module, wiring: FP8Wiring) -> str | None:
        """The FP8 formats a converted ``module``'s GEMMs compute in (``wiring``: what ``after_shard`` did), for the
        precision report; None: not known (the report says "fp8"). Default: None."""
        return None

