"""What a run holds in memory: measured on a live wrapped model (``report``) and predicted from shapes before
anything is allocated (``estimate``), in the same categories (``tensors``) and parts (``rows``)."""

from __future__ import annotations

from typing import Any

from ..config.lazy import lazy_names

__all__ = ["report", "PrecisionReport", "PrecisionRow", "Part", "estimate_memory", "MemoryEstimate"]


def _load() -> dict[str, Any]:
    """The public names (they import torch), imported when first read: importing a light module of this package
    (``optimizers``, the CLI's choices) imports no engine."""
    from .estimate import MemoryEstimate, estimate_memory
    from .precision_report import PrecisionReport, report
    from .rows import Part, PrecisionRow

    return locals()


__getattr__ = lazy_names(globals(), _load)
