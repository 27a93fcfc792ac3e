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


def _check_module(name: str = "check"):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", REPO / "benchmarks" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(CHECK), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow  # 49-71 s on the shared 2-core machine at load ~11 (2026-11-26); the step part's process since
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
    assert [r["cell"] for r in step["rows"]] == ["bf16", "torchao tensorwise"], step
    for row in step["rows"]:  # every predict_step part beside a measured one (null: a CPU's is no GPU's)
        assert list(row["parts"]) == ["gemm", "cast", "attention", "collective", "optimizer", "memory"]
        assert row["tokens_per_s"] is None and all(p["measured_s"] is None for p in row["parts"].values())
        assert row["predicted_step_s"] > 0 and row["parts"]["gemm"]["predicted_s"] > 0
    assert (tmp_path / step["step_json"]).exists()
    assert len(doc["commit"]["commit"]) == 40 and "clocks" in doc  # no nvidia-smi here: its error, said
    assert "preflight: torch" in done.stdout and "in range" in done.stdout
    assert (tmp_path / "check.png").stat().st_size > 10_000 and (tmp_path / "check.log").exists()
    assert "part step_1b: planned 170 s" in done.stdout


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
    assert "part linear_shapes: planned 75 s" in capsys.readouterr().out


def test_the_agreement_summary_scores_predictions_against_measurements():
    check = _check_module()
    rows = [{"m": 1, "k": 1, "n": n, "recipe": "rowwise", "measured": meas, "predicted_rig": pred}
            for n, meas, pred in ((1, 1.2, 1.1), (2, 0.8, 1.05), (3, 0.7, 0.75))]
    found = check.agreement_by_recipe(rows)
    assert list(found) == ["rowwise"]
    assert (found["rowwise"]["right"], found["rowwise"]["converted_slower"]) == (2, 1)


def test_kernel_names_are_sorted_into_the_parts_the_step_model_predicts():
    classify = _check_module("split").classify
    names = {  # CUDA kernels of bf16 and torchao FP8 steps on an H100 (names as torch.profiler gives them)
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": "gemm",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNN": "gemm",
        "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_cluster1x2x1": "gemm",  # FP8, not a cast
        "triton_tem_fused_mm_0": "gemm",
        "triton_red_fused_abs_max_0": "cast", "triton_poi_fused__to_copy_clamp_div_mul_reciprocal_1": "cast",
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(Flash_fwd_params)": "attention",
        "cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnBwdSm90>>": "attention",
        "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "collective",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "collective",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_2": "memory",  # RMSNorm
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "memory",
        "aten::mm": "gemm", "aten::_scaled_dot_product_flash_attention_for_cpu": "attention", "aten::amax": "cast",
    }
    assert {name: classify(name) for name in names} == names


def test_a_profiled_step_is_written_beside_predict_step_s_parts():
    """A tiny CPU profile (a GEMM, attention, an FP8 amax, an AdamW step) through the same split and writer as a
    GPU step: each kind's measured seconds beside the predicted part it is compared with."""
    from fp8dist import predict_step
    from fp8dist.train.models import llama_config

    split, step = _check_module("split"), _check_module("step")
    x, weight = torch.randn(64, 64, requires_grad=True), torch.nn.Parameter(torch.randn(64, 64))
    optimizer = torch.optim.AdamW([weight])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            q = (x @ weight).view(1, 1, 64, 64)
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
            out.sum().backward()
            optimizer.step()
            x.detach().abs().amax()
    measured = split.split(prof, steps=2, device="cpu")
    assert all(measured[kind] > 0 for kind in ("gemm", "attention", "cast", "optimizer")), measured
    predicted, why = step.predicted_parts(step.GPU_JOB, "h100", "torchao", "tensorwise", True)
    parts = predict_step(llama_config("1b", max_seq_len=2048), target="h100", world_size=1, micro_batch_size=4,
                         seq_len=2048, fp8="torchao", recipe="tensorwise", compile=True,
                         activation_checkpointing="none", strategy="none").fp8
    assert why == "" and predicted == {f: getattr(parts, f) for f in predicted}
    row = split.step_row("torchao tensorwise", 0.5, measured, predicted)
    assert row["parts"]["gemm"] == {"measured_s": round(measured["gemm"], 6), "predicted_s": round(parts.gemm_s, 6),
                                    "predicted_from": ["gemm_s"]}
    assert row["parts"]["memory"]["predicted_s"] == round(parts.memory_s + parts.recompute_s, 6)
    assert row["parts"]["cast"]["predicted_s"] is None  # the model counts casts in memory_s
    assert row["predicted_step_s"] == round(parts.step_s, 6)
    assert row["unsplit_s"] == round(0.5 - sum(measured.values()), 6)
    with pytest.raises(ValueError, match="steps=0 must be at least 1"):
        split.split(prof, steps=0, device="cpu")


def test_the_preflight_stops_on_a_version_out_of_range_and_names_the_way_out():
    preflight = _check_module("preflight")
    ranges = preflight.allowed_ranges()
    assert set(ranges) == {"torch", "transformers", "torchao"}
    found = {"torch": "2.10.0+cu128", "transformers": "5.23.0", "torchao": None}
    problems, notes = preflight.version_problems(ranges, found.get, pins={"transformers": "5.22.0"})
    assert problems == [
        "torch 2.10.0+cu128 is outside the range fp8dist allows (torch>=2.11, pyproject.toml): its figures would not "
        "be fp8dist's; use a torch in range (PYTHON=..., or a wheel in .whl/ for torchao)",
        "torchao is not installed; fp8dist needs torchao>=0.18: put its wheel in .whl/ (benchmarks/gpu/README.md "
        "says how to fetch it on a connected machine)"]
    assert notes == ["transformers 5.23.0: in range, not constraints.txt's tested 5.22.0"]
    assert preflight.version_problems(ranges, {"torch": "2.13.0+cu130", "transformers": "5.0.0",
                                               "torchao": "0.18.0"}.get) == ([], [])
    assert preflight.constraint_pins()["torch"] == torch.__version__.split("+")[0]


def test_the_device_s_clocks_and_power_limit_are_read_from_nvidia_smi():
    preflight = _check_module("preflight")
    line = "NVIDIA H100 80GB HBM3, 1980, 1980, 2619, 2619, 700.00, 700.00, 700.00, 700.00, 34, 570.86.15"
    assert preflight.parse_smi(line) == {
        "name": "NVIDIA H100 80GB HBM3", "clocks.sm": 1980.0, "clocks.max.sm": 1980.0, "clocks.mem": 2619.0,
        "clocks.max.mem": 2619.0, "power.limit": 700.0, "power.default_limit": 700.0, "power.max_limit": 700.0,
        "enforced.power.limit": 700.0, "temperature.gpu": 34.0, "driver_version": "570.86.15"}
    assert preflight.parse_smi(line.replace("34", "[N/A]"))["temperature.gpu"] is None

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    assert preflight.device_clocks(missing) == {"error": "nvidia-smi: FileNotFoundError: nvidia-smi"}
