"""How an FP8 recipe casts each operand of a Linear's three GEMMs (output, input gradient, weight gradient): what a
backend's ``numerics_casts`` answers and the numerics probe emulates on a CPU. Any object of the
:class:`CastEmulation` protocol is one: the built-in :class:`CastSpec` (tensorwise, rowwise, MX, delayed, NVFP4, as
data, emulated by :mod:`.cast_emulation`) or a backend's own scaling with its own emulator. A per-row or per-block
scale runs along that GEMM's contraction dim."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ..config.dtypes import dtype_name

__all__ = ["CastEmulation", "CastEmulator", "CastSpec", "Casts", "USES", "MX_BLOCK", "NVFP4_BLOCK", "NVFP4_BYTES",
           "MXFP8_BYTES", "NVFP4_WEIGHT_TILE", "NVFP4_NOT_EMULATED", "nvfp4_casts", "float8_linear_casts"]

USES = (("input", "output"), ("weight", "output"), ("grad_output", "grad_input"), ("input", "grad_weight"),
        ("weight", "grad_input"), ("grad_output", "grad_weight"))
"""Every (operand, GEMM) pair of a Linear's three GEMMs."""

MX_BLOCK = 32
"""MXFP8: one e8m0 scale per 32 consecutive elements along the contraction dim (OCP MX v1.0)."""

NVFP4_BLOCK = 16
"""NVFP4: one e4m3 scale per 16 consecutive elements (NVIDIA's NVFP4: e2m1 values, e4m3 block scales under one fp32
scale per tensor)."""
NVFP4_BYTES = 0.5 + 1 / NVFP4_BLOCK
"""Bytes per element of an NVFP4 tensor: two e2m1 values a byte, one e4m3 scale per block (the fp32 tensor scale
aside)."""
MXFP8_BYTES = 1 + 1 / MX_BLOCK
"""Bytes per element of an MXFP8 tensor: e4m3 values, one e8m0 scale per block."""


class CastEmulator(Protocol):
    """One operand's cast at one GEMM site of the probe, called on every operand that site sees (it may keep state
    across calls, as delayed scaling's amax history)."""

    floored: torch.Tensor | None
    """After a call: the mask of values whose block scale sat at its floor (NVFP4); None where the scaling has none."""

    def __call__(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(round trip, saturated)``: ``x`` (2-D, fp32) cast as the backend casts it and back in fp32, and the bool
        mask of values the cast clamped to the format's max; ``dim``: the dim the GEMM sums over (rowwise scales and
        blocks run along it)."""
        ...


class CastEmulation(Protocol):
    """How a backend casts one operand in one GEMM, as the numerics probe and the FP8 export read it: what
    ``numerics_casts`` answers per use. :class:`CastSpec` is the built-in one; a backend with a scaling of its own
    returns an object of its own with these members."""

    @property
    def per_dim(self) -> bool:
        """The cast depends on the contraction dim: the probe measures its two uses of an operand apart (False: a
        cast equal in both GEMMs is measured once)."""
        ...

    @property
    def fp4(self) -> bool:
        """An FP4 cast: the numerics thresholds allow for its coarser values."""
        ...

    def describe(self) -> str:
        """One line naming the cast in the probe's report (element format and scaling)."""
        ...

    def emulator(self) -> CastEmulator:
        """A fresh emulator of this cast, for one GEMM site; the probe calls it once per site, before the model
        runs."""
        ...


@dataclass(frozen=True)
class CastSpec:
    """One operand's cast in one GEMM."""

    dtype: torch.dtype
    """torch.float8_e4m3fn or torch.float8_e5m2; torch.float4_e2m1fn_x2 for NVFP4."""
    scaling: Literal["tensorwise", "rowwise", "mx", "delayed", "nvfp4"]
    """One scale per tensor (its amax), per row, per :data:`MX_BLOCK` elements (e8m0), per tensor from the amax
    history (TE delayed scaling), or NVFP4's e4m3 scale per :data:`NVFP4_BLOCK` elements under an fp32 tensor scale."""
    pow2: bool = False
    """Scales rounded down to a power of 2 (torchao's rowwise recipes)."""
    margin: int = 0
    """Delayed scaling: scale = fp8 max / amax / 2^margin."""
    history_len: int = 1
    """Delayed scaling: amax history length."""
    algo: Literal["max", "most_recent"] = "max"
    """Delayed scaling: amax from the history's max or its most recent value."""
    tile: int = 1
    """NVFP4: rows per block; 16 makes 16x16 blocks (TE's weights), the same cast for either GEMM."""

    @property
    def per_dim(self) -> bool:
        """The cast depends on the contraction dim (rowwise, MX); a tensorwise cast is the same in both GEMMs."""
        return self.scaling in ("rowwise", "mx") or (self.scaling == "nvfp4" and self.tile == 1)

    @property
    def fp4(self) -> bool:
        """An FP4 cast (NVFP4): the numerics thresholds allow for its coarser values."""
        return self.scaling == "nvfp4"

    def describe(self) -> str:
        """One line naming the cast: the element format and the scaling (tensorwise, rowwise, MX or NVFP4 blocks,
        delayed with its history), ``pow2`` where scales are powers of 2."""
        name = "e2m1" if self.fp4 else dtype_name(self.dtype).removeprefix("fp8 ")
        how = {"tensorwise": "tensorwise", "rowwise": "rowwise", "mx": f"MX 1x{MX_BLOCK} e8m0",
               "nvfp4": f"NVFP4 {self.tile}x{NVFP4_BLOCK} e4m3 + fp32 tensor scale",
               "delayed": f"delayed (history {self.history_len}, {self.algo}"
                          f"{f', margin {self.margin}' if self.margin else ''})"}[self.scaling]
        return f"{name} {how}{' pow2' if self.pow2 else ''}"

    def emulator(self) -> CastEmulator:
        """The built-in emulation of this spec (:class:`~fp8dist.fp8.cast_emulation.Cast`; torchao's casts)."""
        from .cast_emulation import Cast

        return Cast(self)


Casts = dict[tuple[str, str], CastEmulation | None]
"""``{(operand, gemm): CastEmulation (a CastSpec, or a backend's own), or None where that GEMM runs in high
precision}``, for every pair of :data:`USES`."""


NVFP4_WEIGHT_TILE = 16
"""TE's NVFP4BlockScaling and torchao's NVFP4Linear both quantize weights in 16x16 blocks (one cast for both GEMMs)."""


NVFP4_NOT_EMULATED = ("NVFP4 emulated without its random Hadamard transform of the weight-gradient GEMM's "
                      "operands (it spreads an outlier over 16 values: the probe is pessimistic there) or its "
                      "stochastic rounding of gradients (unbiased, but a larger error per value than the nearest "
                      "rounding the probe does: optimistic there)")
"""What the probe's NVFP4 casts leave out of TE's and torchao's NVFP4 training, said in its report."""


def nvfp4_casts() -> Casts:
    """NVFP4 on every operand of every GEMM, the weight in :data:`NVFP4_WEIGHT_TILE` x 16 blocks."""
    return {(role, gemm): CastSpec(torch.float4_e2m1fn_x2, "nvfp4", tile=NVFP4_WEIGHT_TILE if role == "weight" else 1)
            for role, gemm in USES}


def float8_linear_casts(config: object) -> dict[tuple[str, str], CastSpec | None]:
    """The casts of torchao's ``Float8LinearConfig`` ``config`` (what a ``Float8Linear`` does), per use."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    c = config
    configs = {("input", "output"): c.cast_config_input,
               ("input", "grad_weight"): c.cast_config_input_for_grad_weight,
               ("weight", "output"): c.cast_config_weight,
               ("weight", "grad_input"): c.cast_config_weight_for_grad_input,
               ("grad_output", "grad_input"): c.cast_config_grad_output,
               ("grad_output", "grad_weight"): c.cast_config_grad_output_for_grad_weight}
    return {use: None if cc.scaling_type is ScalingType.DISABLED else CastSpec(
        cc.target_dtype, "tensorwise" if cc.scaling_granularity is ScalingGranularity.TENSORWISE else "rowwise",
        pow2=c.round_scales_to_power_of_2) for use, cc in configs.items()}
