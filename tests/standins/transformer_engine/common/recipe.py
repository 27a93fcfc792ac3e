"""STAND-IN of transformer_engine.common.recipe: the recipe classes as plain records."""

from dataclasses import dataclass
from enum import Enum


class Format(Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


@dataclass
class DelayedScaling:
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    override_linear_precision: tuple = (False, False, False)
    reduce_amax: bool = True


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID


@dataclass
class MXFP8BlockScaling:
    fp8_format: Format = Format.E4M3
