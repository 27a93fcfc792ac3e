"""What the probe measures per operand cast and per GEMM output, gathered per layer, pooled over batches as one
tensor: SQNR = 10 log10(sum x^2 / sum (x - fp8(x))^2), torchao's ``compute_error`` over the whole."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CastStats", "OutputStats", "ReduceStats", "LayerNumerics", "sqnr_db", "json_number"]


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise) from sums of squares; inf when there is no error, nan for no signal."""
    if noise == 0:
        return math.inf if signal > 0 else math.nan
    if not math.isfinite(noise) or not math.isfinite(signal):
        return math.nan
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def json_number(value: float) -> float | None:
    """JSON has no inf/nan: None stands for an exact round trip (inf) or no data (nan)."""
    return value if math.isfinite(value) else None


@dataclass
class CastStats:
    """One operand's FP8 round trip in one or two GEMMs (a tensorwise cast is the same in both)."""

    role: str
    """input, weight or grad_output."""
    gemms: str
    """The GEMMs it is cast for: output, grad_input, grad_weight, or two joined by '+'."""
    cast: str
    """E.g. "e4m3 tensorwise", "e5m2 delayed (history 1024, max)"."""
    fp4: bool = False
    """An FP4 cast (NVFP4): judged by the thresholds' ``fp4_*`` limits."""
    elements: int = 0
    nonzero: int = 0
    flushed: int = 0
    """Non-zero values that the cast turns to zero."""
    saturated: int = 0
    """Values clamped to the largest magnitude the cast represents."""
    nonfinite: int = 0
    floored: int = 0
    """NVFP4: non-zero values in blocks whose e4m3 scale sat at its floor (an outlier elsewhere set the tensor's)."""
    signal: float = 0.0
    noise: float = 0.0
    rest_signal: float = 0.0  # over the values beside each dot product's largest (rest_sqnr_db)
    rest_noise: float = 0.0
    amax: float = 0.0

    @torch.no_grad()
    def add(self, x: torch.Tensor, back: torch.Tensor, saturated: torch.Tensor, dim: int = -1,
            floored: torch.Tensor | None = None) -> None:
        """Count ``x``, its round trip ``back`` and the masks the cast returned; ``dim``: the one its GEMM sums over
        (each slice along it is one dot product's operand)."""
        x, back = x.detach().float(), back.float()
        finite = torch.isfinite(x)
        if not bool(finite.all()):
            self.nonfinite += int((~finite).sum())
            x, back = x.where(finite, 0.0), back.where(finite, 0.0)
        nonzero = x != 0
        exact, diff = x.double(), x.double() - back.double()
        counts = torch.stack([nonzero.sum(), (nonzero & (back == 0)).sum(), saturated.sum()]).tolist()
        self.elements += x.numel()
        self.nonzero += counts[0]
        self.flushed += counts[1]
        self.saturated += counts[2]
        self.floored += int(floored.sum()) if floored is not None else 0
        self.signal += float(exact.square().sum())
        self.noise += float(diff.square().sum())
        if x.numel():
            self.amax = max(self.amax, float(x.abs().max()))
            # each dot product's largest left out by a mask: in a difference of sums the outlier's square swamps
            rest = torch.ones_like(nonzero).scatter_(dim, x.abs().argmax(dim, keepdim=True), False)
            self.rest_signal += float(exact[rest].square().sum())
            self.rest_noise += float(diff[rest].square().sum())

    @property
    def rest_sqnr_db(self) -> float:
        """SQNR of the values beside each dot product's largest (:attr:`~.thresholds.Thresholds.min_rest_sqnr_db`)."""
        return sqnr_db(self.rest_signal, self.rest_noise)

    @property
    def sqnr_db(self) -> float:
        """SQNR in dB of the operand after the FP8 cast against the operand itself, over every value counted."""
        return sqnr_db(self.signal, self.noise)

    @property
    def flushed_share(self) -> float:
        """Share of the non-zero values flushed to zero."""
        return self.flushed / self.nonzero if self.nonzero else 0.0

    @property
    def floored_share(self) -> float:
        """Share of the non-zero values whose NVFP4 block scale sat at its floor."""
        return self.floored / self.nonzero if self.nonzero else 0.0

    @property
    def saturated_share(self) -> float:
        """Share of the cast elements that saturated (clamped to the format's largest value); 0.0 before any."""
        return self.saturated / self.elements if self.elements else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The cast's figures as JSON data (non-finite SQNRs as strings, :func:`json_number`)."""
        return {"role": self.role, "gemms": self.gemms, "cast": self.cast, "fp4": self.fp4,
                "sqnr_db": json_number(self.sqnr_db),
                "rest_sqnr_db": json_number(self.rest_sqnr_db),
                "flushed_share": self.flushed_share, "saturated_share": self.saturated_share, "amax": self.amax,
                "elements": self.elements, "nonzero": self.nonzero, "flushed": self.flushed,
                "saturated": self.saturated, "nonfinite": self.nonfinite, "floored_share": self.floored_share}


@dataclass
class OutputStats:
    """A GEMM's output (forward, input or weight gradient) with FP8 operands against high precision."""

    signal: float = 0.0
    noise: float = 0.0

    @torch.no_grad()
    def add(self, exact: torch.Tensor, fp8: torch.Tensor) -> None:
        """Count one call: ``exact``, the GEMM's high-precision output, against ``fp8``, the same GEMM with FP8
        operands."""
        self.signal += float(exact.double().square().sum())
        self.noise += float((exact.double() - fp8.double()).square().sum())

    @property
    def sqnr_db(self) -> float:
        """SQNR in dB of the FP8 GEMM's outputs against the high-precision ones, over every call counted."""
        return sqnr_db(self.signal, self.noise)


_SMALL = 16
"""ReduceStats' small values: under 1/16 of their block's largest."""


@dataclass
class ReduceStats:
    """A weight gradient after ``reduce_dtype="fp8"``'s block round trip (:func:`~fp8dist.strategies.grad_fp8.
    quantize_blocks` then ``dequantize_blocks``, blocks along the flattened gradient) against the gradient itself:
    over every value, and over the small ones, under 1/16 of their block's largest (an outlier that sets a block's
    scale pushes the others into e4m3's subnormals, where few values are left; the plain SQNR, which the outlier
    dominates, stays high)."""

    block: int
    """Elements per fp32 scale (``reduce_fp8_block``)."""
    signal: float = 0.0
    noise: float = 0.0
    small_signal: float = 0.0
    small_noise: float = 0.0

    @torch.no_grad()
    def add(self, grad: torch.Tensor) -> None:
        """Round-trip ``grad`` (a weight's gradient of one batch) as the FP8 reduction quantizes it, and count."""
        from ..strategies.grad_fp8 import dequantize_blocks, quantize_blocks

        x = grad.detach().float().reshape(1, -1)
        back = dequantize_blocks(*quantize_blocks(x, self.block), x.shape[1])
        pad = -x.shape[1] % self.block
        x, back = (torch.nn.functional.pad(t.double(), (0, pad)).reshape(-1, self.block) for t in (x, back))
        x2, d2 = x.square(), (x - back).square()
        small = x.abs() < x.abs().amax(-1, keepdim=True) / _SMALL
        self.signal += float(x2.sum())
        self.noise += float(d2.sum())
        self.small_signal += float(x2[small].sum())
        self.small_noise += float(d2[small].sum())

    @property
    def sqnr_db(self) -> float:
        """SQNR in dB of the gradients after the FP8 block round trip, over every value."""
        return sqnr_db(self.signal, self.noise)

    @property
    def small_sqnr_db(self) -> float:
        """SQNR in dB over the small values only (under 1/16 of their block's largest): the probe's verdict on the
        FP8 reduction."""
        return sqnr_db(self.small_signal, self.small_noise)


@dataclass
class LayerNumerics:
    """One FP8 GEMM of the plan: a Linear, or one of a MoE experts module's grouped GEMMs."""

    name: str
    """The module's full name (what ``fp8_exclude`` takes)."""
    gemm: str
    """"" for a Linear; the experts' parameter (gate_up_proj, down_proj) for a grouped GEMM."""
    module_type: str
    casts: list[CastStats] = field(default_factory=list)
    output: OutputStats = field(default_factory=OutputStats)
    grad_input: OutputStats = field(default_factory=OutputStats)
    """``g @ W``, from the operands as cast for it."""
    grad_weight: OutputStats = field(default_factory=OutputStats)
    """``g.T @ x``, from the operands as cast for it."""
    calls: int = 0
    """Forward GEMM calls measured (batches, or expert groups x batches)."""
    reduce: ReduceStats | None = None
    """Its weight gradient under ``reduce_dtype="fp8"``'s FP8 blocks; None: the probe's config reduces otherwise."""
    reduce_problems: tuple[str, ...] = ()
    """Thresholds its weight gradient crosses under the FP8 reduction (the plan then reduces it in fp32, not FP8),
    set by the report."""
    problems: tuple[str, ...] = ()
    """Thresholds this layer crosses (empty: within every threshold), set by the report."""

    @property
    def label(self) -> str:
        """The layer's name, with its GEMM in brackets where the module runs several (MoE experts)."""
        return f"{self.name}[{self.gemm}]" if self.gemm else self.name

    def worst(self, role: str) -> CastStats | None:
        """The role's cast with the lowest SQNR (its uses differ only under rowwise and MX scaling)."""
        mine = [c for c in self.casts if c.role == role and c.elements]
        return min(mine, key=lambda c: (c.sqnr_db if not math.isnan(c.sqnr_db) else math.inf, -c.flushed_share),
                   default=None)

    def to_dict(self) -> dict[str, Any]:
        """The layer's figures as JSON data (``fp8dist probe --json``): its GEMM outputs' and reduction's SQNRs,
        every cast, the problems and the verdict."""
        return {"name": self.name, "gemm": self.gemm, "module_type": self.module_type, "calls": self.calls,
                "output_sqnr_db": json_number(self.output.sqnr_db),
                "grad_input_sqnr_db": json_number(self.grad_input.sqnr_db),
                "grad_weight_sqnr_db": json_number(self.grad_weight.sqnr_db),
                "reduce_sqnr_db": json_number(self.reduce.sqnr_db) if self.reduce else None,
                "reduce_small_sqnr_db": json_number(self.reduce.small_sqnr_db) if self.reduce else None,
                "casts": [c.to_dict() for c in self.casts], "problems": list(self.problems),
                "reduce_problems": list(self.reduce_problems)}
