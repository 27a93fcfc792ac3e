"""Fit the speed model's B200 constants for the block-scaled recipes on torchao's published B200 forward table,
rows M (= K = N) in {1024, 4096, 16384} only; score them on the held-out rows {2048, 8192} and, unfitted, on
torchao's MXFP8 grouped-GEMM forward + backward table.

    PYTHONPATH=. python benchmarks/speed_model/fit_b200.py       # writes fit_b200.json beside this file

Free constants (fp8dist.plan.gpus.Calibration), two per recipe, fitted apart: MXFP8's GEMM fraction of the dense
FP8 peak and its quantize kernel's slowdown; NVFP4's GEMM fraction of the dense FP4 peak and its cast kernel's
slowdown. Fixed: the H100's bf16 GEMM fraction (0.78), bandwidth fraction (0.92) and 2 us kernel floor (torchao's
roofline_utils.py copies the same H100 figures to the B200). The loss is the sum of squared log(predicted /
measured) of fp8dist.plan.speed.calibration.forward_rig_speedup; Nelder-Mead over the constants' logs (fit.py's),
rounded to 3 significant digits, which is what fp8dist/plan/gpus.py holds."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import statistics
from pathlib import Path

from fit import nelder_mead

from fp8dist.plan.gpus import B200_CALIBRATION, gpu_by_key
from fp8dist.plan.speed.calibration import (B200_FIT_ROWS, B200_HELD_OUT_ROWS, agreement, forward_rig_speedup,
                                            grouped_speedup, read_forward_table, read_grouped_table)

HERE = Path(__file__).parent
FORWARD = HERE / "torchao_b200_forward.csv"
GROUPED = HERE / "torchao_b200_moe_mxfp8.csv"
OUT = HERE / "fit_b200.json"
FIELD = {"mxfp8": ("mx_gemm_fraction", 0), "nvfp4": ("fp4_gemm_fraction", 1)}


def b200(recipe: str, fraction: float, slowdown: float, base=B200_CALIBRATION):
    """The B200 record with ``recipe``'s two constants set."""
    field, index = FIELD[recipe]
    slowdowns = list(base.block_cast_slowdown)
    slowdowns[index] = slowdown
    cal = dataclasses.replace(base, **{field: fraction}, block_cast_slowdown=tuple(slowdowns))
    return dataclasses.replace(gpu_by_key("b200"), calibration=cal)


def fit(recipe: str, rows) -> tuple[tuple[float, float], float]:
    def loss(logs):
        fraction, slowdown = (math.exp(v) for v in logs)
        if fraction > 1:
            return math.inf
        gpu = b200(recipe, fraction, slowdown)
        return sum(math.log(forward_rig_speedup(r.m, r.k, r.n, gpu, recipe) / r.speedup) ** 2 for r in rows)

    results = []
    for start in ((0.7, 1.0), (0.5, 3.0), (0.9, 0.5)):
        logs, _ = nelder_mead(loss, [math.log(v) for v in start])
        results.append(nelder_mead(loss, logs))
    logs, value = min(results, key=lambda r: r[1])
    return tuple(float(f"{math.exp(v):.3g}") for v in logs), value


def main() -> None:
    table = read_forward_table(FORWARD)
    result: dict = {"fit_rows_m": list(B200_FIT_ROWS), "held_out_rows_m": list(B200_HELD_OUT_ROWS), "recipes": {}}
    base = B200_CALIBRATION
    for recipe, rows in table.items():
        (fraction, slowdown), value = fit(recipe, [r for r in rows if r.m in B200_FIT_ROWS])
        gpu = b200(recipe, fraction, slowdown)
        base = b200(recipe, fraction, slowdown, base).calibration
        predict = lambda r, gpu=gpu, recipe=recipe: forward_rig_speedup(r.m, r.k, r.n, gpu, recipe)  # noqa: E731
        result["recipes"][recipe] = {
            FIELD[recipe][0]: fraction, "block_cast_slowdown": slowdown, "loss_sum_squared_log_error": round(value, 4),
            "rows": [{"m": r.m, "measured": r.speedup, "predicted": round(predict(r), 3),
                      "part": "fit" if r.m in B200_FIT_ROWS else "held out"} for r in rows],
            "agreement": {name: dataclasses.asdict(agreement([r for r in rows if r.m in ms], predict))
                          for name, ms in (("fit rows", B200_FIT_ROWS), ("held-out rows", B200_HELD_OUT_ROWS))}}
    gpu = dataclasses.replace(gpu_by_key("b200"), calibration=base)
    grouped = read_grouped_table(GROUPED)
    rows = [{"m": r.m, "k": r.k, "n": r.n, "groups": g, "measured": r.speedup,
             "predicted": round(grouped_speedup(r.m, r.k, r.n, g, gpu), 3)} for r, g in grouped]
    result["moe_mxfp8_grouped_held_out"] = {
        "rows": rows, "median_relative_error": round(statistics.median(abs(r["predicted"] / r["measured"] - 1)
                                                                       for r in rows), 4)}
    result["tables"] = [str(FORWARD.relative_to(HERE.parent.parent)), str(GROUPED.relative_to(HERE.parent.parent))]
    result["date"] = datetime.date.today().isoformat()
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
