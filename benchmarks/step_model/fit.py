"""Fit the step model's two constants (StepConstants.gemm_efficiency, memory_traffic) on the runs of runs.csv
marked ``fit`` (torchao's H100 bf16 and tensorwise rows), score every run, write fit.json.

    PYTHONPATH=. python benchmarks/step_model/fit.py     # ~1 min on one CPU core

The step time is linear in both constants (exposed communication aside, which is tiny and re-solved by iterating):
bf16 = k*G_b + mu*M + rest_b, FP8 = k*G_f + mu*M + rest_f, two equations, two unknowns."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from runs import compare, predict, read_runs, with_constants  # noqa: E402


def _fit(bf16_row: dict, fp8_row: dict) -> tuple[float, float]:
    k, mu = 1.0, 1.0
    for _ in range(4):  # exposure depends weakly on the compute: re-solve until it settles
        unit = predict(fp8_row, with_constants(gemm_efficiency=1.0, memory_traffic=1.0))
        parts = []
        for side, row in ((unit.bf16, bf16_row), (unit.fp8, fp8_row)):
            gemm = side.gemm_s * 7 / 6  # selective recompute: every other forward matmul
            memory = side.memory_s * 4 / 3  # and the elementwise forward
            rest = side.attention_s + side.optimizer_s + side.exposed_s
            parts.append((gemm, memory, row["micro_batch_size"] * row["seq_len"] / row["tokens_per_s"] - rest))
        (g1, m1, t1), (g2, m2, t2) = parts
        k = (t1 - t2) / (g1 - g2) if m1 == m2 else (t1 * m2 - t2 * m1) / (g1 * m2 - g2 * m1)
        mu = (t1 - k * g1) / m1
    return k, mu


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
