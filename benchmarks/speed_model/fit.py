"""Fit the speed model's H100 constants on torchao's published rowwise table, rows M in {1024, 4096, 16384} only.

    PYTHONPATH=. python benchmarks/speed_model/fit.py            # writes fit_h100_rowwise.json beside this file

Free constants (fp8dist.runtime.gpus.Calibration): the FP8 GEMM fraction and the three operands' column-wise cast
slowdowns. Fixed from torchao's roofline_utils.py (H100, measured there): bf16 GEMMs reach 0.78 of the peak,
elementwise kernels 0.92 of the bandwidth, no kernel takes less than 2 us (a free floor fits the same loss, 0.503
vs 0.504, with no better agreement); speedup data fix only the ratio of the two GEMM fractions.
The loss is the sum of squared log(predicted / measured) over the fit rows (the quantity measured: LayerNorm ->
Linear -> Sigmoid, agreement.rig_speedup). Minimised by Nelder-Mead over the constants' logs from
several starts; the result is rounded to 3 significant digits, which is what fp8dist/runtime/gpus.py holds."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path

from agreement import FIT_ROWS, HELD_OUT_ROWS, agreement, read_measurements, rig_speedup

from fp8dist.runtime.gpus import H100_CALIBRATION, gpu_by_key

HERE = Path(__file__).parent
TABLE = HERE.parent.parent / "tests" / "data" / "torchao_fp8_rowwise_h100.csv"
OUT = HERE / "fit_h100_rowwise.json"
STARTS = ((0.8, 5.0, 3.0, 3.0), (0.7, 10.0, 6.0, 4.0), (0.9, 3.0, 8.0, 2.0))
NAMES = ("fp8_gemm_fraction", "input_cast_slowdown", "weight_cast_slowdown", "grad_output_cast_slowdown")


def calibration(values: tuple[float, ...]):
    """A Calibration with these four free constants, the fixed ones from H100_CALIBRATION."""
    fraction, x, w, g = values
    return dataclasses.replace(H100_CALIBRATION, fp8_gemm_fraction=fraction, cast_slowdown=(x, w, g))


def loss(values: tuple[float, ...], rows) -> float:
    if values[0] > 1:
        return math.inf
    gpu = dataclasses.replace(gpu_by_key(H100_CALIBRATION.measured_on), calibration=calibration(values))
    return sum(math.log(rig_speedup(r.m, r.k, r.n, gpu) / r.speedup) ** 2 for r in rows)


def nelder_mead(f, start: list[float], iterations: int = 600, step: float = 0.3) -> tuple[list[float], float]:
    """Minimise f from start: the textbook simplex (reflect, expand, contract, shrink)."""
    simplex = [list(start)] + [[v + (step if i == j else 0.0) for j, v in enumerate(start)] for i in range(len(start))]
    scores = [f(p) for p in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=scores.__getitem__)
        simplex, scores = [simplex[i] for i in order], [scores[i] for i in order]
        centre = [sum(col) / (len(simplex) - 1) for col in zip(*simplex[:-1])]
        towards = lambda t: [c + t * (c - w) for c, w in zip(centre, simplex[-1])]  # noqa: E731
        reflected = towards(1.0)
        r = f(reflected)
        if r < scores[0]:
            expanded = towards(2.0)
            e = f(expanded)
            simplex[-1], scores[-1] = (expanded, e) if e < r else (reflected, r)
        elif r < scores[-2]:
            simplex[-1], scores[-1] = reflected, r
        else:
            contracted = towards(-0.5)
            c = f(contracted)
            if c < scores[-1]:
                simplex[-1], scores[-1] = contracted, c
            else:
                simplex = [simplex[0]] + [[b + 0.5 * (v - b) for b, v in zip(simplex[0], p)] for p in simplex[1:]]
                scores = [scores[0]] + [f(p) for p in simplex[1:]]
    best = min(range(len(simplex)), key=scores.__getitem__)
    return simplex[best], scores[best]


def best_of(f, starts) -> tuple[tuple[float, ...], float]:
    """The positive constants minimizing ``f`` (a function of their logs) over Nelder-Mead runs from each of
    ``starts``, each restarted once from where it stopped, to 3 significant digits; and that minimum."""
    results = []
    for start in starts:
        logs, _ = nelder_mead(f, [math.log(v) for v in start])
        results.append(nelder_mead(f, logs))  # a restart escapes a collapsed simplex
    logs, value = min(results, key=lambda r: r[1])
    return tuple(float(f"{math.exp(v):.3g}") for v in logs), value


def fit(rows) -> tuple[tuple[float, ...], float]:
    """The best constants from every start (searched over their logs, so each stays positive)."""
    return best_of(lambda logs: loss(tuple(math.exp(v) for v in logs), rows), STARTS)


def main() -> None:
    measured = read_measurements(TABLE)
    fit_rows = [r for r in measured if r.m in FIT_ROWS]
    values, value = fit(fit_rows)
    gpu = dataclasses.replace(gpu_by_key(H100_CALIBRATION.measured_on), calibration=calibration(values))
    predict = lambda r: rig_speedup(r.m, r.k, r.n, gpu)  # noqa: E731
    scores = {name: dataclasses.asdict(agreement([r for r in measured if r.m in ms], predict))
              for name, ms in (("fit rows", FIT_ROWS), ("held-out rows", HELD_OUT_ROWS),
                               ("all", FIT_ROWS + HELD_OUT_ROWS))}
    result = {
        "constants": dict(zip(NAMES, values)),
        "fixed": {"bf16_gemm_fraction": H100_CALIBRATION.bf16_gemm_fraction,
                  "memory_fraction": H100_CALIBRATION.memory_fraction,
                  "kernel_floor_s": H100_CALIBRATION.kernel_floor_s},
        "fit_rows_m": list(FIT_ROWS), "loss_sum_squared_log_error": round(value, 4),
        "agreement_at_margin_1": scores,
        "table": str(TABLE.relative_to(HERE.parent.parent)), "date": datetime.date.today().isoformat(),
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
