"""What each FP8 recipe adds to a Linear's forward + backward, as data: which of its three GEMMs run in FP8, and the
kernels that cast each operand (input, weight, grad_output) with the bytes they move per element of that operand.

The accounting follows how each backend does it: torchao's casts are torch ops that ``torch.compile`` fuses with
the op that produced the tensor (eager runs each as its own kernel: an amax pass, a scale, a cast, a transpose);
Transformer Engine's are fused CUDA kernels (cast + transpose, amax as a by-product) that compile does not touch.
The torchao rows are re-derived from the kernel breakdown in torchao's ``torchao/testing/training/roofline_utils.py``
(``get_tensor_memory_traffic_ovhd_s``); rowwise's second cast is one column-wise scaling pass here (its bf16
transposed copy folded in), the pass whose cost the H100 fit measures. bf16 is 2 bytes, FP8 1, an MX scale 1 per
32."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Kernel", "Recipe", "RECIPES", "recipe_named"]

_MX = 1 / 32  # one E8M0 scale byte per 32 elements


@dataclass(frozen=True)
class Kernel:
    """One pass over an operand that an FP8 recipe adds."""

    bytes_per_element: float
    """Bytes read plus written, per element of the operand (0: a tiny kernel, e.g. an amax's second stage)."""
    fused: bool = False
    """True when it rides in the kernel that produced the operand (no launch of its own)."""
    columnwise: bool = False
    """True for a pass that scales along the operand's first dimension (the per-column scales of a rowwise
    recipe's transposed GEMM operand): the pass the H100 fit finds slow (:attr:`Calibration.cast_slowdown`)."""


Casts = tuple[tuple[Kernel, ...], tuple[Kernel, ...], tuple[Kernel, ...]]
"""Per operand a Linear casts: input, weight, grad_output."""


@dataclass(frozen=True)
class Recipe:
    """One FP8 recipe as the speed model sees it."""

    name: str
    """The name :func:`fp8dist.predict_fp8_speedup` takes: its id, which the backend that runs it names
    (:attr:`~fp8dist.fp8.FP8Backend.speed_recipes`, :meth:`~fp8dist.fp8.FP8Backend.speed_recipe`)."""
    description: str
    """What it is, in a line."""
    fp8_gemms: tuple[bool, bool, bool]
    """(output, grad_input, grad_weight): which GEMMs run in FP8 (the others in bf16)."""
    compiled: Casts
    """The cast kernels under ``torch.compile``."""
    eager: Casts
    min_capability: tuple[int, int] = (8, 9)
    """The oldest CUDA capability with the GEMMs it needs."""
    grouped: bool = False
    """True for MoE grouped GEMMs (``groups`` experts share the rows)."""
    scale_bytes: float = 0.0
    """Scale bytes a GEMM reads per FP8 operand element (block scales; 0 for per-tensor/per-row)."""

    def casts(self, compile: bool) -> Casts:
        return self.compiled if compile else self.eager


def _k(*passes: float, fused_first: bool = False, columnwise_from: int | None = None) -> tuple[Kernel, ...]:
    """Kernels moving ``passes`` bytes per element each; with ``fused_first`` the first rides in the producer;
    from index ``columnwise_from`` on they scale along the first dimension."""
    column = len(passes) if columnwise_from is None else columnwise_from
    return tuple(Kernel(b, fused=fused_first and i == 0, columnwise=i >= column) for i, b in enumerate(passes))


# torchao tensorwise: amax (fused into the producer under compile) + a tiny second stage, then one cast writing
# both layouts (row-major for the forward, column-major for grad_weight); the weight's two casts are separate.
_TENSORWISE = Recipe(
    "tensorwise", "torchao, one scale per tensor (dynamic)", (True, True, True),
    compiled=(_k(0, 0, 4, fused_first=True), _k(2, 0, 3, 3), _k(0, 0, 4, fused_first=True)),
    eager=(_k(2, 0, 3, 2), _k(2, 0, 3, 3), _k(2, 0, 3, 2)))

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
                   compiled=(_k(4 + 2 * _MX),) * 3, eager=(_k(4 + 2 * _MX),) * 3,
                   min_capability=(10, 0), scale_bytes=_MX)

# torchao MoE training (grouped GEMMs over ``groups`` experts): its own kernels, one per layout; FP8 rowwise scales
# the second layout per column (per expert's rows), MXFP8 casts 1x32 blocks along either dimension alike.
_MOE_ROWWISE = Recipe("moe_fp8_rowwise", "torchao MoE grouped GEMMs, FP8 rowwise", (True, True, True),
                      compiled=(_k(3, 3, columnwise_from=1),) * 3, eager=(_k(3, 3, columnwise_from=1),) * 3,
                      min_capability=(9, 0), grouped=True)
_MOE_MXFP8 = Recipe("moe_mxfp8", "torchao MoE grouped GEMMs, MXFP8", (True, True, True),
                    compiled=(_k(3 + _MX, 3 + _MX),) * 3, eager=(_k(3 + _MX, 3 + _MX),) * 3,
                    min_capability=(10, 0), grouped=True, scale_bytes=_MX)

RECIPES: dict[str, Recipe] = {r.name: r for r in (_TENSORWISE, _ROWWISE, _GW_HP, _TE_DELAYED, _TE_CURRENT,
                                                   _TE_MXFP8, _MOE_ROWWISE, _MOE_MXFP8)}
"""Every recipe the speed model knows, by name."""


def recipe_named(name: str) -> Recipe:
    """The recipe called ``name``; ValueError naming the choices for an unknown one."""
    if name not in RECIPES:
        raise ValueError(f"recipe {name!r} is not one the speed model knows: choose one of {', '.join(RECIPES)} "
                         "(torchao: tensorwise, rowwise, rowwise_with_gw_hp; Transformer Engine: te_*; MoE grouped "
                         "GEMMs: moe_*).")
    return RECIPES[name]
