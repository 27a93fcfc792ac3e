"""STAND-IN of transformer_engine.common.recipe: the recipe classes as plain records, with TE 2.20's fields (or
TE 2.8's, see the package docstring)."""

import dataclasses
from dataclasses import dataclass
from enum import Enum

from .. import API


class Format(Enum):
    E2M1 = "E2M1"
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


@_ignoring_extras
@dataclass
class Float8BlockScaling:  # TE 2.20's fields (its QParams / MMParams class attributes left out) and checks
    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: object = None

    def __post_init__(self):
        dims = (self.x_block_scaling_dim, self.w_block_scaling_dim, self.grad_block_scaling_dim)
        assert all(d in (1, 2) for d in dims), "Only 1D or 2D blocks supported"
        assert sum(d == 2 for d in dims) <= 1, "2D by 2D block gemm not supported."
        assert not self.fp8_dpa and not self.fp8_mha, "FP8 attention is not supported for Float8BlockScaling."
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."


@_ignoring_extras
@dataclass
class NVFP4BlockScaling:  # TE 2.20's fields and checks: its fp8_format is the block scales', E4M3 only
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: object = None

    def __post_init__(self):
        assert self.fp4_format == Format.E2M1, "Only E2M1 is supported for NVFP4 scaling"
        assert self.fp8_format == Format.E4M3, "Only E4M3 is supported for NVFP4 scaling"
