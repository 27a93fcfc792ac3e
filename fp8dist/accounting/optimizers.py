"""What each optimizer the estimate knows keeps per parameter: ``fp8dist estimate --optimizer``'s choices, known
without importing torch."""

from __future__ import annotations

__all__ = ["OPTIMIZER_STATES", "STEP_BYTES"]

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
"""The optimizers the memory estimate knows (its ``optimizer=`` choices), each with its states per parameter element
(Adam: exp_avg and exp_avg_sq; SGD with momentum: the momentum buffer)."""
STEP_BYTES = {"adamw": 4, "adam": 4}
"""Bytes of the ``step`` count per parameter tensor (torch's Adam keeps it as an fp32 tensor per parameter; FusedAdam:
per group); an optimizer not listed keeps none."""
