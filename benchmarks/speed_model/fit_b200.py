"""Fit the speed model's B200 constants for the block-scaled recipes on torchao's published B200 forward table,
rows M (= K = N) in {1024, 4096, 16384} only, scored on the held-out rows {2048, 8192}; then the grouped-GEMM
constants on torchao's MXFP8 grouped-GEMM forward + backward table, rows G in {1, 8} only (both shapes), scored on
the held-out rows G in {2, 4}.

    PYTHONPATH=. python benchmarks/speed_model/fit_b200.py       # writes fit_b200.json beside this file

Free constants (fp8dist.runtime.gpus.Calibration), two per recipe, fitted apart: MXFP8's GEMM fraction of the dense
FP8 peak and its quantize kernel's slowdown; NVFP4's GEMM fraction of the dense FP4 peak and its cast kernel's
slowdown. Fixed: the H100's bf16 GEMM fraction (0.78), bandwidth fraction (0.92) and 2 us kernel floor (torchao's
roofline_utils.py copies the same H100 figures to the B200). The loss is the sum of squared log(predicted /
measured) of agreement.forward_rig_speedup; Nelder-Mead over the constants' logs (fit.py's),
rounded to 3 significant digits, which is what fp8dist/runtime/gpus.py holds.

Grouped GEMMs (MoE experts, recipe moe_mxfp8), two constants on top of the forward fit's: the grouped GEMM
efficiency (the fraction of a dense GEMM's rate a grouped one reaches, bf16 and MXFP8 alike) and the grouped
quantize kernels' slowdown. The table publishes both times, so the loss is the sum of squared log errors of the
bf16 and the MXFP8 time (agreement.grouped_seconds): the times fix the efficiency, which a
speedup alone could not tell from the casts' share."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path

from agreement import (B200_FIT_ROWS, B200_HELD_OUT_ROWS, GROUPED_FIT_GROUPS, GROUPED_HELD_OUT_GROUPS, agreement,
                       forward_rig_speedup, grouped_seconds, grouped_speedup, read_forward_table, read_grouped_table)
from fit import best_of

from fp8dist.runtime.gpus import B200_CALIBRATION, gpu_by_key

HERE = Path(__file__).parent
FORWARD = HERE / "torchao_b200_forward.csv"
GROUPED = HERE / "torchao_b200_moe_mxfp8.csv"
OUT = HERE / "fit_b200.json"
# both torchao recipes: their cast slowdown is torchao's block-cast slot (0), fitted here per recipe on the inference
# forward kernels only to fit the GEMM fractions beside them; the shipped slot is fitted on training steps
# (benchmarks/step_model/fit.py)
FIELD = {"mxfp8": ("mx_gemm_fraction", 0), "nvfp4": ("fp4_gemm_fraction", 0)}


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

    return best_of(loss, ((0.7, 1.0), (0.5, 3.0), (0.9, 0.5)))


def grouped_b200(efficiency: float, slowdown: float, base=B200_CALIBRATION):
    """The B200 record with the grouped GEMM's two constants set."""
    cal = dataclasses.replace(base, grouped_gemm_efficiency=efficiency, grouped_block_cast_slowdown=slowdown)
    return dataclasses.replace(gpu_by_key("b200"), calibration=cal)


def fit_grouped(rows, base=B200_CALIBRATION) -> tuple[tuple[float, float], float]:
    """The grouped constants fitted on ``rows`` (measured times), every other constant ``base``'s."""
    def loss(logs):
        gpu = grouped_b200(*(math.exp(v) for v in logs), base=base)
        return sum(math.log(p / t) ** 2 for r in rows
                   for p, t in zip(grouped_seconds(r.m, r.k, r.n, r.groups, gpu), (r.bf16_s, r.low_s)))

    return best_of(loss, ((0.5, 3.0), (0.9, 1.0), (0.3, 6.0)))


def grouped_result(base) -> dict:
    """The grouped fit and its agreement, per row and on each part."""
    table = read_grouped_table(GROUPED)
    (efficiency, slowdown), value = fit_grouped([r for r in table if r.groups in GROUPED_FIT_GROUPS], base)
    gpu = grouped_b200(efficiency, slowdown, base)
    predict = lambda r: grouped_speedup(r.m, r.k, r.n, r.groups, gpu)  # noqa: E731
    rows = [{"m": r.m, "k": r.k, "n": r.n, "groups": r.groups, "measured": r.speedup,
             "predicted": round(predict(r), 3), "part": "fit" if r.groups in GROUPED_FIT_GROUPS else "held out"}
            for r in table]
    parts = (("fit rows", GROUPED_FIT_GROUPS), ("held-out rows", GROUPED_HELD_OUT_GROUPS))
    return {"grouped_gemm_efficiency": efficiency, "grouped_block_cast_slowdown": slowdown,
            "fit_groups": list(GROUPED_FIT_GROUPS), "held_out_groups": list(GROUPED_HELD_OUT_GROUPS),
            "loss_sum_squared_log_error": round(value, 4), "rows": rows,
            "agreement": {name: dataclasses.asdict(agreement([r for r in table if r.groups in gs], predict))
                          for name, gs in parts},
            "max_relative_error": {name: round(max(abs(predict(r) / r.speedup - 1) for r in table
                                                   if r.groups in gs), 4) for name, gs in parts}}


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
    result["moe_mxfp8_grouped"] = grouped_result(base)
    result["tables"] = [str(FORWARD.relative_to(HERE.parent.parent)), str(GROUPED.relative_to(HERE.parent.parent))]
    result["date"] = datetime.date.today().isoformat()
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
