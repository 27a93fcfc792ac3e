"""What a run holds in memory: measured on a live wrapped model (``report``) and predicted from shapes before
anything is allocated (``estimate``), in the same categories (``tensors``) and parts (``rows``)."""

from .estimate import MemoryEstimate, estimate_memory
from .precision_report import PrecisionReport, report
from .rows import Part, PrecisionRow

__all__ = ["report", "PrecisionReport", "PrecisionRow", "Part", "estimate_memory", "MemoryEstimate"]
