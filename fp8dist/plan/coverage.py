"""How much of a model's GEMM work a precision plan runs in FP8: which modules run a GEMM, their estimated FLOPs
per token, and the share in FP8."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["FP8Coverage", "MIN_FP8_SHARE", "coverage", "gemm_flops", "runs_gemm", "LOOKUPS"]

MIN_FP8_SHARE = 0.5
"""``wrap_model`` warns where an FP8 backend runs less than this share of the GEMM parameters in FP8."""


@dataclass(frozen=True)
class FP8Coverage:
    """The numbers behind the plan's share line and ``wrap_model``'s low-coverage warning."""

    gemm_modules: int
    """Modules that run a GEMM with their own parameters (:func:`runs_gemm`); a module that never runs (a PEFT
    ``modules_to_save`` original) is not counted."""
    fp8_modules: int
    """Of those, the modules planned in FP8."""
    gemm_params: int
    """Parameters the GEMM modules hold."""
    fp8_params: int
    """Of those, the parameters of the FP8 modules."""
    gemm_flops: int
    """Estimated forward GEMM FLOPs per token (:attr:`fp8dist.plan.precision.PlanEntry.gemm_flops`)."""
    fp8_flops: int
    """Of those, the FP8 modules' FLOPs per token."""
    kept: tuple[tuple[str, int, int], ...]
    """The GEMM modules not in FP8, grouped by reason: ``(reason, modules, params)``, most parameters first."""

    @property
    def param_share(self) -> float:
        """Share of the GEMM modules' parameters that run in FP8 (0.0 without GEMMs)."""
        return self.fp8_params / self.gemm_params if self.gemm_params else 0.0

    @property
    def flop_share(self) -> float:
        """Share of the estimated GEMM FLOPs per token that run in FP8 (0.0 without GEMMs)."""
        return self.fp8_flops / self.gemm_flops if self.gemm_flops else 0.0

    @property
    def low(self) -> bool:
        """Less than :data:`MIN_FP8_SHARE` of the GEMM parameters in FP8 (or none at all)."""
        return self.fp8_modules == 0 or self.param_share < MIN_FP8_SHARE

    def summary(self) -> str:
        """One line: the FP8 share of the GEMMs' parameters and of their estimated FLOPs, with how FLOPs are counted."""
        share = f"{self.fp8_params:,} of {self.gemm_params:,} params ({100 * self.param_share:.1f}%)"
        return (f"FP8 share of GEMMs: {share}, {100 * self.flop_share:.1f}% of est. GEMM FLOPs (per token: 2 x params "
                "of each GEMM module, MoE experts x top_k/experts)")


def _kept_as(entry: Any) -> str:
    """What a module kept out of FP8 is counted under: its reason, or what in the selection kept it."""
    if entry.numerics:
        return "FP8 measured unsafe by the numerics probe"
    if entry.predicted:
        return "FP8 predicted slower than bf16 (fp8_select='auto')"
    return entry.reason


def coverage(entries: Sequence[Any]) -> FP8Coverage:
    """The FP8 share of ``entries`` (:class:`~fp8dist.plan.precision.PlanEntry`) that run (``runs``)."""
    gemm = [e for e in entries if e.gemm_flops and e.runs]
    fp8 = [e for e in gemm if e.precision == "fp8"]
    kept: dict[str, list[int]] = {}  # reason -> the params of each module it keeps
    for e in gemm:
        if e.precision != "fp8":
            kept.setdefault(_kept_as(e), []).append(e.params)
    groups = sorted(((reason, len(params), sum(params)) for reason, params in kept.items()), key=lambda g: -g[2])
    return FP8Coverage(len(gemm), len(fp8), sum(e.params for e in gemm), sum(e.params for e in fp8),
                       sum(e.gemm_flops for e in gemm), sum(e.gemm_flops for e in fp8), tuple(groups))


def gemm_flops(module: nn.Module, params: int, grouped: bool) -> int:
    """2 x params per token, x top_k / experts for a ``grouped`` experts module (its config's num_experts_per_tok)."""
    if not runs_gemm(module):
        return 0
    top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
    if grouped and isinstance(top_k, int) and 0 < top_k <= module.num_experts:
        return 2 * params * top_k // module.num_experts
    return 2 * params


LOOKUPS = (nn.Embedding, nn.EmbeddingBag)
"""Module types whose 2-D parameter is read by index, not multiplied: :func:`runs_gemm` is False for them."""


def runs_gemm(module: nn.Module, shapes: Iterable[Sequence[int]] | None = None) -> bool:
    """Whether ``module`` multiplies by its own parameters: one of 2 or more dims (Linear, Conv1D, a MoE router, fused
    experts), not a lookup table. ``shapes``: the full shapes where it holds flat shards (FSDP1)."""
    if shapes is None:
        shapes = [p.shape for p in module.parameters(recurse=False)]
    return not isinstance(module, LOOKUPS) and any(len(shape) >= 2 for shape in shapes)
