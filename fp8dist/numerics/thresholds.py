"""Where a layer's FP8 numerics stop being healthy: the one place the probe's and the telemetry's limits are
written, with the measurements they come from.

Source: benchmarks/numerics/results.md (``python benchmarks/numerics/calibrate.py``): every FP8 layer of Llama,
GPT-2, Mixtral and Qwen3 (small configs, no download) measured by :func:`fp8dist.measure_fp8_numerics` at
initialization and after training on the built-in corpus, under torchao tensorwise and rowwise and Transformer
Engine's recipes (emulated). The limits sit outside everything those healthy layers showed, with a margin, and
inside what a planted outlier channel does (1e5 in one input channel: tensorwise e4m3 then flushes most ordinary
values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .stats import LayerNumerics

__all__ = ["Thresholds", "DEFAULT_THRESHOLDS"]


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Limits past which a layer is recommended to stay out of FP8."""

    min_output_sqnr_db: float = 18.0
    """The forward GEMM's output with FP8 operands against high precision: below this, excluded. Healthy layers
    measured >= 25.5 dB (e4m3 x e4m3, worst layer of every family and recipe)."""

    max_flushed_share: float = 0.01
    """Share of an input's or a weight's non-zero values flushed to zero by the cast. Healthy layers measured
    <= 0.1% (inputs and weights); the planted outlier channel flushes over 10%."""

    max_grad_flushed_share: float = 0.05
    """The same for the output gradient (e5m2 under torchao tensorwise and TE HYBRID, e4m3 under rowwise).
    Healthy layers measured <= 1%."""

    max_saturated_share: float = 0.001
    """Share of values beyond the largest the cast represents (clamped): only delayed scaling saturates (a
    value larger than the amax history's). Current and block scaling never do."""

    def __post_init__(self) -> None:
        for name in ("max_flushed_share", "max_grad_flushed_share", "max_saturated_share"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"{name}={value} must be a share between 0 and 1 (0.01 is 1%).")

    def problems(self, layer: LayerNumerics) -> tuple[str, ...]:
        """What in ``layer`` crosses these limits, one phrase each (empty when nothing does)."""
        out = []
        sqnr = layer.output.sqnr_db
        if layer.calls and (math.isnan(sqnr) or sqnr < self.min_output_sqnr_db):
            out.append(f"output SQNR {sqnr:.1f} dB < {self.min_output_sqnr_db:g} dB")
        for cast in layer.casts:
            limit = self.max_grad_flushed_share if cast.role == "grad_output" else self.max_flushed_share
            if cast.nonfinite:
                out.append(f"{cast.role}: {cast.nonfinite:,} non-finite values")
            if cast.flushed_share > limit:
                out.append(f"{cast.role} ({cast.gemms}): {100 * cast.flushed_share:.1f}% flushed to zero "
                           f"> {100 * limit:g}%")
            if cast.saturated_share > self.max_saturated_share:
                out.append(f"{cast.role} ({cast.gemms}): {100 * cast.saturated_share:.2f}% saturated "
                           f"> {100 * self.max_saturated_share:g}%")
        return tuple(dict.fromkeys(out))


DEFAULT_THRESHOLDS = Thresholds()
"""The calibrated limits (see the module docstring for their source)."""
