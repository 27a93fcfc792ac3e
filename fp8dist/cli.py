"""The ``fp8dist`` command line: ``train``, ``plan`` and ``env``.

Every flag of ``train`` is a field of :class:`fp8dist.StrategyConfig`, :class:`fp8dist.FP8Config` or
:class:`fp8dist.train.TrainConfig`, with the default and help text taken from there; ``--config FILE`` reads the
same keys from YAML/JSON and flags override the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import uuid
from typing import Any, Sequence

from ._schema import add_arguments, route_keys
from .config import Config, FP8Config, StrategyConfig, load_config_file
from .env import LaunchError
from .plan import FP8UnavailableError

__all__ = ["main"]


def _train_parser(sub: Any) -> None:
    from .train import TrainConfig

    p = sub.add_parser("train", help="train a small Llama on the built-in corpus (the reference job)",
                       description="Train a small Llama (built from a config, no download) on a deterministic "
                                   "built-in corpus. Spawns --nproc processes itself unless started by torchrun, "
                                   "deepspeed or srun.")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file with any of the keys below; flags override it")
    add_arguments(p, StrategyConfig, title="strategy")
    add_arguments(p, FP8Config, title="fp8", shown_defaults={"fp8": "torchao where it runs (CPU, CUDA sm_89+), else none"})
    add_arguments(p, TrainConfig, title="training job")


def _split_train_keys(args: argparse.Namespace) -> tuple[Config, Any]:
    from .train import TrainConfig, default_fp8

    flat = load_config_file(args.config) if args.config else {}
    given = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    merged = {**flat, **given}
    if "fp8" not in merged:
        merged["fp8"] = default_fp8()
    routed = route_keys(merged, [StrategyConfig, FP8Config, TrainConfig], source=args.config or "the command line")
    config = Config(parallel=StrategyConfig(**routed[StrategyConfig]), precision=FP8Config(**routed[FP8Config]))
    return config, TrainConfig(**routed[TrainConfig])


def _quiet_cpu_noise() -> None:
    """On a CPU-only torch, torchao logs that its CUDA kernels did not load, and torch that torchao registers
    enums the old way: true, and irrelevant to the user of this command."""
    import torch

    if not torch.cuda.is_available():
        logging.getLogger("torchao").setLevel(logging.ERROR)
        logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def _train_worker(flat_config: dict[str, Any], flat_train: dict[str, Any]) -> None:
    """Entry point of each spawned training process."""
    from .train import TrainConfig, run_training

    _quiet_cpu_noise()
    run_training(Config.from_dict(flat_config), TrainConfig(**flat_train))


def _cmd_train(args: argparse.Namespace) -> int:
    from .api import check_supported
    from .data import check_batch_split
    from .env import detect_launch_env, resolve_device
    from .plan import check_fp8_available
    from .train import default_nproc, run_training

    config, train = _split_train_keys(args)
    check_supported(config)
    check_fp8_available(config, resolve_device(config.parallel.device, 0))  # before any process starts
    strategy = config.parallel.strategy
    if detect_launch_env().launcher != "none":  # started by torchrun / deepspeed / srun: we are one rank
        run_training(config, train)
        return 0
    nproc = train.nproc or (1 if strategy == "none" else default_nproc())
    if strategy == "none" and nproc > 1:
        raise ValueError(f"nproc={nproc} with strategy='none': 'none' trains in one process. "
                         "Use --nproc 1, or --strategy ddp/fsdp/fsdp1 to train on several.")
    check_batch_split(train.batch_size, nproc)  # before any process starts
    if nproc == 1:
        run_training(config, train)
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


def _plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="print the per-layer FP8 precision plan without training",
                       description="Build the model on the meta device (nothing allocated) and print which layers "
                                   "run in FP8 and why the others fall back.")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file with strategy/fp8 keys; flags override it")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model-size", choices=["tiny", "small", "medium"], default="tiny",
                        help="built-in Llama preset (default: tiny)")
    source.add_argument("--model-config", metavar="JSON", help="a Hugging Face config.json of a causal LM")
    p.add_argument("--ignore-hardware", action="store_true",
                   help="plan as if the backend and FP8 hardware were present (plan for another machine)")
    add_arguments(p, StrategyConfig, title="strategy")
    add_arguments(p, FP8Config, title="fp8", shown_defaults={"fp8": "torchao"})


def _meta_model(args: argparse.Namespace):
    import json

    import torch

    with torch.device("meta"):
        if args.model_config is None:
            from .models import build_llama

            return build_llama(args.model_size)
        from transformers import AutoConfig, AutoModelForCausalLM

        data = json.loads(open(args.model_config).read())
        if "model_type" not in data:
            raise ValueError(f"{args.model_config}: a Hugging Face config needs 'model_type' (e.g. \"llama\").")
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**data))


def _cmd_plan(args: argparse.Namespace) -> int:
    from .env import resolve_device
    from .plan import plan_precision

    flat = load_config_file(args.config) if args.config else {}
    given = {k: v for k, v in vars(args).items()
             if k not in ("command", "config", "model_size", "model_config", "ignore_hardware")}
    merged = {"fp8": "torchao", **flat, **given}
    config = Config.from_dict(merged, source=args.config or "the command line")
    model = _meta_model(args)
    device = resolve_device(config.parallel.device, 0)
    print(plan_precision(model, config, device=device, check_hardware=not args.ignore_hardware))
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    from .env import describe_environment

    print(describe_environment())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fp8dist`` command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="fp8dist", description="FP8 training on sharded data parallelism.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _train_parser(sub)
    _plan_parser(sub)
    sub.add_parser("env", help="versions, devices, installed FP8 backends and the launcher seen")
    args = parser.parse_args(argv)
    _quiet_cpu_noise()
    try:
        return {"train": _cmd_train, "plan": _cmd_plan, "env": _cmd_env}[args.command](args)
    except (ValueError, NotImplementedError, FileNotFoundError, LaunchError, FP8UnavailableError) as err:
        print(f"fp8dist {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
