"""How an FP8 recipe casts each operand of a Linear's three GEMMs (output, input gradient, weight gradient): what a
backend's ``numerics_casts`` answers and the numerics probe emulates on a CPU. Any object of the
:class:`CastEmulation` protocol is one: the built-in :class:`CastSpec` (tensorwise, rowwise, MX, delayed, NVFP4, as
data, emulated by :class:`Cast`) or a backend's own scaling with its own emulator. A per-row or per-block scale runs
along that GEMM's contraction dim.

The built-in emulation: an operand's FP8 round trip as a :class:`CastSpec` says, with torchao's own functions
(``tensor_to_scale``, ``hp_tensor_and_scale_to_float8``, MX's ``to_mx`` with RCEIL, as TE's MXFP8 too); Transformer
Engine's delayed and current scaling are that torchao cast fed TE's scale. torchao is imported inside the calls."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ..config.dtypes import dtype_name

__all__ = ["CastEmulation", "CastEmulator", "CastSpec", "Cast", "Casts", "USES", "MX_BLOCK", "NVFP4_BLOCK",
           "NVFP4_BYTES", "MXFP8_BYTES", "NVFP4_WEIGHT_TILE", "NVFP4_NOT_EMULATED", "nvfp4_casts",
           "float8_linear_casts"]

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
        """The built-in emulation of this spec (:class:`Cast`: torchao's casts), fresh for one GEMM site."""
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


class Cast:
    """Casts as ``spec`` says (a :class:`CastEmulator`): a call returns the round trip (fp32) and
    the mask of values clamped to the format's max. Delayed scaling keeps its amax history across calls, as TE does
    across steps."""

    def __init__(self, spec: CastSpec) -> None:
        self.spec = spec
        self.history: list[torch.Tensor] = []
        self.floored: torch.Tensor | None = None  # NVFP4: the last call's values whose block scale sat at its floor

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x`` cast and back in fp32``, mask of values clamped to the format's max)``, scales (rowwise, MX, NVFP4
        blocks) along ``dim``; NVFP4 also sets :attr:`floored`. Needs torchao (ImportError without it)."""
        if self.spec.scaling == "mx":
            return _mx_round_trip(x, self.spec.dtype, dim)
        if self.spec.scaling == "nvfp4":
            back, saturated, self.floored = _nvfp4_round_trip(x, dim, self.spec.tile)
            return back, saturated
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_scale

        spec = self.spec
        if spec.scaling == "delayed":
            amax_now = x.detach().abs().max().float()
            window = (self.history or [amax_now])[-spec.history_len:]  # the first step: a warmed-up history
            amax = window[-1] if spec.algo == "most_recent" else torch.stack(window).max()
            scale = amax_to_scale(amax, spec.dtype) / 2 ** spec.margin
            self.history.append(amax_now)
        elif spec.scaling == "rowwise":
            scale = tensor_to_scale(x, spec.dtype, scaling_granularity=ScalingGranularity.AXISWISE,
                                    axiswise_dim=dim, round_scales_to_power_of_2=spec.pow2)
        else:
            scale = tensor_to_scale(x, spec.dtype, round_scales_to_power_of_2=spec.pow2)
        return _scaled_round_trip(x, scale, spec.dtype)


def _rounds_to_max(dtype: torch.dtype) -> float:
    """Past this a scaled value was changed by the clamp (within half a step of the max it rounds to it anyway)."""
    info = torch.finfo(dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


def _scaled_round_trip(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's saturating cast with ``scale``, back to fp32, and the mask of what ``to_fp8_saturated`` clamped."""
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    fp8 = hp_tensor_and_scale_to_float8(x, scale, dtype)
    return fp8._data.float() / fp8._scale, (x.float() * scale).abs() > _rounds_to_max(dtype)


def _mx_round_trip(x: torch.Tensor, dtype: torch.dtype, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's MX cast (RCEIL) in blocks along ``dim`` (zero-padded to whole blocks), back to fp32."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_dtype, to_mx

    rows = x.float().movedim(dim, -1)
    length = rows.shape[-1]
    rows = torch.nn.functional.pad(rows, (0, -length % MX_BLOCK)).contiguous()
    scale, data = to_mx(rows, dtype, MX_BLOCK, ScaleCalculationMode.RCEIL)
    back = to_dtype(data, scale, dtype, MX_BLOCK, torch.float32)
    block_scale = get_fp_scale(scale).reshape(-1, 1).expand(-1, MX_BLOCK).reshape(rows.shape)
    saturated = (rows / block_scale).abs() > _rounds_to_max(dtype)  # power-of-2 scales: the division is exact
    return back[..., :length].movedim(-1, dim), saturated[..., :length].movedim(-1, dim)


_E2M1_MAX, _E2M1_ROUNDS_TO_MAX = 6.0, 7.0  # e2m1's max, and past what rounds to it (half its step of 2 above 4)


def _nvfp4_round_trip(x: torch.Tensor, dim: int, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4's cast along ``dim`` in ``tile`` x 16 blocks (zero-padded), back to fp32: tensor scale amax / (448 x 6),
    each block's (its amax / 6 over it) in e4m3, values in e2m1 (nearest, ties to even). The third mask: values of
    blocks whose scale fell under e4m3's smallest normal and got that floor (torchao's clamp), as an outlier causes."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked
    from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

    rows = x.float().movedim(dim, -1)
    shape = rows.shape
    flat = rows.reshape(-1, shape[-1])
    padded = torch.nn.functional.pad(flat, (0, -flat.shape[1] % NVFP4_BLOCK, 0, -flat.shape[0] % tile))
    tiles = padded.reshape(padded.shape[0] // tile, tile, padded.shape[1] // NVFP4_BLOCK, NVFP4_BLOCK)
    tensor_scale = per_tensor_amax_to_scale(flat.abs().amax() if flat.numel() else torch.zeros(()))
    if tensor_scale == 0:  # all zeros: nothing to scale, the round trip is exact
        none = torch.zeros_like(x, dtype=torch.bool)
        return x.float(), none, none
    info = torch.finfo(torch.float8_e4m3fn)
    wanted = tiles.abs().amax(dim=(1, 3), keepdim=True) / _E2M1_MAX / tensor_scale
    block = wanted.clamp(info.tiny, info.max).to(torch.float8_e4m3fn).float()
    floored = ((wanted < info.tiny) & (tiles != 0)).expand(tiles.shape)
    scaled = tiles * ((1.0 / tensor_scale) / block)  # torchao's order of operations: the same roundings
    saturated = scaled.abs() > _E2M1_ROUNDS_TO_MAX
    values = f4_unpacked_to_f32(f32_to_f4_unpacked(scaled.clamp(-_E2M1_MAX, _E2M1_MAX)))
    back = values * (block * tensor_scale)

    def unpadded(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(padded.shape)[:flat.shape[0], :flat.shape[1]].reshape(shape).movedim(-1, dim)

    return unpadded(back), unpadded(saturated), unpadded(floored)
