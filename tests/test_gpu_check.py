"""benchmarks/gpu/check.sh, the prepared GPU check, on a CPU: ``--dry-run`` runs every part's plumbing on tiny
shapes (nothing timed) and writes its JSON and PNG; the budget skips a part that would not fit, saying so."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CHECK = REPO / "benchmarks" / "gpu" / "check.sh"


def _check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu" / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(CHECK), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow  # 49-71 s on the shared 2-core machine at load ~11 (2026-11-26): the bench part starts 2 processes
def test_dry_run_runs_every_part_and_claims_no_timing(tmp_path):
    done = _sh("--dry-run", env={"OUT": str(tmp_path)})  # $OUT is where the results go, as on the GPU machine
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "check.json").read_text())
    assert doc["dry_run"] is True and doc["target"] == "h100"
    parts = doc["parts"]
    assert list(parts) == ["pytest_gpu", "linear_shapes", "step_1b"]
    assert {p["status"] for p in parts.values()} == {"ran"}, parts
    assert doc["versions"]["torch"] == torch.__version__ and "cuda" in doc["versions"]
    assert parts["pytest_gpu"]["collected"] >= 10 and (tmp_path / "pytest.log").exists()
    rows = parts["linear_shapes"]["rows"]
    assert {r["recipe"] for r in rows} == {"tensorwise", "rowwise"} and len(rows) == 4
    assert all(r["measured"] is None and r["bf16_s"] is None for r in rows)  # nothing timed on a CPU
    assert all(0 < r["predicted_rig"] < 3 and 0 < r["predicted_linear"] < 3 for r in rows)
    step = parts["step_1b"]
    assert len(step["rows"]) == 2 and all(r["tokens_per_s"] is None for r in step["rows"])
    assert (tmp_path / step["bench_json"]).exists()
    assert (tmp_path / "check.png").stat().st_size > 10_000 and (tmp_path / "check.log").exists()
    assert "part step_1b: planned 150 s" in done.stdout


def test_without_a_gpu_and_without_dry_run_it_says_so_and_stops(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = _sh("--out", str(tmp_path))
    assert done.returncode == 3
    assert "sees no CUDA GPU" in done.stderr and "--dry-run" in done.stderr
    assert not (tmp_path / "check.json").exists()


def test_an_unknown_argument_names_the_choices():
    done = _sh("--dryrun")
    assert done.returncode == 2 and "'--dryrun'" in done.stderr and "--dry-run" in done.stderr


def test_a_part_that_would_not_fit_is_skipped_and_one_that_fails_is_recorded(tmp_path, capsys):
    check = _check_module()
    budget = check.Budget(started_at=0, total_s=0)  # long past: nothing fits
    budget.deadline = __import__("time").time() + check.PLANNED_S["step_1b"] + 1  # only the last part's share left
    doc = {"parts": {}}
    check.run_part("linear_shapes", budget, doc, lambda s: pytest.fail("should not run"), tmp_path)
    assert doc["parts"]["linear_shapes"]["status"].startswith("skipped: 1 s left")

    def broken(allotted):
        raise RuntimeError("out of memory")

    check.run_part("step_1b", budget, doc, broken, tmp_path)
    assert doc["parts"]["step_1b"]["status"] == "failed: RuntimeError: out of memory"
    assert json.loads((tmp_path / "check.json").read_text())["parts"]["step_1b"]["status"].startswith("failed")
    assert "part linear_shapes: planned 180 s" in capsys.readouterr().out


def test_the_agreement_summary_scores_predictions_against_measurements():
    check = _check_module()
    rows = [{"m": 1, "k": 1, "n": n, "recipe": "rowwise", "measured": meas, "predicted_rig": pred}
            for n, meas, pred in ((1, 1.2, 1.1), (2, 0.8, 1.05), (3, 0.7, 0.75))]
    found = check.agreement_by_recipe(rows)
    assert list(found) == ["rowwise"]
    assert (found["rowwise"]["right"], found["rowwise"]["converted_slower"]) == (2, 1)


def test_the_step_prediction_is_read_from_fp8dist_predict_step_where_it_exists(monkeypatch):
    import fp8dist
    from fp8dist.plan.gpus import gpu_by_key

    check = _check_module()
    h100, fp8, single = gpu_by_key("h100"), check.default_fp8(), check._single_strategy()
    monkeypatch.delattr(fp8dist, "predict_step", raising=False)
    assert check.predicted_step("1b", 4, 2048, h100, fp8, "tensorwise", True) is None
    seen = {}

    class Record:
        speedup, tokens_per_s, bf16_tokens_per_s, mfu = 1.2, 12_000.0, 10_000.0, 0.4

    def predict(config, **kwargs):
        seen.update(kwargs, hidden=config.hidden_size)
        return Record()

    monkeypatch.setattr(fp8dist, "predict_step", predict, raising=False)
    figures = check.predicted_step("1b", 4, 2048, h100, fp8, "tensorwise", True)
    assert figures == {"speedup": 1.2, "tokens_per_s": 12_000.0, "bf16_tokens_per_s": 10_000.0, "mfu": 0.4}
    assert seen == dict(target="h100", world_size=1, micro_batch_size=4, seq_len=2048, fp8=fp8,
                        recipe="tensorwise", compile=True, activation_checkpointing="none", strategy=single,
                        hidden=2048)
    monkeypatch.setattr(fp8dist, "predict_step", lambda config, **kw: 1 / 0, raising=False)
    assert check.predicted_step("1b", 4, 2048, h100, fp8, None, True) == {
        "error": "ZeroDivisionError: division by zero"}


def test_the_gpu_run_times_30_shapes_the_presets_and_the_gpu_tests_among_them():
    """The shapes a GPU run times: the 1b and 3b presets' Linears at the bench's tokens, the published table's rows
    and every shape of the GPU speed test, which the pytest part deselects (by a node id that must exist)."""
    from test_fp8_gpu import SPEED_SHAPES

    check = _check_module()
    shapes = [shape for shape, _ in check.linear.shapes(dry_run=False)]
    assert len(shapes) == len(set(shapes)) == 30
    assert {(8192, 2048, 5632), (8192, 5632, 2048), (8192, 3072, 8192), (8192, 8192, 3072)} <= set(shapes)
    assert set(SPEED_SHAPES) <= set(shapes)
    path, name = check.SPEED_TEST.split("::")
    assert f"def {name}(" in (REPO / path).read_text()


@pytest.mark.parametrize("flag", ["--out", "--wheels", "--budget-s"])
def test_a_flag_without_its_value_is_a_usage_error(tmp_path, flag):
    for argv in ([flag], [flag, "--dry-run"]):
        done = _sh(*argv, env={"OUT": str(tmp_path)})
        assert done.returncode == 2, (argv, done.stderr)
        assert f"check.sh: {flag} needs a value ({flag} " in done.stderr and "unbound variable" not in done.stderr
        assert "--dry-run, --out DIR" in done.stderr


def test_a_dry_run_without_out_writes_a_temporary_folder_not_the_work_tree(tmp_path):
    """Without --out or $OUT a dry run used to write benchmarks/gpu/results/<date>_cpu-dry-run/ into the work tree;
    it writes a new temporary folder and says where. --budget-s 0: every part skipped, the plumbing of the folder
    alone."""
    results = REPO / "benchmarks" / "gpu" / "results"
    before = sorted(results.rglob("*")) if results.exists() else None
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(["bash", str(CHECK), "--dry-run", "--budget-s", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**env, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (written,) = tmp_path.glob("fp8dist-gpu-check-*")
    assert f"results in {written}/" in done.stdout
    doc = json.loads((written / "check.json").read_text())
    assert doc["dry_run"] is True and all(p["status"].startswith("skipped") for p in doc["parts"].values())
    assert (sorted(results.rglob("*")) if results.exists() else None) == before
