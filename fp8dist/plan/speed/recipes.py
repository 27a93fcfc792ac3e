"""What each FP8 recipe adds to a Linear's forward + backward, as data: which of its three GEMMs run in FP8 and the
kernels casting each operand, in bytes per element. torchao's casts fuse under ``torch.compile``, TE's are fused CUDA
kernels either way; the torchao rows follow torchao's ``roofline_utils.py`` (``get_tensor_memory_traffic_ovhd_s``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Kernel", "Recipe", "RECIPES", "recipe_named"]

_MX = 1 / 32  # one E8M0 scale byte per 32 elements
_NV = 1 / 16  # one E4M3 scale byte per 16 elements (NVFP4)
_FP4 = 0.5 + _NV  # an NVFP4 element and its share of the block scale


AO_KERNELS, TE_KERNELS = "ao_kernels", "te_kernels"
"""The block-scaling cast kernels' families (:attr:`Kernel.block`): torchao's own Triton / CUDA casts and Transformer
Engine's; :attr:`Calibration.block_cast_slowdown` holds their fitted slowdowns in the order of
:data:`BLOCK_KERNELS`."""
BLOCK_KERNELS = (AO_KERNELS, TE_KERNELS)


@dataclass(frozen=True)
class Kernel:
    """One pass over an operand that an FP8 recipe adds."""

    bytes_per_element: float
    """Bytes read plus written, per element of the operand (0: a tiny kernel, e.g. an amax's second stage)."""
    fused: bool = False
    """Rides in the kernel that produced the operand (no launch of its own)."""
    columnwise: bool = False
    """Scales along the operand's first dimension (a rowwise recipe's transposed operand): the pass the H100 fit finds
    slow (:attr:`Calibration.cast_slowdown`)."""
    block: str = ""
    """:data:`AO_KERNELS` or :data:`TE_KERNELS`: a block-scaling (MXFP8, NVFP4) quantize kernel of that family, run at
    its fitted slowdown
    (:attr:`Calibration.block_cast_slowdown`; the backends' kernels differ: TE's NVFP4 adds a Hadamard transform and
    stochastic rounding, torchao's are its own Triton / CUDA casts)."""


Casts = tuple[tuple[Kernel, ...], tuple[Kernel, ...], tuple[Kernel, ...]]
"""Per operand a Linear casts: input, weight, grad_output."""


@dataclass(frozen=True)
class Recipe:
    """One FP8 recipe as the speed model sees it."""

    name: str
    """The name :func:`fp8dist.predict_fp8_speedup` takes and the backend's ``speed_recipes`` name."""
    description: str
    fp8_gemms: tuple[bool, bool, bool]
    """(output, grad_input, grad_weight): which GEMMs run in FP8 (the others in bf16)."""
    compiled: Casts
    """The cast kernels under ``torch.compile``; ``eager`` without."""
    eager: Casts
    min_capability: tuple[int, int] = (8, 9)
    """The oldest CUDA capability with the GEMMs it needs."""
    grouped: bool = False
    """True for MoE grouped GEMMs (``groups`` experts share the rows)."""
    scale_bytes: float = 0.0
    """Scale bytes a GEMM reads per FP8 operand element (block scales; 0 for per-tensor/per-row)."""
    gemm: str = "fp8"
    """The low-precision GEMM: "fp8", "mx" (MXFP8) or "fp4" (NVFP4, at the FP4 peak), each at its fitted fraction."""
    operand_bytes: float = 1.0
    """Bytes of one element of a low-precision GEMM operand: 1 for FP8, 0.5 for FP4."""
    fp8_all_gather: bool = False
    """The backend all-gathers converted weights in FP8 under DTensor shards (torchao tensorwise on FSDP2): 1 byte
    each instead of 2 in the step model."""

    def casts(self, compile: bool) -> Casts:
        return self.compiled if compile else self.eager


def _k(*passes: float, fused_first: bool = False, columnwise_from: int | None = None,
       block: str = "") -> tuple[Kernel, ...]:
    column = len(passes) if columnwise_from is None else columnwise_from
    return tuple(Kernel(b, fused=fused_first and i == 0, columnwise=i >= column, block=block if b else "")
                 for i, b in enumerate(passes))


# torchao tensorwise: amax (fused into the producer under compile) + a tiny second stage, then one cast writing
# both layouts (row-major for the forward, column-major for grad_weight); the weight's two casts are separate.
_TENSORWISE = Recipe(
    "tensorwise", "torchao, one scale per tensor (dynamic)", (True, True, True),
    compiled=(_k(0, 0, 4, fused_first=True), _k(2, 0, 3, 3), _k(0, 0, 4, fused_first=True)),
    eager=(_k(2, 0, 3, 2), _k(2, 0, 3, 3), _k(2, 0, 3, 2)), fp8_all_gather=True)

# torchao rowwise: scales along the contraction dim, so each operand is cast twice: once with per-row scales (under
# compile the input's and grad_output's fuse with their producer: only the FP8 write is added), once with
# per-column scales into the transposed layout the other GEMM reads (read bf16, write FP8; eager: amax then cast).
_ROWWISE = Recipe(
    "rowwise", "torchao, one scale per row (dynamic)", (True, True, True),
    compiled=(_k(1, 3, fused_first=True, columnwise_from=1), _k(3, 3, columnwise_from=1),
              _k(1, 3, fused_first=True, columnwise_from=1)),
    eager=(_k(2, 3, 2, 3, columnwise_from=2),) * 3)

# torchao rowwise_with_gw_hp: grad_weight stays bf16, so input and grad_output are cast once, per row; the weight
# twice, its second cast with one scale (the row scales' maximum: a tiny kernel).
_GW_HP = Recipe(
    "rowwise_with_gw_hp", "torchao, rowwise with the weight gradient in bf16", (True, True, False),
    compiled=(_k(1, fused_first=True), _k(3, 0, 3), _k(1, fused_first=True)),
    eager=(_k(2, 3), _k(2, 3, 0, 3), _k(2, 3)))

# Transformer Engine: cast + transpose in one kernel (2 read, 1 + 1 written), amax as its by-product; delayed
# scaling takes the scale from the amax history, current scaling first runs an amax pass and a scale kernel.
_TE_DELAYED = Recipe("te_delayed", "Transformer Engine DelayedScaling (amax history)", (True, True, True),
                     compiled=(_k(4),) * 3, eager=(_k(4),) * 3)
_TE_CURRENT = Recipe("te_current", "Transformer Engine Float8CurrentScaling", (True, True, True),
                     compiled=(_k(2, 0, 4),) * 3, eager=(_k(2, 0, 4),) * 3)
_TE_MXFP8 = Recipe("te_mxfp8", "Transformer Engine MXFP8BlockScaling (1x32 blocks)", (True, True, True),
                   compiled=(_k(4 + 2 * _MX, block=TE_KERNELS),) * 3, eager=(_k(4 + 2 * _MX, block=TE_KERNELS),) * 3,
                   min_capability=(10, 0), scale_bytes=_MX, gemm="mx")
# TE Float8BlockScaling (sm_90, CUDA 12.9+): 1x128 tiles for activations and gradients, 128x128 for weights, FP32
# scales (4 bytes per 128 elements); one fused cast + transpose per operand, the GEMM at the FP8 rate.
_TE_BLOCKWISE = Recipe("te_blockwise", "Transformer Engine Float8BlockScaling (1x128 / 128x128 blocks)",
                       (True, True, True), compiled=(_k(4 + 8 / 128),) * 3, eager=(_k(4 + 8 / 128),) * 3,
                       min_capability=(9, 0), scale_bytes=4 / 128)
# TE NVFP4BlockScaling (sm_100): a per-tensor amax pass (the global scale), then one fused kernel writing both
# layouts in FP4 with their 1x16 E4M3 scales.
_TE_NVFP4 = Recipe("te_nvfp4", "Transformer Engine NVFP4BlockScaling (1x16 blocks, FP4 GEMMs)", (True, True, True),
                   compiled=(_k(2, 0, 2 + 2 * _FP4, block=TE_KERNELS),) * 3,
                   eager=(_k(2, 0, 2 + 2 * _FP4, block=TE_KERNELS),) * 3,
                   min_capability=(10, 0), scale_bytes=_NV, gemm="fp4", operand_bytes=0.5)

# torchao dense MXFP8 training (MXLinear / MXFP8TrainingOpConfig, sm_100): each operand cast along dim0 and along
# dim1 (1x32 blocks either way), two kernels; under compile the dim0 cast fuses with the producer (its FP8 write
# alone is added), as roofline_utils.py counts mxfp8_cublas.
_MXFP8 = Recipe("mxfp8", "torchao MXFP8 (1x32 blocks, E8M0 scales)", (True, True, True),
                compiled=(_k(1 + _MX, 3 + _MX, fused_first=True, block=AO_KERNELS),
                          _k(3 + _MX, 3 + _MX, block=AO_KERNELS),
                          _k(1 + _MX, 3 + _MX, fused_first=True, block=AO_KERNELS)),
                eager=(_k(3 + _MX, 3 + _MX, block=AO_KERNELS),) * 3,
                min_capability=(10, 0), scale_bytes=_MX, gemm="mx")
# torchao NVFP4 (dynamic per-tensor global scale, 1x16 E4M3 block scales, FP4 GEMMs, sm_100): an amax pass (fused
# into the producer under compile) and its tiny second stage, then one cast per layout.
_NVFP4 = Recipe("nvfp4", "torchao NVFP4 (1x16 blocks, FP4 GEMMs)", (True, True, True),
                compiled=(_k(0, 0, 2 + _FP4, 2 + _FP4, fused_first=True, block=AO_KERNELS),
                          _k(2, 0, 2 + _FP4, 2 + _FP4, block=AO_KERNELS),
                          _k(0, 0, 2 + _FP4, 2 + _FP4, fused_first=True, block=AO_KERNELS)),
                eager=(_k(2, 0, 2 + _FP4, 2 + _FP4, block=AO_KERNELS),) * 3,
                min_capability=(10, 0), scale_bytes=_NV, gemm="fp4", operand_bytes=0.5)

# torchao MoE training (grouped GEMMs over ``groups`` experts): its own kernels, one per layout; FP8 rowwise scales
# the second layout per column (per expert's rows), MXFP8 casts 1x32 blocks along either dimension alike.
_MOE_ROWWISE = Recipe("moe_fp8_rowwise", "torchao MoE grouped GEMMs, FP8 rowwise", (True, True, True),
                      compiled=(_k(3, 3, columnwise_from=1),) * 3, eager=(_k(3, 3, columnwise_from=1),) * 3,
                      min_capability=(9, 0), grouped=True)
_MOE_MXFP8 = Recipe("moe_mxfp8", "torchao MoE grouped GEMMs, MXFP8", (True, True, True),
                    compiled=(_k(3 + _MX, 3 + _MX, block=AO_KERNELS),) * 3,
                    eager=(_k(3 + _MX, 3 + _MX, block=AO_KERNELS),) * 3,
                    min_capability=(10, 0), grouped=True, scale_bytes=_MX, gemm="mx")

RECIPES: dict[str, Recipe] = {r.name: r for r in (_TENSORWISE, _ROWWISE, _GW_HP, _TE_DELAYED, _TE_CURRENT,
                                                   _TE_BLOCKWISE, _TE_MXFP8, _TE_NVFP4, _MXFP8, _NVFP4, _MOE_ROWWISE,
                                                   _MOE_MXFP8)}


def recipe_named(name: str) -> Recipe:
    """The recipe called ``name``; ValueError naming the choices for an unknown one."""
    if name not in RECIPES:
        raise ValueError(f"recipe {name!r} is not one the speed model knows: choose one of {', '.join(RECIPES)} "
                         "(torchao: tensorwise, rowwise, rowwise_with_gw_hp, mxfp8, nvfp4; Transformer Engine: te_*; "
                         "MoE grouped GEMMs: moe_*).")
    return RECIPES[name]
