"""Ray Train on a local Ray cluster of 2 CPU workers: a model from ``wrap_model`` trains inside ``TorchTrainer``'s
training function with the same losses, per rank, as the same loop on 2 gloo ranks started without Ray (the dist
harness: the user's own process group, as under torchrun); checkpoints go through ``ray.train.report`` and a
worker group restarted after a failure resumes from ``ray.train.get_checkpoint()`` exactly. (The plain path, no
mesh and no checkpoints, is ``fp8dist train --launcher ray``'s test below, whose losses equal the same job's on the
harness's ranks; a test of its own here cost one more Ray job, ~42 s of CI.)"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import ROOT, run
from dist_harness import run_ranks
from helpers import BATCH, SEQ

from fp8dist import wrap_model
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

STEPS = 4
FAIL_AFTER = 2  # the first attempt fails once the checkpoint of this step is reported
NO_RAY = "Ray Train is not installed: pip install 'fp8dist[ray]'"


def _train(rank: int, world: int, out: Path | None, *, checkpoints: bool = False, fail_after: int | None = None,
           mesh: bool = False) -> dict[int, float]:
    """The loop every test runs: a tiny Llama, fsdp + torchao, AdamW, fp8dist's byte batches; {step: loss}. With
    ``checkpoints``, each step goes through Ray (report, and resume at the start); each loss is also appended to
    ``out/rank{rank}.jsonl`` as it is made, so that what a failed attempt trained is on disk."""
    torch.set_num_threads(1)  # as the dist harness's ranks: the same kernels, the same bits
    given = {}
    if mesh:  # the user's own mesh over the group Ray started
        from torch.distributed.device_mesh import init_device_mesh

        given["mesh"] = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="torchao", **given)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    if checkpoints:
        from fp8dist.integrations.ray import report_checkpoint, resume

        state = resume(model, optimizer)
        start = state.step if state is not None else 0
    batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)
    losses = {}
    for step in range(start, STEPS):
        ids = batches[step]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[step] = loss.item()
        if out is not None:
            with open(out / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": losses[step], "start": start}) + "\n")
        if checkpoints:
            report_checkpoint({"loss": losses[step]}, model, optimizer, step=step + 1)
            if fail_after == step + 1 and start == 0:
                import ray.train

                # Ray's controller registers a reported checkpoint after report_checkpoint returns; a worker failing
                # at once can race it (CI: the restart resumed from step 1). Fail once this step's checkpoint is
                # committed.
                ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
                raise RuntimeError(f"planned failure after step {step + 1}")
    return losses


def _ray_train_func(config: dict) -> None:
    import ray.train

    context = ray.train.get_context()
    _train(context.get_world_rank(), context.get_world_size(), Path(config["out"]),
           checkpoints=config["checkpoints"], fail_after=config.get("fail_after"), mesh=config.get("mesh", False))


def _reference(rank: int, world: int) -> dict[int, float]:
    return _train(rank, world, None)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of 2 CPUs for this module's tests, stopped after them. Its workers import this module by
    name, as the dist harness's ranks do."""
    ray = pytest.importorskip("ray", reason=NO_RAY)
    pytest.importorskip("ray.train.torch", reason=NO_RAY)
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,  # never a `ray start` one
             runtime_env={"env_vars": {"PYTHONPATH": path, "GLOO_SOCKET_IFNAME": "lo"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def reference_losses() -> list[dict[int, float]]:
    """The same loop on 2 gloo ranks without Ray, uninterrupted: every step's loss, per rank."""
    return run_ranks(_reference)


def _fit(tmp_path: Path, **config) -> tuple[object, list[list[dict]]]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = tmp_path / "losses"
    out.mkdir()
    trainer = TorchTrainer(_ray_train_func, train_loop_config={"out": str(out), **config},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=str(tmp_path / "storage"), name="run",
                                                failure_config=FailureConfig(max_failures=1)))
    result = trainer.fit()
    lines = [[json.loads(line) for line in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in range(2)]
    return result, lines


@pytest.mark.slow
def test_a_restarted_ray_worker_group_resumes_exactly(ray_cluster, reference_losses, tmp_path):
    """Attempt 1 trains steps 0-1, reports their checkpoints and fails; Ray restarts the worker group, which resumes
    from the step-2 checkpoint and trains steps 2-3: every loss == the uninterrupted run without Ray."""
    result, lines = _fit(tmp_path, checkpoints=True, fail_after=FAIL_AFTER, mesh=True)
    assert result.error is None
    for rank in range(2):
        assert [(line["step"], line["start"]) for line in lines[rank]] == [(0, 0), (1, 0), (2, 2), (3, 2)]
        assert {line["step"]: line["loss"] for line in lines[rank]} == reference_losses[rank], f"rank {rank}"
    with result.checkpoint.as_directory() as folder:
        saved = sorted(p.name for p in Path(folder).iterdir())
    assert saved == ["latest", "step_00000004"], "the last checkpoint Ray kept is fp8dist's, complete"


@pytest.mark.parametrize("call", ["report_checkpoint", "resume"])
def test_without_ray_installed_the_error_names_the_extra(call, monkeypatch):
    """Ray absent (None in sys.modules makes its import fail, as when it is not installed): one ImportError naming
    the install command, before anything is written."""
    from fp8dist.integrations import ray as ray_integration

    for name in ("ray", "ray.train"):
        monkeypatch.setitem(sys.modules, name, None)
    args = {"report_checkpoint": ({"loss": 1.0}, torch.nn.Linear(2, 2), None),
            "resume": (torch.nn.Linear(2, 2), None)}[call]
    with pytest.raises(ImportError, match=r"fp8dist.integrations.ray needs Ray Train, which is not installed here "
                                          r".*: pip install 'fp8dist\[ray\]'\.$"):
        getattr(ray_integration, call)(*args, **({"step": 1} if call == "report_checkpoint" else {}))


def test_report_checkpoint_and_resume_outside_a_ray_worker_say_where_they_run():
    pytest.importorskip("ray.train", reason=NO_RAY)
    from fp8dist.integrations.ray import resume

    with pytest.raises(RuntimeError, match=r"run inside the training function of a ray.train.torch.TorchTrainer, on "
                                           r"every worker; .* or use fp8dist.save_checkpoint / load_checkpoint"):
        resume(torch.nn.Linear(2, 2), None)


def _on_this_cluster(ray) -> dict[str, str]:
    """A command's environment that joins this module's Ray cluster (one start for every test here, ~10 s each
    saved) with one thread per rank."""
    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "OMP_NUM_THREADS": "1"}


JOB = ["--steps", "3", "--nproc", "2", "--strategy", "fsdp", "--fp8", "torchao"]


def _job_on_gloo_ranks(rank: int, world: int, metrics: str) -> None:
    """JOB as each rank of its local launch runs it (``run_training``; tests/test_train.py launches the command)."""
    from fp8dist.config.resolve import resolve_config
    from fp8dist.train.job import TrainConfig, run_training

    run_training(resolve_config(strategy="fsdp", fp8="torchao"), TrainConfig(steps=3, metrics_file=metrics),
                 log=lambda line: None)


@pytest.mark.slow
def test_fp8dist_train_on_ray_workers_matches_the_job_on_gloo_ranks(ray_cluster, tmp_path):
    """``fp8dist train --launcher ray``: the reference job's 2 ranks as Ray Train workers, every step's loss == the
    same job on 2 gloo ranks without Ray, one thread per rank in both. Those ranks are the dist harness's, forked
    from its fork server: the command's own local launch (its process and its fork server importing torch, ~13 s of
    CPU) gave the same losses, bit for bit."""
    proc = run(["fp8dist", "train", *JOB, "--launcher", "ray", "--metrics-file", str(tmp_path / "ray.jsonl")],
               env=_on_this_cluster(ray_cluster), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting 2 Ray Train workers" in proc.stdout
    run_ranks(_job_on_gloo_ranks, str(tmp_path / "gloo.jsonl"))
    figures = {name: [json.loads(line)["loss"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
               for name in ("ray", "gloo")}
    assert len(figures["ray"]) == 3 and figures["ray"] == figures["gloo"]


@pytest.mark.slow
def test_the_ray_example_trains_and_reports_ray_checkpoints(ray_cluster, tmp_path):
    """examples/ray_train.py as its docstring runs it: 4 steps with a checkpoint every 2, each reported to Ray (a
    restarted worker group resuming from Ray's checkpoint is the test above)."""
    script = ROOT / "examples" / "ray_train.py"
    assert "python examples/ray_train.py --num-workers 2 --fp8 torchao" in script.read_text()
    proc = run(["python", str(script), "--num-workers", "2", "--steps", "4", "--save-every", "2",
                "--storage", str(tmp_path / "storage")], env=_on_this_cluster(ray_cluster), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = sorted({int(s) for s in re.findall(r"step +(\d+) loss \d+\.\d+$", proc.stdout, flags=re.M)})
    assert steps == [0, 1, 2, 3] and "(step 4, loss " in proc.stdout
    reported = [p for p in (tmp_path / "storage").rglob("checkpoint_*") if p.is_dir()]
    assert len(reported) == 2, reported  # steps 2 and 4, each an fp8dist checkpoint Ray keeps
