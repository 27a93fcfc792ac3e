"""FP8 numerics: what FP8 casts do to each layer, measured before training (:func:`measure_fp8_numerics`, the
``fp8dist probe`` command) and while training (:class:`FP8Telemetry`), against one set of calibrated limits
(:class:`Thresholds`). The public names are imported when first read: ``thresholds`` imports no engine (the CLI's
flags)."""

from __future__ import annotations

from typing import Any

from ..config.lazy import lazy_names

__all__ = ["measure_fp8_numerics", "NumericsReport", "LayerNumerics", "CastStats", "Thresholds",
           "DEFAULT_THRESHOLDS", "FP8Telemetry"]


def _load() -> dict[str, Any]:
    """The public names (they import torch), imported together when one is first read."""
    from .probe import measure_fp8_numerics
    from .report import NumericsReport
    from .stats import CastStats, LayerNumerics
    from .telemetry import FP8Telemetry
    from .thresholds import DEFAULT_THRESHOLDS, Thresholds

    return locals()


__getattr__ = lazy_names(globals(), _load)
