"""``fp8dist train``: the reference job, in this process or in ``--nproc`` spawned ones."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import uuid
from typing import Any, NoReturn

from .._schema import add_arguments
from ..config import Config, FP8Config, StrategyConfig
from .common import FP8_DEFAULT_HELP, config_from_args, quiet_cpu_noise

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    from ..train import TrainConfig

    p = sub.add_parser("train", help="train a small Llama on the built-in corpus (the reference job)",
                       description="Train a small Llama (built from a config, no download) on a deterministic "
                                   "built-in corpus. Spawns --nproc processes itself unless started by torchrun, "
                                   "deepspeed or srun.")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file with any of the keys below; flags override it")
    add_arguments(p, StrategyConfig, title="strategy", skip=("seq_len",))  # the job's --seq-len sets it
    add_arguments(p, FP8Config, title="fp8", shown_defaults={"fp8": FP8_DEFAULT_HELP})
    add_arguments(p, TrainConfig, title="training job")


def _config_and_job(args: argparse.Namespace) -> tuple[Config, Any]:
    from ..train import TrainConfig

    config, routed = config_from_args(args, extra=(TrainConfig,))
    return config, TrainConfig(**routed[TrainConfig])


def _train_this_rank(config: Config, train: Any) -> None:
    """Run the job in this process, then take the process group down before the interpreter exits
    (:func:`fp8dist.shutdown`)."""
    from ..env import shutdown
    from ..train import run_training

    run_training(config, train)
    shutdown()


def _exit_launched_rank() -> NoReturn:
    """End a rank started by a launcher once its job is done (all ranks met at the barrier, the process group is
    destroyed, the checkpoint and the export are written): exit 0 without interpreter teardown. In that teardown,
    after all their work, gloo ranks now and then aborted ("terminate called without an active exception"), and
    the launcher reported the finished job as failed. The cause, from a core dump (gdb, 2026-11-23): a gloo worker
    thread (``ProcessGroupGloo::runLoop``) drops its reference to a finished collective (an allgather, or the
    barrier holding it) just after the main thread was woken by its completion; the collective's tensors are kept
    alive for Python, so the release takes the GIL, and taking the GIL while the interpreter finalizes ends the
    thread (``pthread_exit``), whose forced unwind through a noexcept destructor calls ``std::terminate``.
    :func:`fp8dist.shutdown` makes it rare (0 aborts in 60 runs); exiting without teardown makes it impossible."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train_worker(flat_config: dict[str, Any], flat_train: dict[str, Any]) -> None:
    """Entry point of each spawned training process."""
    from ..train import TrainConfig

    quiet_cpu_noise()
    _train_this_rank(Config.from_dict(flat_config), TrainConfig(**flat_train))


def run(args: argparse.Namespace) -> int:
    from ..data import check_batch_split
    from ..env import detect_launch_env, resolve_device
    from ..plan import check_fp8_available
    from ..train import default_nproc

    config, train = _config_and_job(args)
    check_fp8_available(config, resolve_device(config.parallel.device, 0))  # before any process starts
    strategy = config.parallel.strategy
    if detect_launch_env().launcher != "none":  # started by torchrun / deepspeed / srun: we are one rank
        _train_this_rank(config, train)
        _exit_launched_rank()
    nproc = train.nproc or (1 if strategy == "none" else default_nproc())
    if strategy == "none" and nproc > 1:
        raise ValueError(f"nproc={nproc} with strategy='none': 'none' trains in one process. "
                         "Use --nproc 1, or --strategy ddp/fsdp/fsdp1 to train on several.")
    check_batch_split(train.batch_size, nproc, config.parallel.grad_accum)  # before any process starts
    if nproc == 1:
        _train_this_rank(config, train)
        return 0
    return _spawn(nproc, config, train)


def _spawn(nproc: int, config: Config, train: Any) -> int:
    """Start ``nproc`` local training processes with torch's elastic launch API (what torchrun runs)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"fp8dist-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                          start_method="spawn")
    print(f"fp8dist train: starting {nproc} processes", flush=True)
    try:
        elastic_launch(launch, _train_worker)(config.to_dict(), dataclasses.asdict(train))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(f"fp8dist train: rank {rank} failed (exit code {failure.exitcode}):\n{failure.message}",
              file=sys.stderr)
        return 1
    return 0
