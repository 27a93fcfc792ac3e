"""Score the speed model (fp8dist's H100 constants, as shipped) and torchao's own rules against torchao's published
H100 rowwise table; write results.json beside this file and print the README's table.

    PYTHONPATH=. python benchmarks/speed_model/report.py

Rules compared, each converting a shape or not (a shape converts where the figure is >= the margin):
- fp8dist's speed model (the LayerNorm -> Linear -> Sigmoid quantity the table measures), at several margins;
- torchao's static rule for rowwise (torchao.float8.float8_linear_utils._auto_filter_for_rowwise, called on a
  meta nn.Linear(K, N)): it looks at K and N only;
- torchao's roofline (torchao/testing/training/roofline_utils.py, H100 figures), with and without its fusion
  modelling (the benchmark that produced the table models fusion);
- converting everything (what fp8dist did before), and a perfect oracle."""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
from pathlib import Path

import torch
import torchao

from agreement import FIT_ROWS, HELD_OUT_ROWS, agreement, read_measurements, rig_speedup

import fp8dist
from fp8dist.runtime.gpus import H100_CALIBRATION, gpu_by_key

HERE = Path(__file__).parent
TABLE = HERE.parent.parent / "tests" / "data" / "torchao_fp8_rowwise_h100.csv"
MARGINS = (0.97, 1.0, 1.02, 1.05)
SUBSETS = (("fit rows (M 1024, 4096, 16384)", FIT_ROWS), ("held-out rows (M 2048, 8192, 32768)", HELD_OUT_ROWS),
           ("all 216", FIT_ROWS + HELD_OUT_ROWS))


def torchao_rule():
    from torchao.float8.float8_linear_utils import _auto_filter_for_rowwise

    def predict(r):
        return float(_auto_filter_for_rowwise(torch.nn.Linear(r.k, r.n, bias=False, device="meta"), "x", []))
    return predict


def torchao_roofline(fusion: bool):
    import sympy
    from torchao.testing.training.roofline_utils import get_float8_mem_sympy, get_gemm_time_sympy

    m, k, n = sympy.symbols("M K N")
    bf16 = get_gemm_time_sympy(m, k, n, torch.bfloat16, None, None, "NVIDIA H100")
    fp8 = (get_gemm_time_sympy(m, k, n, torch.float8_e4m3fn, "rowwise", None, "NVIDIA H100")
           + get_float8_mem_sympy(m, k, n, "rowwise", None, fusion, "NVIDIA H100"))
    ratio = sympy.lambdify((m, k, n), bf16 / fp8)
    return lambda r: float(ratio(r.m, r.k, r.n))


def main() -> None:
    measured = read_measurements(TABLE)
    h100 = gpu_by_key(H100_CALIBRATION.measured_on)
    model = lambda r: rig_speedup(r.m, r.k, r.n, h100)  # noqa: E731
    rules = {f"fp8dist speed model, margin {m}": (model, m, True) for m in MARGINS}
    rules |= {"torchao static rule (_auto_filter_for_rowwise)": (torchao_rule(), 0.5, False),
              "torchao roofline, fusion modelled": (torchao_roofline(True), 1.0, True),
              "torchao roofline, no fusion modelled": (torchao_roofline(False), 1.0, True),
              "convert every shape": (lambda r: 2.0, 1.0, False),
              "perfect (measured >= 1)": (lambda r: r.speedup, 1.0, False)}
    results = {name: {subset: dataclasses.asdict(agreement([r for r in measured if r.m in ms], f, margin, figs))
                      for subset, ms in SUBSETS} for name, (f, margin, figs) in rules.items()}
    wrong = [dataclasses.asdict(r) | {"predicted": round(model(r), 3)} for r in measured
             if (model(r) >= 1) != (r.speedup >= 1)]
    out = {"date": datetime.date.today().isoformat(), "table": str(TABLE.relative_to(HERE.parent.parent)),
           "versions": {"fp8dist": fp8dist.__version__, "torch": torch.__version__, "torchao": torchao.__version__,
                        "python": platform.python_version()},
           "h100_calibration": dataclasses.asdict(h100.calibration), "results": results,
           "model_wrong_at_margin_1": wrong}
    (HERE / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    print("| rule | fit rows right | held-out right (slower) | all right | converted but slower | geomean chosen "
          "| median rel. error (held-out / all) |\n|---|---|---|---|---|---|---|")
    for name, by in results.items():
        fitted, held, every = (by[subset] for subset, _ in SUBSETS)
        error = ("" if every["median_relative_error"] is None else
                 f"{held['median_relative_error']:.1%} / {every['median_relative_error']:.1%}")
        print(f"| {name} | {fitted['right']}/108 | {held['right']}/108 ({held['converted_slower']}) "
              f"| {every['right']}/216 | {every['converted_slower']} | {every['geomean_chosen']:.4f} | {error} |")


if __name__ == "__main__":
    main()
