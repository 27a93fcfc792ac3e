"""STAND-IN for NVIDIA Transformer Engine's API surface (see tests/standins/README.md). Not Transformer Engine.

It follows the signatures of TE 2.20.2 as read from its sources (../shared/te-offline): ``te.autocast(enabled,
calibrating, recipe, amax_reduction_group)`` with ``fp8_autocast(fp8_recipe, fp8_group)`` as a deprecated shim,
and a ``DelayedScaling`` without ``interval`` and
``override_linear_precision`` that silently drops unknown keywords (TE's recipes are pydantic dataclasses, whose
default is to ignore extra arguments). With FP8DIST_TE_STANDIN_API=2.8 in the environment at import it is the
API before TE 2.9: only ``fp8_autocast``, and ``DelayedScaling`` still takes both knobs.
"""

import os

STANDIN = True
API = os.environ.get("FP8DIST_TE_STANDIN_API", "2.20")
if API not in ("2.20", "2.8"):
    raise ValueError(f"FP8DIST_TE_STANDIN_API={API!r}: choose 2.20 or 2.8")
__version__ = f"{API}.0+standin"
