"""How an FP8 recipe casts each operand of a layer's GEMMs, as data (:class:`CastSpec`), and the cast itself.

A Linear ``y = x @ W_t`` runs three GEMMs: output (``x @ W_t``), input gradient (``g @ W_t.T``) and weight
gradient (``x.T @ g``); each operand (input ``x`` (M, K), weight ``W_t`` (K, N), output gradient ``g`` (M, N)) is
cast in two of them, scaled along that GEMM's contraction dim where the recipe scales per row or per block.

The casts call the backend's own functions where they run here: torchao's ``tensor_to_scale`` and
``hp_tensor_and_scale_to_float8`` (what ``Float8Linear`` calls) and ``to_mx`` (MXFP8, what torchao's MoE training
and Transformer Engine's MXFP8 compute: e8m0 block scales rounded up, RCEIL). Transformer Engine cannot run here:
its delayed scaling (a scale from the amax history) and current scaling are emulated with the same torchao cast,
fed TE's scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ...config.dtypes import dtype_name

__all__ = ["CastSpec", "Cast", "USES", "CONTRACTION_DIM", "MX_BLOCK", "recipe_casts", "float8_linear_casts"]

USES = (("input", "output"), ("weight", "output"), ("grad_output", "grad_input"), ("input", "grad_weight"),
        ("weight", "grad_input"), ("grad_output", "grad_weight"))
"""Every (operand, GEMM) pair of a Linear's three GEMMs."""

CONTRACTION_DIM = {("input", "output"): -1, ("weight", "output"): 0, ("grad_output", "grad_input"): -1,
                   ("input", "grad_weight"): 0, ("weight", "grad_input"): -1, ("grad_output", "grad_weight"): 0}
"""The dim of the 2-D operand (x (M, K), W_t (K, N), g (M, N)) that the GEMM sums over: rowwise scales and MX
blocks run along it (torchao's ``axiswise_dim`` for the same use)."""

MX_BLOCK = 32
"""MXFP8: one e8m0 scale per 32 consecutive elements along the contraction dim (OCP MX v1.0)."""


@dataclass(frozen=True)
class CastSpec:
    """One operand's cast in one GEMM."""

    dtype: torch.dtype
    """torch.float8_e4m3fn or torch.float8_e5m2."""
    scaling: Literal["tensorwise", "rowwise", "mx", "delayed"]
    """One scale per tensor from its amax; one per row along the contraction dim; one e8m0 scale per
    :data:`MX_BLOCK` elements; or one per tensor from the amax history of earlier steps (TE delayed scaling)."""
    pow2: bool = False
    """Scales rounded down to a power of 2 (torchao's rowwise recipes)."""
    margin: int = 0
    """Delayed scaling: scale = fp8 max / amax / 2^margin."""
    history_len: int = 1
    """Delayed scaling: amax history length."""
    algo: Literal["max", "most_recent"] = "max"
    """Delayed scaling: amax from the history's max or its most recent value."""

    @property
    def per_dim(self) -> bool:
        """The cast depends on the contraction dim (rowwise, MX); a tensorwise cast is the same in both GEMMs."""
        return self.scaling in ("rowwise", "mx")

    def describe(self) -> str:
        name = dtype_name(self.dtype).removeprefix("fp8 ")
        how = {"tensorwise": "tensorwise", "rowwise": "rowwise", "mx": f"MX 1x{MX_BLOCK} e8m0",
               "delayed": f"delayed (history {self.history_len}, {self.algo}"
                          f"{f', margin {self.margin}' if self.margin else ''})"}[self.scaling]
        return f"{name} {how}{' pow2' if self.pow2 else ''}"


class Cast:
    """Casts tensors as ``spec`` says: each call returns the FP8 round trip (dequantized, fp32) and the mask of
    the values the cast clamped to the format's largest (saturated). Delayed scaling keeps its amax
    history across calls, as TE keeps it across steps."""

    def __init__(self, spec: CastSpec) -> None:
        self.spec = spec
        self.history: list[torch.Tensor] = []

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.spec.scaling == "mx":
            return _mx_round_trip(x, self.spec.dtype, dim)
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
    """Beyond this magnitude a scaled value would round past the format's max: the clamp changed it (a value
    within half a step of the max rounds to the max anyway)."""
    info = torch.finfo(dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


def _scaled_round_trip(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's cast with a given scale (saturating), back to fp32; and where ``x`` x scale exceeded the
    format's max (what torchao's ``to_fp8_saturated`` clamps)."""
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

    fp8 = hp_tensor_and_scale_to_float8(x, scale, dtype)
    return fp8._data.float() / fp8._scale, (x.float() * scale).abs() > _rounds_to_max(dtype)


def _mx_round_trip(x: torch.Tensor, dtype: torch.dtype, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's MX cast (RCEIL) in blocks along ``dim`` (zero-padded to whole blocks), back to fp32."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_dtype, to_mx

    rows = x.float().movedim(dim, -1)
    length = rows.shape[-1]
    pad = -length % MX_BLOCK
    rows = torch.nn.functional.pad(rows, (0, pad)).contiguous()
    scale, data = to_mx(rows, dtype, MX_BLOCK, ScaleCalculationMode.RCEIL)
    back = to_dtype(data, scale, dtype, MX_BLOCK, torch.float32)
    block_scale = get_fp_scale(scale).reshape(-1, 1).expand(-1, MX_BLOCK).reshape(rows.shape)
    saturated = (rows / block_scale).abs() > _rounds_to_max(dtype)  # power-of-2 scales: the division is exact
    return back[..., :length].movedim(-1, dim), saturated[..., :length].movedim(-1, dim)


def float8_linear_casts(config) -> dict[tuple[str, str], CastSpec | None]:
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


def _experts_casts(cfg, hardware) -> dict[tuple[str, str], CastSpec | None]:
    """torchao's MoE grouped GEMMs: FP8 rowwise (e4m3, power-of-2 scales) or MXFP8 (RCEIL), as its op config
    says (optionally the weight gradient in high precision)."""
    from ...fp8.moe import experts_recipe, op_config

    recipe, _ = experts_recipe(cfg, hardware)
    config = op_config(recipe)
    if recipe == "fp8_rowwise":
        return {use: CastSpec(config.float8_dtype, "rowwise", pow2=True) for use in USES}
    hp_wgrad = bool(getattr(config, "wgrad_with_hp", False))
    return {use: None if hp_wgrad and use[1] == "grad_weight" else CastSpec(torch.float8_e4m3fn, "mx")
            for use in USES}


def _te_casts(cfg) -> dict[tuple[str, str], CastSpec | None]:
    """Transformer Engine's recipe: HYBRID casts gradients to e5m2, E4M3 everything to e4m3."""
    p = cfg.precision
    grad = torch.float8_e5m2 if p.fp8_format == "HYBRID" else torch.float8_e4m3fn
    out = {}
    for role, gemm in USES:
        dtype = grad if role == "grad_output" else torch.float8_e4m3fn
        if p.te_recipe == "delayed":
            out[(role, gemm)] = CastSpec(dtype, "delayed", margin=p.margin, history_len=p.amax_history_len,
                                         algo=p.amax_compute_algo)
        else:
            out[(role, gemm)] = CastSpec(dtype, "mx" if p.te_recipe == "mxfp8" else "tensorwise")
    return out


def recipe_casts(cfg, entry, hardware, facts) -> dict[tuple[str, str], CastSpec | None]:
    """``{(operand, gemm): CastSpec or None (high precision)}`` for a plan entry that runs in FP8 on ``hardware``
    under a strategy with ``facts`` (the plan's).

    Raises:
        NotImplementedError: a backend whose casts the probe does not model (MS-AMP).
    """
    if entry.grouped:
        return _experts_casts(cfg, hardware)
    if cfg.precision.fp8 == "torchao":
        from ...fp8.torchao import float8_config

        return float8_linear_casts(float8_config(cfg, facts))  # one source: the config fp8dist converts with
    if cfg.precision.fp8 == "te":
        return _te_casts(cfg)
    raise NotImplementedError(f"fp8={cfg.precision.fp8!r}: the numerics probe models the casts of torchao and "
                              "Transformer Engine only (MS-AMP's scaling tensors are not modeled). Probe with "
                              "fp8='torchao' or fp8='te'.")
