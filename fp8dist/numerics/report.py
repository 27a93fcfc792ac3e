"""The probe's answer (:class:`NumericsReport`): per FP8 GEMM of the plan, what its casts do to its operands and
output, and the layers past the thresholds; a table and JSON."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..config.text import plural
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
            layer.reduce_problems = self.thresholds.reduce_problems(layer)

    @property
    def reduce_block(self) -> int | None:
        """The FP8 gradient reduction's block size measured (``reduce_fp8_block``); None: not measured (the probe's
        options did not set ``reduce_dtype="fp8"``)."""
        return next((layer.reduce.block for layer in self.layers if layer.reduce), None)

    @property
    def reduce_fallback(self) -> dict[str, str]:
        """Under ``reduce_dtype="fp8"``: module name -> why its weight gradient is to be reduced in fp32, not FP8
        (the plan reads it: :attr:`~fp8dist.plan.precision.PlanEntry.reduce_fallback`), in model order."""
        out: dict[str, list[str]] = {}
        for layer in self.layers:
            if layer.reduce_problems:
                out.setdefault(layer.name, []).extend(f"{layer.gemm}: {p}" if layer.gemm else p
                                                      for p in layer.reduce_problems)
        return {name: "; ".join(problems) for name, problems in out.items()}

    @property
    def recommended_exclude(self) -> list[str]:
        """Module names past a threshold, in model order: pass them as ``fp8_exclude``."""
        return list(dict.fromkeys(layer.name for layer in self.layers if layer.problems))

    def to_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (an SQNR of None: an exact round trip, or nothing measured)."""
        return {"backend": self.backend, "recipe": self.recipe, "hardware": self.hardware, "batches": self.batches,
                "tokens": self.tokens, "thresholds": asdict(self.thresholds), "notes": list(self.notes),
                "recommended_exclude": self.recommended_exclude, "reduce_block": self.reduce_block,
                "reduce_fallback": self.reduce_fallback, "layers": [layer.to_dict() for layer in self.layers]}

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
        block = self.reduce_block
        if block:
            lines.append(f"reduce_dtype='fp8' (e4m3 blocks of {block}): a weight gradient's SQNR after the blocks >= "
                         f"{t.min_reduce_sqnr_db:g} dB, of its values under 1/16 of their block's largest "
                         f">= {t.min_reduce_small_sqnr_db:g} dB, else it is reduced in fp32 (column 'reduce SQNR': all "
                         "/ small values)")
        lines += [f"note: {note}" for note in self.notes]
        rows = [["module", *(f"{short} {what}" for _, short in _ROLES for what in ("SQNR", "flush")), "rest SQNR",
                 "sat", "out SQNR", "dgrad SQNR", "wgrad SQNR", *(["reduce SQNR"] if block else []), "verdict"]]
        rows += [_row(layer, bool(block)) for layer in self.layers]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for i, row in enumerate(rows):
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:-1], widths[1:])]
            lines.append("  ".join(cells) + "  " + row[-1])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 7)
        exclude = self.recommended_exclude
        lines.append(f"recommended_exclude ({len(exclude)} of {plural(len({l.name for l in self.layers}), 'module')}): "
                     + (", ".join(exclude) if exclude else "none"))
        if block:
            fallback = self.reduce_fallback
            lines.append(f"gradients reduced in fp32, not FP8 ({len(fallback)}): "
                         + (", ".join(fallback) if fallback else "none"))
        return "\n".join(lines)


def _db(value: float) -> str:
    return "exact" if value == math.inf else "-" if math.isnan(value) else f"{value:.1f}"


def _row(layer: LayerNumerics, reduced: bool) -> list[str]:
    cells = [layer.label]
    for role, _ in _ROLES:
        worst = layer.worst(role)
        flushed = max((c.flushed_share for c in layer.casts if c.role == role), default=0.0)
        cells += ["hp", "-"] if worst is None else [_db(worst.sqnr_db), _share(flushed)]
    saturated = max((c.saturated_share for c in layer.casts), default=0.0)
    rest = min((c.rest_sqnr_db for c in layer.casts if c.rest_signal), default=math.nan)
    cells += [_db(rest), _share(saturated), _db(layer.output.sqnr_db) if layer.calls else "-",
              _db(layer.grad_input.sqnr_db), _db(layer.grad_weight.sqnr_db)]
    if reduced:
        cells.append(f"{_db(layer.reduce.sqnr_db)} / {_db(layer.reduce.small_sqnr_db)}" if layer.reduce else "-")
    verdicts = ["EXCLUDE: " + "; ".join(layer.problems)] if layer.problems else []
    verdicts += ["REDUCE IN FP32: " + "; ".join(layer.reduce_problems)] if layer.reduce_problems else []
    cells.append("not run by these batches" if not layer.calls else " | ".join(verdicts) or "ok")
    return cells


def _share(value: float) -> str:
    return f"{100 * value:.2f}%"
