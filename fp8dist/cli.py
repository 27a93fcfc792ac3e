"""The ``fp8dist`` command line: ``train``, ``plan``, ``estimate``, ``bench``, ``ds-config`` and ``env``.

Every flag of ``train`` is a field of :class:`fp8dist.StrategyConfig`, :class:`fp8dist.FP8Config` or
:class:`fp8dist.train.TrainConfig`, with the default and help text taken from there; ``--config FILE`` reads the
same keys from YAML/JSON and flags override the file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import uuid
from pathlib import Path
from typing import Any, Sequence

from . import bench, estimate
from ._schema import add_arguments, route_keys
from .config import Config, FP8Config, StrategyConfig, load_config_file
from .env import LaunchError
from .models import LLAMA_SIZES
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
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines drown the progress output


def _train_this_rank(config: Config, train: Any) -> None:
    """Run the job in this process, then take the process group down before the interpreter exits: leaving it
    to interpreter shutdown aborts gloo ranks of a multi-node job ("terminate called without an active
    exception") after the training has finished."""
    import torch.distributed as dist

    from .train import run_training

    run_training(config, train)
    if dist.is_initialized():
        dist.destroy_process_group()


def _train_worker(flat_config: dict[str, Any], flat_train: dict[str, Any]) -> None:
    """Entry point of each spawned training process."""
    from .train import TrainConfig

    _quiet_cpu_noise()
    _train_this_rank(Config.from_dict(flat_config), TrainConfig(**flat_train))


def _cmd_train(args: argparse.Namespace) -> int:
    from .data import check_batch_split
    from .env import detect_launch_env, resolve_device
    from .plan import check_fp8_available
    from .train import default_nproc

    config, train = _split_train_keys(args)
    check_fp8_available(config, resolve_device(config.parallel.device, 0))  # before any process starts
    strategy = config.parallel.strategy
    if detect_launch_env().launcher != "none":  # started by torchrun / deepspeed / srun: we are one rank
        _train_this_rank(config, train)
        return 0
    nproc = train.nproc or (1 if strategy == "none" else default_nproc())
    if strategy == "none" and nproc > 1:
        raise ValueError(f"nproc={nproc} with strategy='none': 'none' trains in one process. "
                         "Use --nproc 1, or --strategy ddp/fsdp/fsdp1 to train on several.")
    check_batch_split(train.batch_size, nproc)  # before any process starts
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


def add_model_source(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and the model to build on the meta device: ``--model-size`` or ``--model-config``
    (read by :func:`_meta_model`); shared by ``plan`` and ``estimate``."""
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file with strategy/fp8 keys; flags override it")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model-size", choices=list(LLAMA_SIZES), default="tiny",
                        help="built-in Llama preset (default: tiny)")
    source.add_argument("--model-config", metavar="JSON", help="a Hugging Face config.json of a causal LM")


def _plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="print the per-layer FP8 precision plan without training",
                       description="Build the model on the meta device (nothing allocated) and print which layers "
                                   "run in FP8 and why the others fall back.")
    add_model_source(p)
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

        try:
            data = json.loads(open(args.model_config).read())
        except json.JSONDecodeError as err:
            raise ValueError(f"{args.model_config} is not valid JSON (line {err.lineno}, column {err.colno}: "
                             f"{err.msg}): pass a Hugging Face config.json.") from None
        if not isinstance(data, dict) or "model_type" not in data:
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
    for note in config.unused_options():
        print(f"fp8dist plan: note: {note}", file=sys.stderr)
    model = _meta_model(args)
    device = resolve_device(config.parallel.device, 0)
    plan = plan_precision(model, config, device=device, check_hardware=not args.ignore_hardware)
    blocks = None
    if config.parallel.strategy in ("fsdp", "fsdp1"):
        from .strategies.common import find_blocks

        blocks = find_blocks(model, config.parallel.block_classes)  # a bad block_classes is an error here too
    print(plan)
    if blocks is not None:
        print(f"sharded per block: {len(blocks[0])} blocks ({blocks[1]}), then the root")
    return 0


def _ds_config_parser(sub: Any) -> None:
    p = sub.add_parser("ds-config", help="write a complete DeepSpeed ZeRO config (json for the deepspeed launcher)",
                       description="Build a DeepSpeed ZeRO-1/2/3 config with every value concrete (bucket sizes from "
                                   "the model's hidden size), checked by DeepSpeed's own parser.")
    p.add_argument("--stage", type=int, choices=[1, 2, 3], default=2, help="ZeRO stage (default: 2)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", choices=[f"llama-{size}" for size in LLAMA_SIZES],
                        help="take the hidden size from a built-in Llama")
    source.add_argument("--model-config", metavar="JSON", help="take the hidden size from a HF config.json")
    source.add_argument("--hidden-size", type=int, metavar="N", help="the model's hidden size")
    p.add_argument("--micro-batch-size", type=int, default=1, metavar="N", help="per-GPU micro batch (default: 1)")
    p.add_argument("--grad-accum", type=int, default=1, metavar="N", help="gradient accumulation steps (default: 1)")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="data-parallel ranks: writes train_batch_size; omit to let DeepSpeed derive it at launch")
    p.add_argument("--param-dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="default: bf16")
    p.add_argument("--reduce-dtype", choices=["bf16", "fp16", "fp32"], default="fp32",
                   help="gradient communication dtype (default: fp32)")
    p.add_argument("--gradient-clipping", type=float, default=1.0, metavar="X", help="default: 1.0")
    p.add_argument("--optimizer", metavar="TYPE", help="add an optimizer block, e.g. AdamW")
    p.add_argument("--lr", type=float, default=3e-4, metavar="X", help="optimizer learning rate (default: 3e-4)")
    p.add_argument("--weight-decay", type=float, default=0.0, metavar="X", help="default: 0.0")
    p.add_argument("--warmup-steps", type=int, metavar="N", help="add a WarmupLR scheduler block")
    p.add_argument("--offload-optimizer", action="store_true", help="optimizer states on CPU")
    p.add_argument("--offload-param", action="store_true", help="parameters on CPU (stage 3)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here (atomically) instead of stdout")


def _cmd_ds_config(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ._files import atomic_write
    from .strategies.deepspeed import model_hidden_size, zero_config

    hidden = args.hidden_size
    if args.model or args.model_config:
        args.model_size = (args.model or "llama-tiny").removeprefix("llama-")
        hidden = model_hidden_size(_meta_model(args))
    optimizer = None
    if args.optimizer:
        optimizer = {"type": args.optimizer, "params": {"lr": args.lr, "weight_decay": args.weight_decay}}
    scheduler = None
    if args.warmup_steps is not None:
        scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                    "warmup_num_steps": args.warmup_steps}}
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import; stdout is the json
        config = zero_config(args.stage, hidden_size=hidden, micro_batch_size=args.micro_batch_size,
                             grad_accum=args.grad_accum, world_size=args.world_size, param_dtype=args.param_dtype,
                             reduce_dtype=args.reduce_dtype, gradient_clipping=args.gradient_clipping,
                             optimizer=optimizer, scheduler=scheduler, offload_optimizer=args.offload_optimizer,
                             offload_param=args.offload_param)
    text = json.dumps(config, indent=2) + "\n"
    if not args.output:
        print(text, end="")
        return 0
    target = Path(args.output)
    atomic_write(target, lambda tmp: Path(tmp).write_text(text))  # all or nothing: no half-written json on disk
    print(f"wrote {target} (ZeRO-{args.stage}, hidden size {hidden or 'unknown: DeepSpeed default buckets'})",
          file=sys.stderr)
    return 0


LAUNCH_DIR = Path(__file__).resolve().parent / "launch"
"""The launch scripts, shipped inside the package (the repository's launch/ links here)."""
_SCRIPTS = {"torchrun": "torchrun.sh", "deepspeed": "deepspeed.sh"}


def _launch_parser(sub: Any) -> None:
    p = sub.add_parser(
        "launch", help="run the launch scripts that ship with fp8dist (torchrun, deepspeed, SLURM sbatch)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The scripts of the repository's launch/ folder, installed with the package:\n"
                    "  fp8dist launch torchrun [--dry-run] [fp8dist train flags | script.py ARGS | -m module ARGS]\n"
                    "  fp8dist launch deepspeed [--dry-run] [... as above]   (NODELIST / HOSTFILE for several nodes)\n"
                    "  fp8dist launch slurm torchrun|deepspeed [--dry-run] [SBATCH OPTIONS] [-- ARGS]   (submits)\n"
                    "  fp8dist launch path        print the folder that holds the scripts\n"
                    "Each script's header lists its environment variables; --dry-run prints the exact command.")
    p.add_argument("target", choices=[*_SCRIPTS, "slurm", "path"], help="what to launch")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script (slurm: sbatch options, then -- and "
                                                          "the job's arguments)")


def _sbatch_command(args: list[str]) -> tuple[list[str], bool]:
    """``fp8dist launch slurm NAME [--dry-run] [SBATCH OPTIONS] [-- ARGS]`` -> the sbatch command, dry run or not."""
    if not args or args[0] not in _SCRIPTS:
        raise ValueError(f"fp8dist launch slurm needs a template: one of {', '.join(_SCRIPTS)} (e.g. fp8dist launch "
                         "slurm torchrun --nodes=2 -- --strategy fsdp).")
    name, rest = args[0], args[1:]
    dry = "--dry-run" in rest[: rest.index("--") if "--" in rest else len(rest)]
    if dry:
        rest.remove("--dry-run")
    options, job = (rest[: rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    return ["sbatch", *options, str(LAUNCH_DIR / "slurm" / f"{name}.sbatch"), *job], dry


def _cmd_launch(args: argparse.Namespace) -> int:
    import os
    import shlex
    import shutil
    import subprocess

    if args.target == "path":
        print(LAUNCH_DIR)
        return 0
    if args.target in _SCRIPTS:
        return subprocess.run(["bash", str(LAUNCH_DIR / _SCRIPTS[args.target]), *args.args]).returncode
    command, dry = _sbatch_command(list(args.args))
    env = {**os.environ, "FP8DIST_LAUNCH_DIR": str(LAUNCH_DIR)}  # sbatch exports it: the job finds the scripts
    if dry:
        print(f"FP8DIST_LAUNCH_DIR={shlex.quote(str(LAUNCH_DIR))} {shlex.join(command)}")
        return 0
    if shutil.which("sbatch") is None:
        raise ValueError("sbatch is not on PATH: run fp8dist launch slurm on a SLURM login node (or use --dry-run to "
                         "see the command).")
    return subprocess.run(command, env=env).returncode


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
    estimate.add_parser(sub)
    bench.add_parser(sub)
    _ds_config_parser(sub)
    sub.add_parser("env", help="versions, devices, installed FP8 backends and the launcher seen")
    _launch_parser(sub)
    args = parser.parse_args(argv)
    _quiet_cpu_noise()
    try:
        commands = {"train": _cmd_train, "plan": _cmd_plan, "estimate": estimate.run, "bench": bench.run,
                    "ds-config": _cmd_ds_config, "env": _cmd_env, "launch": _cmd_launch}
        return commands[args.command](args)
    except (ValueError, TypeError, NotImplementedError, OSError, LaunchError, FP8UnavailableError) as err:
        print(f"fp8dist {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
