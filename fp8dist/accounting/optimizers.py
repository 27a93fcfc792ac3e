"""What each optimizer the estimate knows keeps per parameter: ``fp8dist estimate --optimizer``'s choices, known
without importing torch."""

from __future__ import annotations

__all__ = ["OPTIMIZER_STATES", "STEP_BYTES"]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}  # states per parameter element
STEP_BYTES = {"adamw": 4, "adam": 4}  # torch's Adam keeps an fp32 ``step`` per parameter (FusedAdam: per group)
