"""What the memory tools share: the parts of a model a report row describes, the row itself, the parameters
counted in a part, and the plain-text table both the report and the estimate print."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from torch import nn

__all__ = ["Part", "PrecisionRow", "Held", "Members", "text_table"]


class Part(str, Enum):
    """What a part of the model computes: the key of a report row (rows come in this order)."""

    FP8_GEMM = "fp8_gemm"
    """Modules the precision plan converted to FP8 GEMMs (torchao Float8Linear, te.Linear, MS-AMP's Linear)."""
    FP8_GROUPED_GEMM = "fp8_grouped_gemm"
    """MoE experts the precision plan converted to FP8 grouped GEMMs (torchao's MoE training conversion)."""
    GEMM = "gemm"
    """Every other module holding a matrix operand: nn.Linear, GPT-2's Conv1D, a MoE router, fused experts."""
    OTHER = "other"
    """Lookup tables (embeddings) and modules with only 1-D parameters (norms): no GEMM."""

    @property
    def label(self) -> str:
        """The part's row label in the printed chart."""
        return _LABELS[self]


_LABELS = {Part.FP8_GEMM: "FP8 GEMM", Part.FP8_GROUPED_GEMM: "FP8 grouped GEMM (MoE experts)",
           Part.GEMM: "GEMM (high precision)", Part.OTHER: "other (embeddings, norms)"}


@dataclass(frozen=True)
class PrecisionRow:
    """One part of the model (FP8 GEMMs, high-precision GEMMs, everything else) as the chart shows it."""

    part: Part
    """Which part of the model the row is."""
    modules: int
    """Modules of this kind that hold parameters."""
    params: int
    """Elements of the full model in this part, each parameter once (a tied embedding counts as a GEMM's)."""
    gemm: str
    """What its GEMMs compute in ("fp8 e4m3 ...", "bf16"), or "no GEMM"."""
    all_gather: str
    """The weights' dtype when gathered (FSDP, ZeRO-3; ZeRO-1/2 after the step)."""
    reduce: str
    """What its gradients are reduced in ("none" for one process)."""
    weight: str
    """The weights' dtype as stored on this rank."""
    master_weight: str
    """The master weights' dtype the engine (a ZeRO partition) or the memory level keeps, or "none"."""
    weight_grad: str
    """The weight gradients' dtype as held on this rank ("none held now" before a backward)."""
    optimizer_states: str
    """The optimizer states' dtype as held on this rank ("none yet" before the first step)."""


@dataclass(frozen=True)
class Held:
    """A parameter of ``module`` (attribute ``name``) with its full shape."""

    module: nn.Module
    """The module holding it."""
    name: str
    """Its attribute name on ``module`` ("weight")."""
    param: nn.Parameter
    """The parameter as the engine holds it (a shard, or part of a flat parameter's view)."""
    shape: tuple[int, ...]
    """Its full (unsharded) shape."""

    @property
    def numel(self) -> int:
        """Elements of the held tensor (the product of its shape)."""
        return math.prod(self.shape)


@dataclass
class Members:
    """The modules of one part, and the parameters counted in it (each in one part only)."""

    modules: list[nn.Module] = field(default_factory=list)
    """The modules of the part, in model order."""
    params: list[Held] = field(default_factory=list)
    """The parameters counted in it."""


def text_table(cols: list[str], rows: list[list[str]]) -> str:
    """A plain text table: the header ``cols``, a rule, then ``rows`` (each a list of cells), columns padded to their
    widest cell, trailing spaces stripped."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])
