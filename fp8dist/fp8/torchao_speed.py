"""torchao's recipes as the speed model sees them (:class:`~fp8dist.fp8.speed_recipe.Recipe`), declared by the
torchao backend (``TorchaoBackend.speed_recipes``). Under ``torch.compile`` torchao's casts fuse with their producers;
the rows follow torchao's ``roofline_utils.py`` (``get_tensor_memory_traffic_ovhd_s``)."""

from __future__ import annotations

from .speed_recipe import AO_KERNELS, FP4_ELEMENT, MX_SCALE, NV_SCALE, Recipe, kernels

__all__ = ["TORCHAO_RECIPES"]

# torchao tensorwise: amax (fused into the producer under compile) + a tiny second stage, then one cast writing
# both layouts (row-major for the forward, column-major for grad_weight); the weight's two casts are separate.
_TENSORWISE = Recipe(
    "tensorwise", "torchao, one scale per tensor (dynamic)", (True, True, True),
    compiled=(kernels(0, 0, 4, fused_first=True), kernels(2, 0, 3, 3), kernels(0, 0, 4, fused_first=True)),
    eager=(kernels(2, 0, 3, 2), kernels(2, 0, 3, 3), kernels(2, 0, 3, 2)), fp8_all_gather=True)

# torchao rowwise: scales along the contraction dim, so each operand is cast twice: once with per-row scales (under
# compile the input's and grad_output's fuse with their producer: only the FP8 write is added), once with
# per-column scales into the transposed layout the other GEMM reads (read bf16, write FP8; eager: amax then cast).
_ROWWISE = Recipe(
    "rowwise", "torchao, one scale per row (dynamic)", (True, True, True),
    compiled=(kernels(1, 3, fused_first=True, columnwise_from=1), kernels(3, 3, columnwise_from=1),
              kernels(1, 3, fused_first=True, columnwise_from=1)),
    eager=(kernels(2, 3, 2, 3, columnwise_from=2),) * 3)

# torchao rowwise_with_gw_hp: grad_weight stays bf16, so input and grad_output are cast once, per row; the weight
# twice, its second cast with one scale (the row scales' maximum: a tiny kernel).
_GW_HP = Recipe(
    "rowwise_with_gw_hp", "torchao, rowwise with the weight gradient in bf16", (True, True, False),
    compiled=(kernels(1, fused_first=True), kernels(3, 0, 3), kernels(1, fused_first=True)),
    eager=(kernels(2, 3), kernels(2, 3, 0, 3), kernels(2, 3)))

# torchao dense MXFP8 training (MXLinear / MXFP8TrainingOpConfig, sm_100): each operand cast along dim0 and along
# dim1 (1x32 blocks either way), two kernels; under compile the dim0 cast fuses with the producer (its FP8 write
# alone is added), as roofline_utils.py counts mxfp8_cublas.
_MXFP8 = Recipe("mxfp8", "torchao MXFP8 (1x32 blocks, E8M0 scales)", (True, True, True),
                compiled=(kernels(1 + MX_SCALE, 3 + MX_SCALE, fused_first=True, block=AO_KERNELS),
                          kernels(3 + MX_SCALE, 3 + MX_SCALE, block=AO_KERNELS),
                          kernels(1 + MX_SCALE, 3 + MX_SCALE, fused_first=True, block=AO_KERNELS)),
                eager=(kernels(3 + MX_SCALE, 3 + MX_SCALE, block=AO_KERNELS),) * 3,
                min_capability=(10, 0), scale_bytes=MX_SCALE, gemm="mx")
# torchao NVFP4 (dynamic per-tensor global scale, 1x16 E4M3 block scales, FP4 GEMMs, sm_100): an amax pass (fused
# into the producer under compile) and its tiny second stage, then one cast per layout.
_NVFP4 = Recipe("nvfp4", "torchao NVFP4 (1x16 blocks, FP4 GEMMs)", (True, True, True),
                compiled=(kernels(0, 0, 2 + FP4_ELEMENT, 2 + FP4_ELEMENT, fused_first=True, block=AO_KERNELS),
                          kernels(2, 0, 2 + FP4_ELEMENT, 2 + FP4_ELEMENT, block=AO_KERNELS),
                          kernels(0, 0, 2 + FP4_ELEMENT, 2 + FP4_ELEMENT, fused_first=True, block=AO_KERNELS)),
                eager=(kernels(2, 0, 2 + FP4_ELEMENT, 2 + FP4_ELEMENT, block=AO_KERNELS),) * 3,
                min_capability=(10, 0), scale_bytes=NV_SCALE, gemm="fp4", operand_bytes=0.5,
                checkpoint_gemm="aten._scaled_mm_v2.default")  # nvfp4_mm_triton calls F.scaled_mm itself

# torchao MoE training (grouped GEMMs over ``groups`` experts): its own kernels, one per layout; FP8 rowwise scales
# the second layout per column (per expert's rows), MXFP8 casts 1x32 blocks along either dimension alike.
_MOE_ROWWISE = Recipe("moe_fp8_rowwise", "torchao MoE grouped GEMMs, FP8 rowwise", (True, True, True),
                      compiled=(kernels(3, 3, columnwise_from=1),) * 3, eager=(kernels(3, 3, columnwise_from=1),) * 3,
                      min_capability=(9, 0), grouped=True)
_MOE_MXFP8 = Recipe("moe_mxfp8", "torchao MoE grouped GEMMs, MXFP8", (True, True, True),
                    compiled=(kernels(3 + MX_SCALE, 3 + MX_SCALE, block=AO_KERNELS),) * 3,
                    eager=(kernels(3 + MX_SCALE, 3 + MX_SCALE, block=AO_KERNELS),) * 3,
                    min_capability=(10, 0), grouped=True, scale_bytes=MX_SCALE, gemm="mx")

TORCHAO_RECIPES = (_TENSORWISE, _ROWWISE, _GW_HP, _MXFP8, _NVFP4, _MOE_ROWWISE, _MOE_MXFP8)
"""The Linear recipes (``torchao_recipe``: tensorwise, rowwise, rowwise_with_gw_hp, mxfp8, nvfp4), then the MoE
grouped GEMMs' (``grouped=True``)."""
