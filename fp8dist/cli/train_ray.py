"""``fp8dist train --launcher ray``: the reference job's ranks as Ray Train workers (one ``TorchTrainer`` run), on
the Ray cluster ``RAY_ADDRESS`` names (or ``ray start`` started here), else on one this command starts and stops.
Ray starts the process group; each worker runs the same job as a torchrun rank (its own checkpoints, on a
filesystem every worker sees)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from typing import Any

__all__ = ["run_on_ray", "check_ray_launch"]


def _worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: one rank of the job (Ray destroys the process group after it)."""
    from ..config.resolve import Config
    from ..train.config import TrainConfig
    from ..train.job import run_training
    from .common import one_line_warnings, quiet_cpu_noise

    quiet_cpu_noise()
    if os.path.isdir(loop_config["cwd"]):  # relative paths in the flags are the command's, as under torchrun
        os.chdir(loop_config["cwd"])
    with one_line_warnings("train"):
        run_training(Config.from_dict(loop_config["config"]), TrainConfig(**loop_config["train"]))


def _first_failure(err: BaseException) -> tuple[int | None, BaseException]:
    """(rank, error) of the lowest failed worker in Ray's ``WorkerGroupError``, else (None, ``err``); the user's
    exception inside Ray's wrapper (``RayTaskError.cause``)."""
    failures = getattr(err, "worker_failures", None) or {}
    if not failures:
        return None, err
    rank = min(failures)
    failure = failures[rank]
    return rank, getattr(failure, "cause", None) or failure


def run_on_ray(nproc: int, config: Any, train: Any, *, use_gpu: bool) -> int:
    """Train ``config``/``train`` on ``nproc`` Ray Train workers (one GPU each with ``use_gpu``); returns the exit
    code: 0, or an explained error's (one line on stderr, as from torchrun's ranks), or FAILED_EXIT."""
    from .errors import FAILED_EXIT, error_line, exit_code

    import ray  # check_ray_launch found it
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started = not ray.is_initialized()
    if started:  # RAY_ADDRESS (a cluster's) is read by ray.init itself
        ray.init(include_dashboard=False, log_to_driver=True)
    print(f"fp8dist train: starting {nproc} Ray Train workers", flush=True)
    storage = tempfile.mkdtemp(prefix="fp8dist-ray-")  # Ray's own run records; the job writes its checkpoints
    trainer = TorchTrainer(_worker, train_loop_config={"config": config.to_dict(), "train": dataclasses.asdict(train),
                                                       "cwd": os.getcwd()},
                           scaling_config=ScalingConfig(num_workers=nproc, use_gpu=use_gpu),
                           run_config=RunConfig(storage_path=storage, name="fp8dist-train"))
    try:
        trainer.fit()
    except Exception as err:  # Ray's TrainingFailedError: the workers' errors inside
        rank, cause = _first_failure(err)
        code = exit_code(cause)
        if code is not None:
            print(error_line("train", str(cause)), file=sys.stderr)
            return code
        where = f"rank {rank}" if rank is not None else "Ray Train"
        print(f"fp8dist train: {where} failed:\n{cause}", file=sys.stderr)
        return FAILED_EXIT
    finally:
        if started:
            ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
    return 0


def check_ray_launch(launcher: str) -> None:
    """ValueError, before anything starts, for ``--launcher ray`` where it cannot run: Ray Train not importable, or
    this process is already one rank of a job (``launcher``: :attr:`~fp8dist.runtime.env.LaunchEnv.launcher`)."""
    from ..integrations.ray import INSTALL

    if launcher != "none":
        raise ValueError(f"launcher='ray' starts the ranks as Ray Train workers, but this process is already one rank "
                         f"of a job ({launcher!r} launch: RANK/WORLD_SIZE or SLURM's variables are set). Run fp8dist "
                         "train --launcher ray once, from a plain shell or the Ray head node, or leave --launcher out "
                         "under torchrun or srun.")
    try:
        import ray.train.torch  # noqa: F401
    except ImportError as err:
        raise ValueError(f"launcher='ray' needs Ray Train, which cannot be imported here ({err}): {INSTALL} (or "
                         "leave --launcher out: the local launch needs nothing).") from None
