"""The speed model against published measurements: the quantities torchao's tables measure (H100: LayerNorm ->
Linear -> Sigmoid, fwd + bwd, compiled; B200: ReLU -> quantized Linear, fwd; B200 MXFP8 grouped GEMMs, fwd + bwd) and
the agreement figures. Read by the fits, report.py, benchmarks/gpu and the tests, so all compute the same thing."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from fp8dist.runtime.gpus import GpuSpec
from fp8dist.plan.speed.model import gemm_seconds, kernel_seconds, linear_seconds
from fp8dist.plan.speed.recipes import AO_KERNELS, Kernel, recipe_named

__all__ = ["Measurement", "GroupedMeasurement", "Agreement", "FIT_ROWS", "HELD_OUT_ROWS", "B200_FIT_ROWS",
           "B200_HELD_OUT_ROWS", "GROUPED_FIT_GROUPS", "GROUPED_HELD_OUT_GROUPS", "read_measurements",
           "read_forward_table", "read_grouped_table", "rig_speedup", "forward_rig_speedup", "grouped_seconds",
           "grouped_speedup", "agreement"]

FIT_ROWS = (1024, 4096, 16384)
"""The table's M values the constants are fitted on."""
HELD_OUT_ROWS = (2048, 8192, 32768)
"""The table's M values kept out of the fit, to judge it."""
B200_FIT_ROWS = (1024, 4096, 16384)
"""The B200 forward table's M (= K = N) values the block-scaled recipes' constants are fitted on."""
B200_HELD_OUT_ROWS = (2048, 8192)
"""The B200 forward table's M values kept out of the fit."""
GROUPED_FIT_GROUPS = (1, 8)
"""The B200 MXFP8 grouped-GEMM table's expert counts G the grouped constants are fitted on (both shapes: the ends
of the range, so the held-out rows are interpolated, as the forward fit's are)."""
GROUPED_HELD_OUT_GROUPS = (2, 4)
"""The grouped table's G values kept out of the fit."""

# The activation's quantize kernel in torchao's inference roofline (roofline_utils.py,
# get_inference_tensor_memory_traffic_ovhd_s, fusion modelled: the ReLU rides in it): MXFP8 one kernel (read bf16,
# write FP8 + E8M0 scales); NVFP4 with a dynamic global scale an amax pass, its tiny second stage, then the cast.
_FORWARD_CASTS = {
    "mxfp8": (Kernel(2 + 1 + 1 / 32, block=AO_KERNELS),),
    "nvfp4": (Kernel(2), Kernel(0), Kernel(2 + 0.5 + 1 / 16, block=AO_KERNELS)),
}


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


def read_forward_table(path: str | Path) -> dict[str, list[Measurement]]:
    """The rows of a per-recipe forward table CSV (``recipe,m,k,n,roofline,speedup``), by recipe."""
    lines = [line for line in Path(path).read_text().splitlines() if line and not line.startswith("#")]
    table: dict[str, list[Measurement]] = {}
    for r in csv.DictReader(lines):
        table.setdefault(r["recipe"], []).append(Measurement(int(r["m"]), int(r["k"]), int(r["n"]),
                                                             float(r["speedup"])))
    return table


@dataclass(frozen=True)
class GroupedMeasurement(Measurement):
    """One published grouped-GEMM shape: M rows routed to ``groups`` experts of weight (N, K) each, and the
    measured forward + backward times in seconds."""

    groups: int
    bf16_s: float
    low_s: float
    """The low-precision (MXFP8) way's time."""


def read_grouped_table(path: str | Path) -> list[GroupedMeasurement]:
    """The rows of a grouped-GEMM table CSV (``m,n,k,groups,bf16_us,mxfp8_us,speedup``)."""
    lines = [line for line in Path(path).read_text().splitlines() if line and not line.startswith("#")]
    return [GroupedMeasurement(int(r["m"]), int(r["k"]), int(r["n"]), float(r["speedup"]), int(r["groups"]),
                               float(r["bf16_us"]) * 1e-6, float(r["mxfp8_us"]) * 1e-6) for r in csv.DictReader(lines)]


def forward_rig_speedup(m: int, k: int, n: int, gpu: GpuSpec, recipe: str) -> float:
    """The speedup torchao's inference roofline benchmark (``benchmarks/float8/float8_inference_roofline.py``)
    measures for ``recipe`` ("mxfp8" or "nvfp4"): ReLU -> Linear forward, the weight quantized beforehand; bf16 runs
    the ReLU (read and write the activation) and a bf16 GEMM, the quantized way the ReLU fused with the activation's
    quantize kernels and the recipe's GEMM (:func:`~fp8dist.plan.speed.model.gemm_seconds`)."""
    chosen = recipe_named(recipe)
    cal = gpu.calibration
    relu = max(4 * m * k / (gpu.memory_tbps * 1e12 * cal.memory_fraction), cal.kernel_floor_s)
    bf16 = relu + gemm_seconds(gpu, m, k, n, 2 * (m * k + n * k), 2 * m * n, "bf16")
    low = gemm_seconds(gpu, m, k, n, (chosen.operand_bytes + chosen.scale_bytes) * (m * k + n * k), 2 * m * n,
                       chosen.gemm)
    return bf16 / (low + sum(kernel_seconds(gpu, kernel, m * k) for kernel in _FORWARD_CASTS[recipe]))


def grouped_seconds(m: int, k: int, n: int, groups: int, gpu: GpuSpec,
                    recipe: str = "moe_mxfp8") -> tuple[float, float]:
    """The model's forward + backward times of a grouped GEMM, (bf16, low precision) in seconds: what torchao's
    grouped-GEMM autograd benchmark measures (the GEMMs and the casts, nothing around them)."""
    bf16, low, casts = linear_seconds(m, k, n, gpu, recipe_named(recipe), True, groups)
    return bf16, low + casts


def grouped_speedup(m: int, k: int, n: int, groups: int, gpu: GpuSpec, recipe: str = "moe_mxfp8") -> float:
    """The model's forward + backward speedup of a grouped GEMM (:func:`grouped_seconds`' ratio)."""
    bf16, low = grouped_seconds(m, k, n, groups, gpu, recipe)
    return bf16 / low


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
