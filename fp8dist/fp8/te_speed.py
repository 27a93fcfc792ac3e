"""Transformer Engine's recipes as the speed model sees them (:class:`~fp8dist.fp8.speed_recipe.Recipe`), declared
by the TE backend (``TEBackend.speed_recipes``): its casts are fused CUDA kernels with or without ``torch.compile``."""

from __future__ import annotations

from dataclasses import replace

from .speed_recipe import FP4_ELEMENT, MX_SCALE, NV_SCALE, TE_KERNELS, Recipe, kernels

__all__ = ["TE_RECIPES"]

# Transformer Engine: cast + transpose in one kernel (2 read, 1 + 1 written), amax as its by-product; delayed
# scaling takes the scale from the amax history, current scaling first runs an amax pass and a scale kernel.
_TE_DELAYED = Recipe("te_delayed", "Transformer Engine DelayedScaling (amax history)", (True, True, True),
                     compiled=(kernels(4),) * 3, eager=(kernels(4),) * 3)
_TE_CURRENT = Recipe("te_current", "Transformer Engine Float8CurrentScaling", (True, True, True),
                     compiled=(kernels(2, 0, 4),) * 3, eager=(kernels(2, 0, 4),) * 3)
_TE_MXFP8 = Recipe("te_mxfp8", "Transformer Engine MXFP8BlockScaling (1x32 blocks)", (True, True, True),
                   compiled=(kernels(4 + 2 * MX_SCALE, block=TE_KERNELS),) * 3,
                   eager=(kernels(4 + 2 * MX_SCALE, block=TE_KERNELS),) * 3,
                   min_capability=(10, 0), scale_bytes=MX_SCALE, gemm="mx")
# TE Float8BlockScaling (sm_90, CUDA 12.9+): 1x128 tiles for activations and gradients, 128x128 for weights, FP32
# scales (4 bytes per 128 elements); one fused cast + transpose per operand, the GEMM at the FP8 rate.
_TE_BLOCKWISE = Recipe("te_blockwise", "Transformer Engine Float8BlockScaling (1x128 / 128x128 blocks)",
                       (True, True, True), compiled=(kernels(4 + 8 / 128),) * 3, eager=(kernels(4 + 8 / 128),) * 3,
                       min_capability=(9, 0), scale_bytes=4 / 128)
# TE NVFP4BlockScaling (sm_100): a per-tensor amax pass (the global scale), then one fused kernel writing both
# layouts in FP4 with their 1x16 E4M3 scales.
_TE_NVFP4 = Recipe("te_nvfp4", "Transformer Engine NVFP4BlockScaling (1x16 blocks, FP4 GEMMs)", (True, True, True),
                   compiled=(kernels(2, 0, 2 + 2 * FP4_ELEMENT, block=TE_KERNELS),) * 3,
                   eager=(kernels(2, 0, 2 + 2 * FP4_ELEMENT, block=TE_KERNELS),) * 3,
                   min_capability=(10, 0), scale_bytes=NV_SCALE, gemm="fp4", operand_bytes=0.5)

# every TE GEMM runs in its own extension (tex.generic_gemm), unseen by a checkpoint's dispatch mode
TE_RECIPES = tuple(replace(recipe, checkpoint_gemm="") for recipe in
                   (_TE_DELAYED, _TE_CURRENT, _TE_BLOCKWISE, _TE_MXFP8, _TE_NVFP4))
"""One per ``te_<te_recipe>``; each GEMM outside PyTorch's dispatcher (``checkpoint_gemm=""``)."""
