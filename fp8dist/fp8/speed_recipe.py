"""The speed model's vocabulary for an FP8 recipe, in which each backend declares its own
(:attr:`fp8dist.fp8.FP8Backend.speed_recipes`): which of a Linear's three GEMMs run in FP8 and the kernels casting each
operand, in bytes per element. The speed model (:mod:`fp8dist.plan.speed`) reads the recipes the registered backends
declare; it knows none of its own."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Kernel", "Recipe", "CastKernels", "kernels", "AO_KERNELS", "TE_KERNELS", "BLOCK_KERNELS", "MX_SCALE",
           "NV_SCALE", "FP4_ELEMENT"]

MX_SCALE = 1 / 32
"""Scale bytes per element of an MXFP8 operand: one E8M0 scale byte per 32 elements."""
NV_SCALE = 1 / 16
"""Scale bytes per element of an NVFP4 operand: one E4M3 scale byte per 16 elements."""
FP4_ELEMENT = 0.5 + NV_SCALE
"""Bytes of one NVFP4 element with its share of the block scale."""


AO_KERNELS, TE_KERNELS = "ao_kernels", "te_kernels"
"""The block-scaling cast kernels' families (:attr:`Kernel.block`): torchao's own Triton / CUDA casts and Transformer
Engine's; :attr:`Calibration.block_cast_slowdown` holds their fitted slowdowns in the order of
:data:`BLOCK_KERNELS`."""
BLOCK_KERNELS = (AO_KERNELS, TE_KERNELS)
"""The block-scaling kernel families, in the order of ``Calibration.block_cast_slowdown``."""


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


CastKernels = tuple[tuple[Kernel, ...], tuple[Kernel, ...], tuple[Kernel, ...]]
"""Per operand a Linear casts: input, weight, grad_output."""


@dataclass(frozen=True)
class Recipe:
    """One FP8 recipe as the speed model sees it."""

    name: str
    """The name :func:`fp8dist.predict_fp8_speedup` takes and the backend's ``speed_recipes`` name."""
    description: str
    fp8_gemms: tuple[bool, bool, bool]
    """(output, grad_input, grad_weight): which GEMMs run in FP8 (the others in bf16)."""
    compiled: CastKernels
    """The cast kernels under ``torch.compile``; ``eager`` without."""
    eager: CastKernels
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
    checkpoint_gemm: str = "aten.mm.default"
    """The op a converted Linear's forward GEMM shows activation checkpointing's dispatch mode, which a selective
    policy counts by name (:data:`fp8dist.pipeline.blocks.SELECTIVE_GEMMS`; torchtitan's counts only ``aten.mm``):
    ``aten.mm`` for a tensor subclass's matmul (torchao's float8 and MXFP8, seen before the subclass turns it into
    ``_scaled_mm``); the scaled GEMM an autograd function calls on plain tensors (torchao's NVFP4 training Linear:
    ``F.scaled_mm`` -> ``aten._scaled_mm_v2``); "" for a GEMM outside PyTorch's dispatcher (Transformer Engine's
    extension): never counted, its output recomputed. What the memory estimate keeps of a selectively checkpointed
    block reads it."""

    def casts(self, compile: bool) -> CastKernels:
        """The cast kernels of each operand (input, weight, grad_output): :attr:`compiled` under ``torch.compile``,
        else :attr:`eager`."""
        return self.compiled if compile else self.eager


def kernels(*passes: float, fused_first: bool = False, columnwise_from: int | None = None,
            block: str = "") -> tuple[Kernel, ...]:
    """The cast kernels of one operand, one per pass: ``passes`` are bytes read + written per element (0: a tiny
    kernel). ``fused_first``: the first rides in its producer; passes from index ``columnwise_from`` on are
    columnwise (None: none); ``block``: the block-scaling kernel family of every pass that moves bytes."""
    column = len(passes) if columnwise_from is None else columnwise_from
    return tuple(Kernel(b, fused=fused_first and i == 0, columnwise=i >= column, block=block if b else "")
                 for i, b in enumerate(passes))
