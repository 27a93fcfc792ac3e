"""The tooling role of an FP8 backend (:class:`Tooling`): what the commands, the bench, the reference training job,
the Accelerate translator and the FP8 health telemetry ask of it, with the records they take."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

from torch import nn

from .casts import CastSpec

__all__ = ["Tooling", "HandConverted", "HealthCasts"]


@dataclass(frozen=True)
class HandConverted:
    """What :attr:`Tooling.convert_by_hand` did, and each hand-wired step's calls beyond forward, backward, step."""

    layers: int = 0
    """FP8 GEMM layers swapped in."""
    params: int = 0
    """Their weight parameters."""
    after_step: Callable[[], None] = lambda: None
    """After each optimizer step (torchao's scale precompute)."""
    forward_context: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext
    """Around each forward (Transformer Engine's autocast)."""


@dataclass(frozen=True)
class HealthCasts:
    """How :class:`fp8dist.numerics.FP8Telemetry` samples one converted layer: each operand's cast as the GEMM that
    consumes it first casts it (tensorwise or rowwise :class:`~fp8dist.fp8.casts.CastSpec`)."""

    input: CastSpec
    """The input's cast in the forward GEMM."""
    weight: CastSpec
    """The weight's cast in the forward GEMM."""
    grad_output: CastSpec
    """The output gradient's cast in the input-gradient GEMM."""
    autocast_input: bool = False
    """The layer casts its input to the autocast dtype before its FP8 cast (torchao's ``Float8Linear``): the
    telemetry samples it so."""


class Tooling(Protocol):
    """The tooling role; the defaults: a backend none of these tools special-cases.
    :class:`~fp8dist.fp8.base.FP8Backend` composes it."""

    accelerate_backend: ClassVar[str | None] = None
    """The value of Accelerate's ``fp8_config.backend`` that selects this backend ("TE"), read by the Accelerate
    config translator; None: none does."""
    more_variant_options: ClassVar[tuple[str, ...]] = ()
    """Options beside ``variant_option`` whose every value ``fp8dist bench`` can run as a cell (``torchao_api``)."""
    convert_by_hand: ClassVar[Callable[..., HandConverted] | None] = None
    """``convert_by_hand(model, facts) -> HandConverted``: the default variant's conversion as the library's
    documentation wires it, the bench's reference for fp8dist's overhead (a method on a backend). None: no
    hand-wired cell."""
    rank_imports: ClassVar[tuple[str, ...]] = ()
    """Modules a rank imports anyway under this backend (``torchao.float8``), for a parent (``fp8dist train``, the
    bench) to import before forking."""
    commands_default: ClassVar[bool] = False
    """The commands use this backend when ``--fp8`` is not given, where it can run (the library's default: no FP8)."""

    def health_casts(self, module: nn.Module) -> HealthCasts | None:
        """How :class:`fp8dist.numerics.FP8Telemetry` samples ``module``, a module of a wrapped model's user model
        (unwrapped), when it is one of this backend's FP8 layers; None for any other module. The telemetry asks it
        of every module when it is created. Default: None (no FP8 health telemetry)."""
        return None

    @property
    def health_telemetry(self) -> bool:
        """Whether :class:`fp8dist.numerics.FP8Telemetry` can sample this backend's layers (``--fp8-health-every``):
        the backend answers :meth:`health_casts`."""
        return type(self).health_casts is not Tooling.health_casts
