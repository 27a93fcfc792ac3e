"""FP8 numerics: what FP8 casts do to each layer, measured before training (:func:`measure_fp8_numerics`, the
``fp8dist probe`` command) and while training (:class:`FP8Telemetry`), against one set of calibrated limits
(:class:`Thresholds`)."""

from .probe import measure_fp8_numerics
from .report import NumericsReport
from .stats import CastStats, LayerNumerics
from .telemetry import FP8Telemetry
from .thresholds import DEFAULT_THRESHOLDS, Thresholds

__all__ = ["measure_fp8_numerics", "NumericsReport", "LayerNumerics", "CastStats", "Thresholds",
           "DEFAULT_THRESHOLDS", "FP8Telemetry"]
