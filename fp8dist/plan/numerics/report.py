"""The probe's answer (:class:`NumericsReport`): per FP8 GEMM of the plan, what its casts do to its operands and
output, and the layers past the thresholds; a table and JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ...config.text import plural
from .stats import LayerNumerics
from .thresholds import DEFAULT_THRESHOLDS, Thresholds

__all__ = ["NumericsReport"]

_ROLES = (("input", "in"), ("weight", "weight"), ("grad_output", "grad out"))


@dataclass(frozen=True)
class NumericsReport:
    """What :func:`fp8dist.measure_fp8_numerics` measured.

    Example::

        report = fp8dist.measure_fp8_numerics(model, batches, fp8="torchao")
        print(report)
        model = fp8dist.wrap_model(model, fp8="torchao", fp8_exclude=report.recommended_exclude)
    """

    backend: str
    """The FP8 backend whose casts were measured (torchao, te)."""
    recipe: str
    """Its recipe, as the plan describes it."""
    hardware: str
    """The machine the plan was made for (its candidates and MoE recipe depend on it)."""
    batches: int
    tokens: int
    """Tokens (or batch elements) seen, over every batch."""
    layers: tuple[LayerNumerics, ...]
    """One per FP8 GEMM of the plan, in model order (a MoE experts module has one per fused weight)."""
    thresholds: Thresholds = DEFAULT_THRESHOLDS
    notes: tuple[str, ...] = ()
    """What the user should know: emulated casts, planned layers that never ran, experts left out and why."""

    def __post_init__(self) -> None:
        for layer in self.layers:
            layer.problems = self.thresholds.problems(layer)

    @property
    def recommended_exclude(self) -> list[str]:
        """Module names past a threshold, in model order: pass them as ``fp8_exclude``."""
        return list(dict.fromkeys(layer.name for layer in self.layers if layer.problems))

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (an SQNR of None: an exact round trip, or nothing measured)."""
        return {"backend": self.backend, "recipe": self.recipe, "hardware": self.hardware, "batches": self.batches,
                "tokens": self.tokens, "thresholds": asdict(self.thresholds), "notes": list(self.notes),
                "recommended_exclude": self.recommended_exclude, "layers": [layer.to_dict() for layer in self.layers]}

    def __str__(self) -> str:
        t = self.thresholds
        lines = [f"FP8 numerics probe: fp8={self.backend} ({self.recipe}), planned for {self.hardware}; "
                 f"{plural(self.batches, 'batch')}, {plural(self.tokens, 'token')}, model in high precision",
                 f"thresholds: output SQNR >= {t.min_output_sqnr_db:g} dB, its gradients' (dgrad, wgrad) >= "
                 f"{t.min_grad_sqnr_db:g} dB; an operand's SQNR beside each row's largest (rest) >= "
                 f"{t.min_rest_sqnr_db:g} dB; flushed to zero <= {100 * t.max_flushed_share:g}% (input, weight), "
                 f"{100 * t.max_grad_flushed_share:g}% (grad out); saturated <= {100 * t.max_saturated_share:g}%  "
                 "(SQNR: worst of an operand's casts, in dB)"]
        if any(c.fp4 for layer in self.layers for c in layer.casts):
            lines.append(f"FP4 (NVFP4) GEMMs: output SQNR >= {t.fp4_min_output_sqnr_db:g} dB, rest >= "
                         f"{t.fp4_min_rest_sqnr_db:g} dB, input and weight flushed <= "
                         f"{100 * t.fp4_max_flushed_share:g}%, grad out {100 * t.fp4_max_grad_flushed_share:g}%, "
                         "input and weight in blocks whose scale sat at its floor <= "
                         f"{100 * t.fp4_max_floored_share:g}% (e2m1 has two mantissa bits fewer than e4m3)")
        lines += [f"note: {note}" for note in self.notes]
        rows = [["module", *(f"{short} {what}" for _, short in _ROLES for what in ("SQNR", "flush")), "rest SQNR",
                 "sat", "out SQNR", "dgrad SQNR", "wgrad SQNR", "verdict"]]
        rows += [_row(layer) for layer in self.layers]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for i, row in enumerate(rows):
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:-1], widths[1:])]
            lines.append("  ".join(cells) + "  " + row[-1])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 7)
        exclude = self.recommended_exclude
        lines.append(f"recommended_exclude ({len(exclude)} of {plural(len({l.name for l in self.layers}), 'module')}): "
                     + (", ".join(exclude) if exclude else "none"))
        return "\n".join(lines)


def _db(value: float) -> str:
    return "exact" if value == math.inf else "-" if math.isnan(value) else f"{value:.1f}"


def _row(layer: LayerNumerics) -> list[str]:
    cells = [layer.label]
    for role, _ in _ROLES:
        worst = layer.worst(role)
        flushed = max((c.flushed_share for c in layer.casts if c.role == role), default=0.0)
        cells += ["hp", "-"] if worst is None else [_db(worst.sqnr_db), _share(flushed)]
    saturated = max((c.saturated_share for c in layer.casts), default=0.0)
    rest = min((c.rest_sqnr_db for c in layer.casts if c.rest_signal), default=math.nan)
    cells += [_db(rest), _share(saturated), _db(layer.output.sqnr_db) if layer.calls else "-",
              _db(layer.grad_input.sqnr_db), _db(layer.grad_weight.sqnr_db),
              "not run by these batches" if not layer.calls else
              "EXCLUDE: " + "; ".join(layer.problems) if layer.problems else "ok"]
    return cells


def _share(value: float) -> str:
    return f"{100 * value:.2f}%"
