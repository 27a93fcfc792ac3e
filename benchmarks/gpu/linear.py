"""The GPU check's Linear part: bf16 vs FP8 forward + backward of the quantity torchao's published H100 table
measures (LayerNorm -> Linear -> Sigmoid, both compiled), per shape and recipe, beside the speed model's figure for
the same quantity (``agreement.rig_speedup``), its figure for the Linear alone (``predict_linear``) and, where the
shape is in the table, the published rowwise measurement. Run by check.py; the FP8 rig is torchao's own conversion,
since that is what the table and the model's calibration measure (fp8dist's wiring is timed by the step part)."""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speed_model"))  # agreement.py, run as a script or not
from agreement import read_measurements, rig_speedup  # noqa: E402

from fp8dist.bench.runner import DEFAULTS  # noqa: E402
from fp8dist.runtime.gpus import GpuSpec  # noqa: E402
from fp8dist.plan.speed import predict_linear  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "tests" / "data" / "torchao_fp8_rowwise_h100.csv"
RECIPES = ("tensorwise", "rowwise")
"""The recipes timed: the published table's (rowwise) and the one the issue's end-to-end runs gain most with."""
TABLE_KN = (2048, 4096, 8192, 16384)
"""K = N of the table's rows timed; M below, held-out rows of the fit first (agreement.HELD_OUT_ROWS)."""
TABLE_M = (2048, 8192, 1024, 4096, 16384)
EXTRA = ((16384, 4096, 16384),)
"""tests/test_fp8_gpu.py's SPEED_SHAPES not among the above (that test is deselected from the pytest part)."""
PRESETS = ("1b", "3b")
DRY_SHAPES = ((64, 64, 64), (32, 64, 128))
"""The dry run's tiny shapes: plumbing only."""
WARMUP, ITERS = 3, 20


def preset_shapes(size: str, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of every distinct Linear of a Llama preset at ``tokens`` per micro-batch (built on meta)."""
    from transformers import LlamaForCausalLM

    from fp8dist.train.models import llama_config

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(size))
    found = {(tokens, m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)}
    return sorted(found)


def shapes(dry_run: bool) -> list[tuple[tuple[int, int, int], str]]:
    """Every shape the part times with where it comes from, in the order they run (cut by the budget from the end):
    the presets' (the step part's model), then the table's held-out and fitted rows."""
    if dry_run:
        return [(s, "dry run") for s in DRY_SHAPES]
    batch, seq = DEFAULTS["cuda"][2:]
    rows = [(s, f"{size} preset") for size in PRESETS for s in preset_shapes(size, batch * seq)]
    rows += [((m, kn, kn), "published table") for m in TABLE_M for kn in TABLE_KN]
    rows += [(s, "tests/test_fp8_gpu.py") for s in EXTRA]
    seen: set[tuple[int, int, int]] = set()
    return [(s, where) for s, where in rows if not (s in seen or seen.add(s))]


def missing_reason() -> str | None:
    """Why the part cannot run here (the FP8 rig is torchao's), or None."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return ("torchao is not installed: a GPU node without network takes its wheel from .whl/ (check.sh "
                "--wheels; benchmarks/gpu/README.md)")
    return None


def _rig(k: int, n: int, device: torch.device) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(k, elementwise_affine=False), nn.Linear(k, n, bias=False),
                         nn.Sigmoid()).to(device, torch.bfloat16)


def _fp8_rig(rig: nn.Module, recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(copy.deepcopy(rig), config=Float8LinearConfig.from_recipe_name(recipe))


def _fwd_bwd_s(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, iters: int) -> float:
    """Median seconds of one forward + backward after warm-up (compilation happens there): CUDA events on a GPU,
    the wall clock on a CPU (the dry run, whose figure is never reported)."""
    for _ in range(WARMUP):
        model(x).backward(grad)
    times = []
    for _ in range(iters):
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(x).backward(grad)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            model(x).backward(grad)
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _timed(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, compiled: bool, iters: int) -> float:
    torch._dynamo.reset()  # a fresh compile per rig: no recompile limit, no cache shared across shapes
    return _fwd_bwd_s(torch.compile(model) if compiled else model, x, grad, iters)


def measured_rig_speedup(shape: tuple[int, int, int], recipe: str, device: torch.device) -> float:
    """What torchao's table measures, here: the rig's compiled forward + backward time in bf16 over FP8's
    (``recipe``), median of ITERS after WARMUP; tests/test_fp8_gpu.py's speed test reads it too."""
    m, k, n = shape
    torch.manual_seed(0)
    rig = _rig(k, n, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    return _timed(rig, x, grad, True, ITERS) / _timed(_fp8_rig(rig, recipe), x, grad, True, ITERS)


def predictions(m: int, k: int, n: int, spec: GpuSpec | None, recipe: str) -> dict[str, Any]:
    """The speed model's figures for one shape: the table's quantity and the Linear alone."""
    if spec is None:
        return {"predicted_rig": None, "predicted_linear": None}
    return {"predicted_rig": round(rig_speedup(m, k, n, spec, recipe), 4),
            "predicted_linear": round(predict_linear(m, k, n, target=spec, recipe=recipe).speedup, 4)}


def time_shape(shape: tuple[int, int, int], device: torch.device, spec: GpuSpec | None,
               dry_run: bool) -> list[dict[str, Any]]:
    """One row per recipe: measured bf16 and FP8 seconds and their ratio (None in a dry run), predictions beside."""
    m, k, n = shape
    torch.manual_seed(0)
    rig = _rig(k, n, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    compiled, iters = not dry_run, 1 if dry_run else ITERS
    bf16_s = _timed(rig, x, grad, compiled, iters)
    published = {(r.m, r.k, r.n): r.speedup for r in read_measurements(TABLE)}
    rows = []
    for recipe in RECIPES:
        fp8_s = _timed(_fp8_rig(rig, recipe), x, grad, compiled, iters)
        measured = None if dry_run else {"bf16_s": bf16_s, "fp8_s": fp8_s, "measured": round(bf16_s / fp8_s, 4)}
        rows.append({"m": m, "k": k, "n": n, "recipe": recipe, "compiled": compiled,
                     **(measured or {"bf16_s": None, "fp8_s": None, "measured": None}),
                     **predictions(m, k, n, spec, recipe),
                     "published_h100": published.get(shape) if recipe == "rowwise" else None})
    return rows
