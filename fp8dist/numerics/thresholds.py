"""The probe's and the telemetry's limits on a layer's FP8 numerics: outside every healthy layer measured in
benchmarks/numerics/results.md (Llama, GPT-2, Mixtral, Qwen3; init and 200 steps; torchao and TE recipes; fp4_*: TE
NVFP4), with a margin, and inside what "the planted outlier" (1e5 in one input channel) does."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ..config.schema import normalize_fields, route_keys

if TYPE_CHECKING:
    from .stats import LayerNumerics

__all__ = ["Thresholds", "DEFAULT_THRESHOLDS", "as_thresholds"]


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Limits past which a layer is recommended to stay out of FP8."""

    min_output_sqnr_db: float = 20.0
    """The forward GEMM's output SQNR with FP8 operands against high precision: below this, excluded. Healthy
    layers >= 27.6 dB; 20 dB is an error a tenth of the output's amplitude. An outlier channel passes it (32 dB: it
    is the signal); the flushed share catches it."""

    min_grad_sqnr_db: float = 10.0
    """The same for the backward GEMMs (``g @ W``, ``g.T @ x``), each from its operands as the recipe casts them for
    it. Healthy layers >= 16.0 dB (TE delayed, whose history warmed on one batch clamps a few of Qwen3's first
    attention gradients; other recipes >= 22.9 dB); 10 dB is an error a third of the gradient's amplitude. A
    gradient spike delayed scaling clamps measures 0 dB."""

    min_rest_sqnr_db: float = 15.0
    """An operand's SQNR over the values beside each dot product's largest (a row along the contraction dim): an
    outlier that sets a row's scale swamps the rest (8% of a gradient's rows: 10.6 dB) while the plain SQNR and the
    flushed share stay fine. Healthy layers >= 18.4 dB (TE delayed; others >= 23.4 dB), rowwise gradients that flush
    25-35% included: a tail too small for its row costs nothing here."""

    max_flushed_share: float = 0.01
    """Share of an input's or a weight's non-zero values flushed to zero. Healthy layers <= 0.15% (inputs: SwiGLU
    down projections after training), <= 0.01% (weights); the planted outlier 52% (trained) to 99.7% (at init)."""

    max_grad_flushed_share: float = 0.5
    """The same for the output gradient, whose healthy tails flush up to 35% (the output layer, torchao rowwise)
    and carry little of the update: only a gradient that loses most of its values is flagged. A share cannot tell
    those tails from ordinary values an outlier swamps: ``min_rest_sqnr_db`` does."""

    fp4_min_output_sqnr_db: float = 10.0
    """``min_output_sqnr_db`` for FP4 operands (NVFP4; e2m1's fewer mantissa bits cost about 12 dB): healthy layers
    >= 15.8 dB (Llama at init; after training >= 23.8 dB), the planted outlier 18.8-20.3 dB; 10 dB is an error a
    third of the output's amplitude: a gross error only."""

    fp4_min_rest_sqnr_db: float = 6.0
    """``min_rest_sqnr_db`` for an FP4 cast: healthy layers >= 11.9 dB, the planted outlier 1.7 dB at init but
    14.9 dB after training, so a gross error only (``fp4_max_floored_share`` catches the outlier)."""

    fp4_max_flushed_share: float = 0.6
    """``max_flushed_share`` for an FP4 cast (a 16-value block flushes what is under 1/24 of its amax): healthy
    layers <= 41.1% (trained SwiGLU down projections' inputs), the planted outlier 50.8-97.5%."""

    fp4_max_grad_flushed_share: float = 0.95
    """``max_grad_flushed_share`` for an FP4 cast: healthy layers up to 86.2% (the output head), what nearest
    rounding flushes and TE's stochastic rounding of gradients (not emulated) keeps in expectation."""

    fp4_max_floored_share: float = 0.01
    """For an FP4 cast of an input or a weight: share of its non-zero values in blocks whose e4m3 scale sat at its
    floor, as an outlier's tensor scale (its amax / 2,688) leaves the ordinary blocks. Healthy layers <= 0.02%, the
    planted outlier 63.6-99.9%; output gradients are not judged (healthy tails floor up to 83% of blocks)."""

    max_saturated_share: float = 0.001
    """Share of values the cast clamped (only delayed scaling clamps): healthy layers <= 0.01% (TE delayed)."""

    min_reduce_sqnr_db: float = 20.0
    """Under ``reduce_dtype="fp8"``: a weight gradient's SQNR after the reduction's FP8 blocks (e4m3, one fp32
    scale per ``reduce_fp8_block`` values) against itself; below this, the layer's gradient is reduced in fp32.
    The tiny Llama's layers at block 128 measure 31.7-32.4 dB (e4m3's three mantissa bits); an outlier
    dominates this figure (98.6 dB with a norm weight scaled 1e7), so it flags only a gross error."""

    min_reduce_small_sqnr_db: float = 20.0
    """The same over the small values, under 1/16 of their block's largest: a few huge values per block (an input
    channel far larger than the others puts one in every row of the weight gradient) set the scale and leave the
    rest in e4m3's subnormals while the plain SQNR, which the outliers dominate, stays high.
    The tiny Llama's layers at block 128: 31.4-32.0 dB; its MLP gate and up projections after a norm weight's
    channel scaled 1e6: 20.5-22.4 dB, 1e7: 3.3-4.2 dB, 1e8: 0.2 dB."""

    def __post_init__(self) -> None:
        normalize_fields(self)  # a number each ("0.02" from a file or flag too); a bool or a word is refused
        for name in (f.name for f in fields(self) if f.name.endswith("_share")):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name}={value} must be a share between 0 and 1 (0.01 is 1%).")

    def problems(self, layer: LayerNumerics) -> tuple[str, ...]:
        """What in ``layer`` crosses these limits, one phrase each (empty when nothing does)."""
        out = []
        sqnr = layer.output.sqnr_db
        least = self.fp4_min_output_sqnr_db if any(c.fp4 for c in layer.casts) else self.min_output_sqnr_db
        if layer.calls and (math.isnan(sqnr) or sqnr < least):
            out.append(f"output SQNR {sqnr:.1f} dB < {least:g} dB")
        for gemm in ("grad_input", "grad_weight"):
            stats = getattr(layer, gemm)
            sqnr = stats.sqnr_db
            if (stats.signal or stats.noise) and (math.isnan(sqnr) or sqnr < self.min_grad_sqnr_db):
                out.append(f"{gemm} SQNR {sqnr:.1f} dB < {self.min_grad_sqnr_db:g} dB")
        for cast in layer.casts:
            grad = cast.role == "grad_output"
            limit = ((self.fp4_max_grad_flushed_share if grad else self.fp4_max_flushed_share) if cast.fp4 else
                     self.max_grad_flushed_share if grad else self.max_flushed_share)
            rest = self.fp4_min_rest_sqnr_db if cast.fp4 else self.min_rest_sqnr_db
            if cast.nonfinite:
                out.append(f"{cast.role}: {cast.nonfinite:,} non-finite values")
            if cast.rest_signal and (math.isnan(cast.rest_sqnr_db) or cast.rest_sqnr_db < rest):
                out.append(f"{cast.role} ({cast.gemms}): SQNR beside each row's largest {cast.rest_sqnr_db:.1f} dB "
                           f"< {rest:g} dB (an outlier swamps the rest)")
            if cast.flushed_share > limit:
                out.append(f"{cast.role} ({cast.gemms}): {100 * cast.flushed_share:.1f}% flushed to zero "
                           f"> {100 * limit:g}%")
            if not grad and cast.floored_share > self.fp4_max_floored_share:
                out.append(f"{cast.role} ({cast.gemms}): {100 * cast.floored_share:.1f}% in NVFP4 blocks whose e4m3 "
                           f"scale sat at its floor > {100 * self.fp4_max_floored_share:g}% (an outlier set the "
                           "tensor scale)")
            if cast.saturated_share > self.max_saturated_share:
                out.append(f"{cast.role} ({cast.gemms}): {100 * cast.saturated_share:.2f}% saturated "
                           f"> {100 * self.max_saturated_share:g}%")
        return tuple(dict.fromkeys(out))


    def reduce_problems(self, layer: LayerNumerics) -> tuple[str, ...]:
        """What the FP8 gradient reduction does to ``layer``'s weight gradient past these limits, one phrase each
        (empty when within them, or not measured: no FP8 reduction, a non-finite gradient)."""
        stats = layer.reduce
        if stats is None:
            return ()
        out = []
        small = " of the values under 1/16 of their block's largest"
        for sqnr, limit, what in ((stats.sqnr_db, self.min_reduce_sqnr_db, ""),
                                  (stats.small_sqnr_db, self.min_reduce_small_sqnr_db, small)):
            if sqnr < limit:  # nan (no signal, a non-finite gradient: a skipped step) is not judged
                out.append(f"weight gradient SQNR{what} {sqnr:.1f} dB < {limit:g} dB in FP8 blocks of {stats.block}")
        return tuple(out)


DEFAULT_THRESHOLDS = Thresholds()
"""The calibrated limits the probe and the telemetry judge a layer by (benchmarks/numerics/)."""


def as_thresholds(value: Any) -> Thresholds:
    """``value`` as :class:`Thresholds`: one already, or a mapping of some of its limits (the others keep their
    calibrated defaults). Raises TypeError for anything else, ValueError for an unknown limit or a bad value."""
    if isinstance(value, Thresholds):
        return value
    if isinstance(value, Mapping):
        return Thresholds(**route_keys(value, [Thresholds], source="the thresholds dict")[Thresholds])
    raise TypeError(f"thresholds={value!r} is a {type(value).__name__}: pass fp8dist.numerics.Thresholds(...) or "
                    "a dict of the limits to change (e.g. {'max_flushed_share': 0.02}); leave it out for the "
                    "calibrated ones.")
