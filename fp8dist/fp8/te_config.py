"""Transformer Engine's knobs: :class:`TEConfig`, the TE backend's ``Config``, apart from the backend so that the
options (the CLI's flags) are known without importing torch or Transformer Engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..config.axis import When

__all__ = ["TEConfig"]

_DELAYED = When({"te_recipe": ("delayed",)})  # knobs DelayedScaling alone reads
_FP8_FORMATTED = When({"te_recipe": ("delayed", "current", "mxfp8", "blockwise")})  # NVFP4's format is fixed


@dataclass(kw_only=True, frozen=True)
class TEConfig:
    """Transformer Engine's own knobs (flat keys of the config; read only when ``fp8='te'``)."""
    te_recipe: Literal["delayed", "current", "mxfp8", "blockwise", "nvfp4"] = "delayed"
    """Transformer Engine recipe: delayed (DelayedScaling, amax history), current (Float8CurrentScaling), mxfp8
    (MXFP8BlockScaling, 1x32 blocks, sm_100+), blockwise (Float8BlockScaling: 1x128 blocks for activations and
    gradients, 128x128 for weights; sm_90+ and CUDA >= 12.9) or nvfp4 (NVFP4BlockScaling: FP4 e2m1 in 1x16 blocks
    with e4m3 scales and a per-tensor scale, 16x16 weight blocks; sm_100+)."""
    fp8_format: Literal["E4M3", "HYBRID"] = field(default="HYBRID", metadata={"when": _FP8_FORMATTED, "refused": {
        "E5M2": ("E5M2 alone lacks the precision forward activations and weights need. Choose 'HYBRID' (E4M3 "
                 "forward, E5M2 gradients) or 'E4M3'.")}})
    """TE FP8 format: HYBRID (E4M3 forward, E5M2 gradients) or E4M3 everywhere (NVFP4's format is fixed)."""
    margin: int = field(default=0, metadata={"when": _DELAYED, "min": 0})
    """TE delayed scaling: scale = (fp8 max / amax) / 2^margin."""
    interval: int = field(default=1, metadata={"when": _DELAYED, "min": 1})
    """TE delayed scaling: steps between scale updates (TE 1.x; TE 2.x has none: only 1, the default, is accepted)."""
    amax_history_len: int = field(default=1024, metadata={"when": _DELAYED, "min": 1})
    """TE delayed scaling: length of the amax history window."""
    amax_compute_algo: Literal["max", "most_recent"] = field(default="max", metadata={"when": _DELAYED})
    """TE delayed scaling: amax from the history's max or its most recent value (TE's default is max)."""
    override_linear_precision: tuple[bool, bool, bool] = field(default=(False, False, False),
                                                               metadata={"when": _DELAYED})
    """TE delayed scaling: run (fprop, dgrad, wgrad) GEMMs in higher precision (TE 1.x; TE 2.x: defaults only)."""
    use_autocast_during_eval: bool = False
    """TE: keep FP8 autocast in eval mode (off by default: evaluate in the strategy's precision)."""
    fp8_weights: bool = False
    """TE: each converted te.Linear holds its weight only quantized (``te.quantized_model_init``; TE >= 2.10, FSDP2
    only), sharded and all-gathered so, with no bf16 copy. The optimizer must keep fp32 master weights (TE's
    ``FusedAdam(..., master_weights=True)``), which fp8dist does not build."""
