"""The built-in cast emulation: an operand's FP8 round trip as a :class:`~fp8dist.fp8.casts.CastSpec` says, with
torchao's own functions (``tensor_to_scale``, ``hp_tensor_and_scale_to_float8``, MX's ``to_mx`` with RCEIL, as TE's
MXFP8 too); Transformer Engine's delayed and current scaling are that torchao cast fed TE's scale. What
``CastSpec.emulator()`` returns; a backend with a scaling of its own supplies its own
:class:`~fp8dist.fp8.casts.CastEmulation` instead. torchao is imported inside the calls."""

from __future__ import annotations

import math

import torch

from .casts import MX_BLOCK, NVFP4_BLOCK, CastSpec

__all__ = ["Cast"]


class Cast:
    """Casts as ``spec`` says (a :class:`~fp8dist.fp8.casts.CastEmulator`): a call returns the round trip (fp32) and
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
