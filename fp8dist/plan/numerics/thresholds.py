"""Where a layer's FP8 numerics stop being healthy: the one place the probe's and the telemetry's limits are
written, with the measurements they come from.

Source: benchmarks/numerics/results.md (``python benchmarks/numerics/calibrate.py``, 2026-11-24): every
FP8-eligible GEMM of Llama, GPT-2, Mixtral and Qwen3 (3-4 M parameter configs, no download) measured by
:func:`fp8dist.measure_fp8_numerics` at initialization and after 200 steps on the built-in corpus, under torchao
tensorwise and rowwise and Transformer Engine's delayed, current and MXFP8 recipes (emulated). The limits sit
outside everything those healthy layers showed, with a margin, and inside what a planted outlier channel does (1e5
in one input channel: tensorwise e4m3 then flushes most of the layer's ordinary values). Small models trained
briefly: outliers that grow over billions of tokens (Fishman et al., arXiv 2409.12517) are stood in for by the
planted one. The ``fp4_*`` limits: the Llama of that script under Transformer Engine's NVFP4 (emulated; its
``build``, ``train`` (200 steps) and ``plant_outlier`` with te_recipe='nvfp4', keep_last_blocks_share=0, on 2 of its
probe batches, 2026-11-26; GPT-2 the same way: within every limit at initialization and after training).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...config.schema import normalize_fields, route_keys
from .stats import LayerNumerics

__all__ = ["Thresholds", "DEFAULT_THRESHOLDS", "as_thresholds"]


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Limits past which a layer is recommended to stay out of FP8."""

    min_output_sqnr_db: float = 20.0
    """The forward GEMM's output with FP8 operands against high precision: below this, excluded. Healthy layers
    measured >= 27.6 dB (an e4m3 x e4m3 GEMM of well-scaled operands gives about 28 dB); 20 dB is an error a tenth
    of the output's amplitude. It misses an outlier channel (the outlier dominates input and output alike: the
    planted one measured 32 dB); the flushed share below catches it."""

    min_grad_sqnr_db: float = 10.0
    """The same for the backward GEMMs' outputs, the input gradient (``g @ W``) and the weight gradient
    (``g.T @ x``), each from the operands as the recipe casts them for that GEMM: what reaches the weights. Healthy
    layers measured >= 16.0 dB (Qwen3's first attention projection after training, TE delayed: its amax history
    warmed on one batch clamps a few values; every other recipe >= 22.9 dB), measured on the calibration's four
    models, batches and recipes after 200 steps (benchmarks/numerics/calibrate.py records it now); 10 dB is an
    error a third of the gradient's amplitude. It catches a gradient spike that delayed scaling clamps
    (0 dB: the spike is lost) while fewer values saturate than the saturation limit sees."""

    min_rest_sqnr_db: float = 15.0
    """Each operand's SQNR over the values beside the largest of each dot product it enters (a row along the
    GEMM's contraction dim). An outlier that sets a row's scale flushes that row's ordinary values: this falls
    (an outlier in 8% of the output gradient's rows: 10.6 dB, about -10 log10 of the share of rows swamped) while
    the plain SQNR stays high and the flushed share (8%) stays far under the gradient limit. Values flushed because
    they are tiny beside their row's ordinary ones (a gradient's long tail) cost it nothing: healthy layers measured
    >= 18.4 dB (TE delayed's clamped gradients, Qwen3 after training; every other recipe >= 23.4 dB, e4m3 operands
    >= 31.0 dB), rowwise gradients that flush 25% (Mixtral) and 35% (GPT-2's output layer) included (>= 31.0 dB)."""

    max_flushed_share: float = 0.01
    """Share of an input's or a weight's non-zero values flushed to zero by the cast. Healthy layers measured
    <= 0.15% (inputs: SwiGLU down projections after training) and <= 0.01% (weights); the planted outlier channel
    (1e5) flushed 52% of a trained layer's input, 99.7% of an initialized one's."""

    max_grad_flushed_share: float = 0.5
    """The same for the output gradient. Gradients flush a lot in healthy layers: up to 12.8% (Mixtral experts,
    e4m3 rowwise), 25% (a Mixtral attention projection under torchao rowwise) and 35% (the output layer under
    torchao rowwise, e4m3 gradients: its softmax gradient spans more than e4m3's range); small gradient values carry
    little of the update, so only a gradient that loses most of its values is flagged here. A share cannot tell
    those tails from ordinary values an outlier swamps (8% of a gradient flushed either way): ``min_rest_sqnr_db``
    does."""

    fp4_min_output_sqnr_db: float = 10.0
    """``min_output_sqnr_db`` for a GEMM with FP4 operands (NVFP4): e2m1 keeps one mantissa bit to e4m3's three,
    about 12 dB less SQNR for any operand. Healthy layers measured >= 15.8 dB under TE's NVFP4 (emulated; Llama at
    initialization, MXFP8 on the same layers 27.8 dB; after training >= 23.8 dB); 10 dB is an error a third of the
    output's amplitude: a gross error only (the planted outlier measured 18.8-20.3 dB)."""

    fp4_min_rest_sqnr_db: float = 6.0
    """``min_rest_sqnr_db`` for an FP4 cast. Healthy layers measured >= 11.9 dB at initialization (MXFP8: 25.4),
    >= 18.8 dB after training; the planted outlier channel (1e5) 1.7 dB at initialization but 14.9 dB after training:
    between the two, so a gross error only; ``fp4_max_floored_share`` catches the outlier."""

    fp4_max_flushed_share: float = 0.6
    """``max_flushed_share`` for an FP4 cast of an input or a weight: e2m1's smallest non-zero value is a twelfth of
    its largest, so a 16-value block flushes what is under 1/24 of its amax. Healthy layers measured <= 23.3% at
    initialization, <= 41.1% after training (SwiGLU down projections' inputs; weights <= 11.1%); the planted outlier
    channel 97.5% at initialization, 50.8% after training."""

    fp4_max_grad_flushed_share: float = 0.95
    """``max_grad_flushed_share`` for an FP4 cast of the output gradient. Healthy layers measured up to 66.7% (blocks
    0-2 of the trained Llama), 76.4% in its last block and 86.2% in its output head: what nearest rounding flushes,
    which TE's stochastic rounding of gradients (not emulated) keeps in expectation; only a gradient that loses
    nearly every value is flagged."""

    fp4_max_floored_share: float = 0.01
    """For an FP4 cast of an input or a weight: share of its non-zero values in blocks whose e4m3 scale sat at its
    floor (e4m3's smallest normal), coarser than they needed: the tensor scale an outlier sets (its amax / 2,688)
    leaves the ordinary blocks' scales below e4m3's range. This, not the flushed share, tells an outlier under NVFP4,
    whose own resolution flushes much. Healthy layers measured 0% (inputs and weights, Llama at initialization and
    after training; GPT-2 <= 0.02%); the planted outlier channel 99.9% of its layer's input at
    initialization, 63.6% after training (the layers after it <= 0.26%). Output gradients are not judged by it: their
    long tails floor blocks in healthy layers (after training up to 32% in blocks 0-2, 45% in the last, 83% in the
    head)."""

    max_saturated_share: float = 0.001
    """Share of values the cast clamped (beyond what rounds to the format's max): only delayed scaling clamps (a
    value larger than the amax history's). Healthy layers measured <= 0.01% (TE delayed, after training)."""

    def __post_init__(self) -> None:
        normalize_fields(self)  # a number each ("0.02" from a file or flag too); a bool or a word is refused
        for name in ("max_flushed_share", "max_grad_flushed_share", "max_saturated_share", "fp4_max_flushed_share",
                     "fp4_max_grad_flushed_share", "fp4_max_floored_share"):
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


DEFAULT_THRESHOLDS = Thresholds()
"""The calibrated limits (see the module docstring for their source)."""


def as_thresholds(value: Any) -> Thresholds:
    """``value`` as :class:`Thresholds`: one already, or a mapping of some of its limits (the others keep their
    calibrated defaults). Raises TypeError for anything else, ValueError for an unknown limit or a bad value."""
    if isinstance(value, Thresholds):
        return value
    if isinstance(value, Mapping):
        return Thresholds(**route_keys(value, [Thresholds], source="the thresholds dict")[Thresholds])
    raise TypeError(f"thresholds={value!r} is a {type(value).__name__}: pass fp8dist.plan.numerics.Thresholds(...) or a "
                    "dict of the limits to change (e.g. {'max_flushed_share': 0.02}); leave it out for the "
                    "calibrated ones.")
