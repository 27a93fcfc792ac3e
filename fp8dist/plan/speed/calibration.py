"""The speed model against published measurements: the quantity torchao's table measures (LayerNorm -> Linear ->
Sigmoid, forward + backward, compiled) and the agreement figures the calibration is judged by. Read by the fit
(``benchmarks/speed_model/fit.py``) and the tests, so both compute the same thing."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..gpus import GpuSpec
from .model import linear_seconds
from .recipes import recipe_named

__all__ = ["Measurement", "Agreement", "FIT_ROWS", "HELD_OUT_ROWS", "read_measurements", "rig_speedup", "agreement"]

FIT_ROWS = (1024, 4096, 16384)
"""The table's M values the constants are fitted on."""
HELD_OUT_ROWS = (2048, 8192, 32768)
"""The table's M values kept out of the fit, to judge it."""


@dataclass(frozen=True)
class Measurement:
    """One published shape: forward M, K, N and the measured speedup over bf16."""

    m: int
    k: int
    n: int
    speedup: float


def read_measurements(path: str | Path) -> list[Measurement]:
    """The rows of a speedup table CSV (``m,k,n,speedup`` after ``#`` comment lines naming its source)."""
    lines = [line for line in Path(path).read_text().splitlines() if line and not line.startswith("#")]
    return [Measurement(int(r["m"]), int(r["k"]), int(r["n"]), float(r["speedup"])) for r in csv.DictReader(lines)]


def rig_speedup(m: int, k: int, n: int, gpu: GpuSpec, recipe: str = "rowwise", compile: bool = True) -> float:
    """The speedup torchao's benchmark (``benchmarks/float8/float8_roofline.py``) measures: the Linear between a
    LayerNorm and a Sigmoid, whose four memory-bound kernels (LayerNorm and Sigmoid, forward and backward) both
    ways share. Under compile the FP8 casts of the input and grad_output fuse into those kernels."""
    cal = gpu.calibration
    bandwidth = gpu.memory_tbps * 1e12 * cal.memory_fraction
    # LayerNorm: forward reads x, writes y; backward reads grad and x, writes grad. Sigmoid alike over (m, n).
    shared = sum(max(b / bandwidth, cal.kernel_floor_s) for b in (4 * m * k, 6 * m * k, 4 * m * n, 6 * m * n))
    bf16, fp8, casts = linear_seconds(m, k, n, gpu, recipe_named(recipe), compile)
    return (bf16 + shared) / (fp8 + casts + shared)


@dataclass(frozen=True)
class Agreement:
    """How a rule that converts where the predicted speedup clears ``margin`` agrees with measurements."""

    shapes: int
    right: int
    """Decisions right: converted iff the measured speedup is >= 1."""
    converted_slower: int
    """Shapes converted whose measured speedup is < 1."""
    geomean_chosen: float
    """Geometric mean over the shapes of what the rule chooses: the measured speedup where it converts, 1 where not."""
    median_relative_error: float | None
    """Median of |predicted / measured - 1| (None for a rule with no predicted figure)."""
    margin: float


def agreement(measured: Iterable[Measurement], predict: Callable[[Measurement], float], margin: float = 1.0,
              figures: bool = True) -> Agreement:
    """Score ``predict`` (a measurement's shape -> predicted speedup) against ``measured``: a shape converts where
    the prediction is >= ``margin``. ``figures=False`` for a yes/no rule (1 or 0), whose error means nothing."""
    rows = list(measured)
    predicted = [predict(r) for r in rows]
    converts = [p >= margin for p in predicted]
    right = sum(c == (r.speedup >= 1) for c, r in zip(converts, rows))
    slower = sum(c and r.speedup < 1 for c, r in zip(converts, rows))
    geomean = math.exp(sum(math.log(r.speedup) for c, r in zip(converts, rows) if c) / len(rows))
    error = statistics.median(abs(p / r.speedup - 1) for p, r in zip(predicted, rows)) if figures else None
    return Agreement(len(rows), right, slower, geomean, error, margin)
