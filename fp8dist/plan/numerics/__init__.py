"""FP8 numerics: what FP8 casts do to each layer, measured before training (:func:`measure_fp8_numerics`, the
``fp8dist probe`` command) and while training (:class:`FP8Telemetry`), against one set of calibrated limits
(:class:`Thresholds`). The public names are imported when first read: ``thresholds`` imports no engine (the CLI's
flags)."""

from __future__ import annotations

from typing import Any

__all__ = ["measure_fp8_numerics", "NumericsReport", "LayerNumerics", "CastStats", "Thresholds",
           "DEFAULT_THRESHOLDS", "FP8Telemetry"]


_loaded = False  # the names below imported


def __getattr__(name: str) -> Any:
    """The public names (they import torch), imported together when one is first read."""
    global _loaded
    if name.startswith("__") or _loaded:  # Python's probes (__wrapped__, ...); a name deleted since stays deleted
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .probe import measure_fp8_numerics
    from .report import NumericsReport
    from .stats import CastStats, LayerNumerics
    from .telemetry import FP8Telemetry
    from .thresholds import DEFAULT_THRESHOLDS, Thresholds

    _loaded = True
    for key, value in locals().items():
        if key in __all__:
            globals().setdefault(key, value)  # a name set before it loaded (a test's monkeypatch) is kept
    if name not in globals():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return globals()[name]
