"""STAND-IN of transformer_engine.common.recipe: the recipe classes as plain records, with TE 2.20's fields (or
TE 2.8's, see the package docstring)."""

import dataclasses
from dataclasses import dataclass
from enum import Enum

from .. import API


class Format(Enum):
    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


def _ignoring_extras(cls):
    """As pydantic's dataclasses (TE's recipes) do by default: keywords that are not fields are dropped."""
    init = cls.__init__
    names = {f.name for f in dataclasses.fields(cls)}

    def __init__(self, *args, **kwargs):
        init(self, *args, **{k: v for k, v in kwargs.items() if k in names})

    cls.__init__ = __init__
    return cls


@dataclass
class DelayedScaling:  # TE 2.20's fields
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: object = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False


if API == "2.8":
    @dataclass
    class DelayedScaling(DelayedScaling):  # noqa: F811 -- and the two TE 2.x dropped
        override_linear_precision: tuple = (False, False, False)
        interval: int = 1
else:
    DelayedScaling = _ignoring_extras(DelayedScaling)


@dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.HYBRID


@dataclass
class MXFP8BlockScaling:
    fp8_format: Format = Format.E4M3
