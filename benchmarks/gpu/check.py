"""The prepared GPU check (issues 44, 52), run by check.sh: each part within its share of a 6-minute budget, every
figure written to one folder as check.json + check.png (the step part's own JSON in step.json), with the device's
clocks and power limit and the commit. benchmarks/gpu/README.md gives the parts and their planned seconds.
``--dry-run``: the plumbing on a CPU, tiny shapes, no figure timed (the JSON's dry_run is true and its measured
figures are null)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "speed_model")]  # linear.py beside this file, agreement.py
import linear  # noqa: E402
from agreement import Measurement, agreement  # noqa: E402
from preflight import commit, device_clocks  # noqa: E402

from fp8dist.bench.cell import variants_of  # noqa: E402
from fp8dist.bench.results import device_record, versions as package_versions  # noqa: E402
from fp8dist.runtime.gpus import GpuSpec, gpu_by_key  # noqa: E402
from fp8dist.runtime.hardware import find_gpu, hardware_of  # noqa: E402
from fp8dist.train.job import default_fp8  # noqa: E402

BUDGET_S = 360
"""6 minutes on one GPU, check.sh's set-up included: rerun within a 15-minute device budget."""
PLANNED_S = {"pytest_gpu": 90, "linear_shapes": 75, "step_1b": 170}
"""Each part's planned seconds on one H100 (README.md says why). An overrun of the set-up comes out of the first."""
SETUP_S = 25
"""check.sh's set-up (torch probe, wheels, preflight, editable install) and the versions."""
STEP_CELL_S = 55
"""A guess at one step cell of the 1b preset, compiled (build, per-block compile, 3 + 10 + 2 steps): the rowwise
cell runs only where the part's allotment holds a third."""
DRY_TARGET = "h100"
"""The GPU whose predictions the dry run computes (its plumbing; nothing is compared)."""
SPEED_TEST = "tests/test_fp8_gpu.py::test_speed_model_predicts_the_measured_linear_speedup_on_this_gpu"
"""Deselected from the pytest part: the Linear part times the same rig on its shapes (linear.EXTRA)."""


class Budget:
    """The parts' deadlines: a part may use what earlier parts left over, never what later parts are planned."""

    def __init__(self, started_at: float, total_s: float):
        self.deadline = started_at + total_s

    def allot(self, part: str) -> float:
        later = list(PLANNED_S)[list(PLANNED_S).index(part) + 1:]
        return self.deadline - time.time() - sum(PLANNED_S[p] for p in later)


def run_part(name: str, budget: Budget, doc: dict[str, Any], part: Callable[[float], dict[str, Any]],
             out: Path) -> None:
    """Run one part within its allotment, or skip it saying so; print planned and actual seconds. A part that
    fails is recorded with its error and the next one runs: GPU minutes are scarce, and check.json is rewritten
    after every part so that a check stopped from outside keeps what it measured."""
    allotted = budget.allot(name)
    record: dict[str, Any] = {"planned_s": PLANNED_S[name], "allotted_s": round(allotted, 1)}
    if allotted < PLANNED_S[name] / 2:
        record["status"] = f"skipped: {allotted:.0f} s left for it, under half its planned {PLANNED_S[name]} s"
    else:
        t0 = time.time()
        try:
            record.update(part(allotted))
        except Exception as error:  # noqa: BLE001 (any failure: said, traceback printed, the next part runs)
            import traceback

            traceback.print_exc()
            record["status"] = f"failed: {type(error).__name__}: {error}"
        record["actual_s"] = round(time.time() - t0, 1)
        record.setdefault("status", "ran")
    doc["parts"][name] = record
    print(f"part {name}: planned {PLANNED_S[name]} s, allotted {allotted:.0f} s, "
          f"took {record.get('actual_s', 0):.0f} s ({record['status']})", flush=True)
    (out / "check.json").write_text(json.dumps(doc, indent=1) + "\n")


def versions(device: torch.device) -> dict[str, Any]:
    """Every library a run may use (None where absent: Transformer Engine, say), CUDA's, and the device."""
    found = {**package_versions(), "cuda": torch.version.cuda}
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items() if v))
    return {"versions": found, "device_details": device_record(device.type, 1)}


def gpu_test_files() -> list[str]:
    """The test files holding ``gpu``-marked tests (a text scan: collecting the whole suite takes ~20 s)."""
    return sorted(str(p.relative_to(linear.REPO)) for p in (linear.REPO / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


def run_group(cmd: list[str], timeout: float, **kwargs: Any) -> int | None:
    """Run ``cmd`` in a session of its own; at ``timeout`` end it and every process it started (pytest's ranks,
    the bench's workers hold the GPU) and return None."""
    process = subprocess.Popen(cmd, cwd=linear.REPO, start_new_session=True, **kwargs)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None


def pytest_part(allotted: float, out: Path, dry_run: bool) -> dict[str, Any]:
    """``pytest -m gpu`` on the files that hold such tests, its log in pytest.log; stopped at the allotment."""
    files = gpu_test_files()
    mode = ["--collect-only", "-q"] if dry_run else ["-v", "-rs", f"--timeout={int(allotted)}",
                                                      "--deselect", SPEED_TEST]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-p", "no:cacheprovider", *mode, *files]
    log = out / "pytest.log"
    with log.open("w") as sink:
        code = run_group(cmd, allotted, stdout=sink, stderr=subprocess.STDOUT)
    lines = [line for line in log.read_text().splitlines() if "::" in line]
    counts = {word: sum(f" {word}" in line for line in lines) for word in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
    record: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": code, "log": log.name}
    if dry_run:
        record["collected"] = len(lines)
    else:
        record.update(results=counts, deselected=[SPEED_TEST])
    if code is None:
        record["status"] = f"stopped at its allotment ({allotted:.0f} s); pytest.log shows how far it got"
    print(f"pytest -m gpu: {record.get('results', record.get('collected'))}, exit {code}")
    return record


def linear_part(allotted: float, device: torch.device, spec: GpuSpec | None, dry_run: bool) -> dict[str, Any]:
    """Every shape of linear.shapes while the allotment holds another (the last one's time as the estimate), and
    per recipe how the model's figures agree with the measurements."""
    if (missing := linear.missing_reason()) is not None:
        return {"status": f"skipped: {missing}"}
    end, last, rows, skipped = time.time() + allotted, 0.0, [], []
    for shape, where in linear.shapes(dry_run):
        if time.time() + last > end:
            skipped.append(list(shape))
            continue
        t0 = time.time()
        rows += [{**row, "source": where} for row in linear.time_shape(shape, device, spec, dry_run)]
        last = time.time() - t0  # the first shape's includes compile warm-up: the last one estimates the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for row in rows[-len(linear.RECIPES):]:
            print(f"  {shape} {row['recipe']:10s} measured {row['measured']}  predicted {row['predicted_rig']}"
                  f"  published {row['published_h100']}", flush=True)
    record: dict[str, Any] = {"rows": rows, "skipped_shapes": skipped, "agreement": agreement_by_recipe(rows)}
    if skipped:
        record["status"] = f"ran {len(rows) // len(linear.RECIPES)} shapes; {len(skipped)} skipped at the budget"
    return record


def agreement_by_recipe(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per recipe, agreement.agreement of the predicted rig speedups with the measured ones (margin 1.0)."""
    found = {}
    for recipe in linear.RECIPES:
        mine = [r for r in rows if r["recipe"] == recipe and r["measured"] and r["predicted_rig"]]
        if mine:
            predicted = {(r["m"], r["k"], r["n"]): r["predicted_rig"] for r in mine}
            found[recipe] = vars(agreement([Measurement(r["m"], r["k"], r["n"], r["measured"]) for r in mine],
                                           lambda row: predicted[row.m, row.k, row.n]))
    return found


def step_part(allotted: float, out: Path, spec: GpuSpec | None, dry_run: bool) -> dict[str, Any]:
    """step.py in a process of its own: the 1b preset on one GPU, bf16 and FP8 (tensorwise; rowwise where the
    allotment holds a third cell), each cell's median step and profiler split beside fp8dist.predict_step's parts."""
    fp8 = default_fp8()
    if fp8 is None:
        return {"status": "skipped: no FP8 backend runs here (fp8dist train's default needs its package and an "
                          "sm_89+ GPU; carry torchao's wheel in .whl/, see README.md)"}
    recipes = [r for r in linear.RECIPES if r in variants_of(fp8)]
    recipes = recipes[:1] if dry_run or allotted < 3 * STEP_CELL_S else recipes
    found = out / "step.json"
    cmd = [sys.executable, str(HERE / "step.py"), "--out", str(found), "--fp8", fp8, "--recipes", ",".join(recipes),
           *(["--target", spec.key] if spec else []), *(["--dry-run"] if dry_run else [])]
    code = run_group(cmd, allotted)
    record: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": code, "step_json": found.name}
    rows = json.loads(found.read_text())["rows"] if found.exists() else []
    if dry_run:  # a CPU's timing is never a GPU's: the plumbing only
        rows = [{**row, "measured_step_s": None, "tokens_per_s": None, "times": None, "kernels_s": None,
                 "unsplit_s": None, "parts": {k: {**v, "measured_s": None} for k, v in row["parts"].items()}}
                for row in rows]
    record["rows"] = rows
    if code is None:
        record["status"] = f"stopped at its allotment ({allotted:.0f} s) after {len(rows)} cells"
    elif code != 0:
        record["status"] = f"failed: step.py exited {code} after {len(rows)} cells (output above)"
    return record


def _predicted_tokens(row: dict[str, Any], tokens: int) -> float | None:
    """The predicted tokens/s of a step row (``tokens`` per step)."""
    return tokens / row["predicted_step_s"] if row.get("predicted_step_s") else None


def plot(doc: dict[str, Any], path: Path) -> str | None:
    """check.png: per shape, measured and predicted FP8 speedups; the step's tokens/s. None, or why not drawn."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: JSON only"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (shapes_ax, step_ax) = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw={"width_ratios": [3, 1]})
    rows = doc["parts"].get("linear_shapes", {}).get("rows", [])
    labels = [f"{r['m']}x{r['k']}x{r['n']}" for r in rows if r["recipe"] == linear.RECIPES[0]]
    for offset, recipe in enumerate(linear.RECIPES):
        mine = [r for r in rows if r["recipe"] == recipe]
        x = [i + 0.2 * offset for i in range(len(mine))]
        shapes_ax.scatter(x, [r["predicted_rig"] for r in mine], marker="o", facecolors="none",
                          edgecolors=f"C{offset}", label=f"{recipe} predicted")
        shapes_ax.scatter(x, [r["measured"] for r in mine], marker="x", color=f"C{offset}",
                          label=f"{recipe} measured")
    shapes_ax.axhline(1, color="grey", lw=0.5)
    shapes_ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
    shapes_ax.set_ylabel("FP8 / bf16 speedup, LayerNorm-Linear-Sigmoid fwd+bwd")
    shapes_ax.legend(fontsize=7, loc="upper left")
    steps = doc["parts"].get("step_1b", {}).get("rows", [])
    step_ax.bar([r["cell"] for r in steps], [r["tokens_per_s"] or 0 for r in steps], label="measured")
    tokens = doc.get("step_tokens") or 0
    predicted = [(r["cell"], _predicted_tokens(r, tokens)) for r in steps]
    if any(p for _, p in predicted):
        step_ax.scatter(*zip(*[(c, p) for c, p in predicted if p]), color="k", marker="_", s=400,
                        label="fp8dist.predict_step")
    step_ax.legend(fontsize=7, loc="lower left")
    step_ax.set_ylabel("tokens/s, one GPU")
    step_ax.tick_params(axis="x", rotation=90, labelsize=6)
    title = f"{doc['device']} {doc['date']}" + (" - DRY RUN: nothing timed" if doc["dry_run"] else "")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def json_or_none(path: Path) -> Any:
    """``path``'s JSON, or None where it is absent."""
    return json.loads(path.read_text()) if path.exists() else None


def _out_dir(given: str | None, device_name: str, dry_run: bool) -> Path:
    """``--out``; else a GPU run's folder to commit, benchmarks/gpu/results/<date>_<device>/; else (a dry run: nulls,
    nothing to keep) a new temporary folder, so a dry run never writes into the work tree."""
    if given:
        return Path(given)
    if dry_run:
        return Path(tempfile.mkdtemp(prefix="fp8dist-gpu-check-"))
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return linear.REPO / "benchmarks" / "gpu" / "results" / f"{day}_{'-'.join(device_name.lower().split())}"


def _target(device: torch.device, dry_run: bool) -> tuple[GpuSpec | None, str]:
    """The GPU record the predictions use, and why none where there is none."""
    if dry_run:
        return gpu_by_key(DRY_TARGET), f"dry run: {DRY_TARGET}'s figures, compared with nothing"
    lookup = find_gpu(hardware_of(device))
    return lookup.spec, lookup.reason or f"this GPU: {lookup.spec.label}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="plumbing on a CPU, nothing timed")
    parser.add_argument("--out", help="results folder (default: benchmarks/gpu/results/<date>_<device>/; with "
                                      "--dry-run a new temporary folder)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"seconds in all (default {BUDGET_S})")
    parser.add_argument("--started-at", type=float, help="check.sh's start (epoch seconds): its set-up counts")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("check.py: no CUDA GPU visible to this torch; run on a GPU node, or pass --dry-run.", file=sys.stderr)
        return 3
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    out = _out_dir(args.out, name, args.dry_run)
    out.mkdir(parents=True, exist_ok=True)
    print(f"results in {out}/", flush=True)
    started = args.started_at or time.time()
    # a dry run on a loaded CI machine runs every part: only the plumbing is checked, not the GPU plan
    budget = Budget(started, args.budget_s * (10 if args.dry_run else 1))
    spec, target_note = _target(device, args.dry_run)
    doc: dict[str, Any] = {
        "fp8dist_gpu_check": 1, "dry_run": args.dry_run, "device": name, "target": spec.key if spec else None,
        "target_note": target_note, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": args.budget_s, **versions(device), "clocks": device_clocks(), "commit": commit(),
        "step_tokens": None, "setup_s": round(time.time() - started, 1), "parts": {}}
    print(f"set-up and versions: planned {SETUP_S} s, took {doc['setup_s']:.0f} s", flush=True)
    run_part("pytest_gpu", budget, doc, lambda s: pytest_part(s, out, args.dry_run), out)
    run_part("linear_shapes", budget, doc, lambda s: linear_part(s, device, spec, args.dry_run), out)
    run_part("step_1b", budget, doc, lambda s: step_part(s, out, spec, args.dry_run), out)
    if (step := json_or_none(out / "step.json")) is not None:
        doc["step_tokens"] = step["job"]["batch"] * step["job"]["seq"]
    doc["total_s"] = round(time.time() - started, 1)
    try:
        doc["plot"] = plot(doc, out / "check.png") or "check.png"
    except Exception as error:  # noqa: BLE001 (the figures are in the JSON; a drawing failure must not hide them)
        doc["plot"] = f"failed: {type(error).__name__}: {error}"
    (out / "check.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"total {doc['total_s']:.0f} s of {args.budget_s:.0f}; wrote {out / 'check.json'} and {doc['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
