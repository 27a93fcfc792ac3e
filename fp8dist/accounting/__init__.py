"""What a run holds in memory: measured on a live wrapped model (``report``) and predicted from shapes before
anything is allocated (``estimate``), in the same categories (``tensors``) and parts (``rows``)."""

from __future__ import annotations

from typing import Any

__all__ = ["report", "PrecisionReport", "PrecisionRow", "Part", "estimate_memory", "MemoryEstimate"]


_loaded = False  # the names below imported


def __getattr__(name: str) -> Any:
    """The public names (they import torch), imported when first read: importing a light module of this package
    (``optimizers``, the CLI's choices) imports no engine."""
    global _loaded
    if name.startswith("__") or _loaded:  # Python's probes (__wrapped__, ...); a name deleted since stays deleted
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .estimate import MemoryEstimate, estimate_memory
    from .precision_report import PrecisionReport, report
    from .rows import Part, PrecisionRow

    _loaded = True
    for key, value in locals().items():
        if key in __all__:
            globals().setdefault(key, value)  # a name set before it loaded (a test's monkeypatch) is kept
    if name not in globals():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return globals()[name]
