"""Fit the step model's four constants (runs.THETA: StepConstants.gemm_efficiency and memory_traffic, the Blackwell
records' MXFP8 and NVFP4 block-cast slowdowns) on every modelled row of every source in runs.csv, write fit.json
with the constants and every row's prediction under them.

    PYTHONPATH=. python benchmarks/step_model/fit.py     # ~1 min on one CPU core

The shipped constants (fp8dist/plan/speed/constants.py's STEP_CONSTANTS, fp8dist/runtime/gpus.py's
B200_CALIBRATION.block_cast_slowdown) are this fit's, to 3 significant digits; the script says when they differ.
How well the constants carry to a source they were not fitted on: agree.py (leave one source out)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from runs import SHIPPED, THETA, fit, modelled, read_runs, row_model  # noqa: E402

OUT = Path(__file__).with_name("fit.json")


def predictions(models, theta) -> list[dict]:
    """Each row's published and predicted tokens/s and speedup under ``theta``."""
    out = []
    for model in models:
        tokens, speedup = model.predicted(theta)
        row = model.row
        out.append(dict(source=row["source"], table=row["table"], gpu=row["gpu"], recipe=row["recipe"] or "bf16",
                        published_tokens_per_s=row["tokens_per_s"],
                        predicted_tokens_per_s=None if tokens is None else round(tokens, 1),
                        published_speedup=None if row["speedup"] is None else round(row["speedup"], 4),
                        predicted_speedup=None if speedup is None else round(speedup, 4), url=row["url"]))
    return out


def main() -> None:
    models = [row_model(r) for r in modelled(read_runs())]
    theta = fit(models)
    result = {"constants": dict(zip(THETA, theta)), "rows": predictions(models, theta),
              "prediction": "every figure here is a prediction of the step model, beside the published one"}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{dict(zip(THETA, theta))} -> {OUT}")
    if theta != SHIPPED:
        print(f"the shipped constants {dict(zip(THETA, SHIPPED))} differ: set constants.STEP_CONSTANTS and "
              "gpus.B200_CALIBRATION.block_cast_slowdown to the fit's")


if __name__ == "__main__":
    main()
