"""Fit the step model's two constants (StepConstants.gemm_efficiency, memory_traffic) on the runs of runs.csv
marked ``fit`` (torchao's H100 bf16 and tensorwise rows), score every run, write fit.json.

    PYTHONPATH=. python benchmarks/step_model/fit.py     # ~1 min on one CPU core

The step time is affine in both constants: bf16 = k*G_b + mu*M + rest_b, FP8 = k*G_f + mu*M + rest_f, two
equations, two unknowns."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from runs import compare, predict, read_runs, with_constants  # noqa: E402


def _fit(bf16_row: dict, fp8_row: dict) -> tuple[float, float]:
    """Solve step(k, mu) = published for both rows; the step is affine in k and mu (exposed communication aside,
    which is one block's worth at these sizes), so three evaluations per row give its coefficients."""
    def step_s(k: float, mu: float) -> tuple[float, float]:
        step = predict(fp8_row, with_constants(gemm_efficiency=k, memory_traffic=mu))
        return step.bf16.step_s, step.fp8.step_s

    base, unit_k, unit_mu = step_s(0, 0), step_s(1, 0), step_s(0, 1)
    published = [row["micro_batch_size"] * row["seq_len"] / row["tokens_per_s"] for row in (bf16_row, fp8_row)]
    (a1, a2), (b1, b2) = ([u - b for u, b in zip(unit, base)] for unit in (unit_k, unit_mu))
    t1, t2 = (t - b for t, b in zip(published, base))
    det = a1 * b2 - a2 * b1
    return (t1 * b2 - t2 * b1) / det, (a1 * t2 - a2 * t1) / det


def main() -> None:
    rows = read_runs()
    fit_rows = [r for r in rows if r["role"] == "fit"]
    bf16_row = next(r for r in fit_rows if r["recipe"] is None)
    fp8_row = next(r for r in fit_rows if r["recipe"] is not None)
    k, mu = _fit(bf16_row, fp8_row)
    constants = with_constants(gemm_efficiency=round(k, 3), memory_traffic=round(mu, 2))
    result = {"gemm_efficiency": constants.gemm_efficiency, "memory_traffic": constants.memory_traffic,
              "fitted_on": constants.fitted_on, "rows": compare(rows, constants),
              "prediction": "every figure here is a prediction of the step model, beside the published one"}
    out = Path(__file__).with_name("fit.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"gemm_efficiency={constants.gemm_efficiency} memory_traffic={constants.memory_traffic} -> {out}")
    for r in result["rows"]:
        miss = f"  speedup {r.get('predicted_speedup_pct')}% vs {r.get('published_speedup_pct')}%" \
            if "speedup_miss_pp" in r else ""
        print(f"{r['role']:8} {r['table']:15} {r['recipe']:18} compile={r['compile']!s:5} {r['published']:>8} "
              f"{r['predicted']:>9} ({r['error_pct']:+.1f}%){miss}")


if __name__ == "__main__":
    main()
