"""What a run holds in memory: measured on a live wrapped model (``report``) and predicted from shapes before
anything is allocated (``estimate``), in the same categories (``tensors``) and parts (``rows``)."""

from __future__ import annotations

from typing import Any

__all__ = ["report", "PrecisionReport", "PrecisionRow", "Part", "estimate_memory", "MemoryEstimate"]


def __getattr__(name: str) -> Any:
    """The public names (they import torch), imported when first read: importing a light module of this package
    (``optimizers``, the CLI's choices) imports no engine."""
    from .estimate import MemoryEstimate, estimate_memory
    from .precision_report import PrecisionReport, report
    from .rows import Part, PrecisionRow

    public = {key: value for key, value in locals().items() if key in __all__}
    if name not in public:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals().update(public)
    return public[name]
