"""``fp8dist plan``: the per-layer FP8 plan of a model built on the meta device."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._schema import add_arguments
from ..config import FP8Config, StrategyConfig
from .common import FP8_DEFAULT_HELP, add_model_source, config_from_args, meta_model

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="print the per-layer FP8 precision plan without training",
                       description="Build the model on the meta device (nothing allocated) and print which layers "
                                   "run in FP8 and why the others fall back.")
    add_model_source(p)
    machine = p.add_mutually_exclusive_group()
    machine.add_argument("--target", metavar="GPU",
                         help="plan for this machine instead of the one you are on, its FP8 library assumed "
                              "installed: a GPU (h100, h200, b200, l40s, a100, ...), a CUDA capability (sm_90, "
                              "sm_100) or cpu")
    machine.add_argument("--ignore-hardware", action="store_true",
                         help="plan as if the backend and FP8 hardware were present, whatever they are")
    p.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="ranks to shard over: how evenly FP8 weights and MoE experts shard, and with --strategy "
                        "fsdp a note when FSDP2's dim-0 padding is large (default: 1)")
    add_arguments(p, StrategyConfig, title="strategy")
    add_arguments(p, FP8Config, title="fp8", shown_defaults={"fp8": FP8_DEFAULT_HELP})


def run(args: argparse.Namespace) -> int:
    from ..env import resolve_device
    from ..hardware import parse_target
    from ..plan import plan_precision

    config, _ = config_from_args(args)
    for note in config.unused_options():
        print(f"fp8dist plan: note: {note}", file=sys.stderr)
    if args.target is not None and config.parallel.device != "auto":
        raise ValueError(f"--target {args.target} and --device {config.parallel.device} both name the machine to plan "
                         "for: give --target alone to plan for another machine, --device alone for this one.")
    model = meta_model(args)
    device = parse_target(args.target) if args.target is not None else resolve_device(config.parallel.device, 0)
    plan = plan_precision(model, config, device=device, world_size=args.world_size,
                          check_hardware=not args.ignore_hardware, check_installed=args.target is None)
    blocks = None
    if plan.facts.shards_params:  # FSDP shards block by block
        from ..strategies.common import find_blocks

        blocks = find_blocks(model, config.parallel.block_classes)  # a bad block_classes is an error here too
    padding = ()
    if plan.facts.dtensor_shards:
        from ..strategies.fsdp import fsdp_padding_notes

        padding = fsdp_padding_notes(model, plan.facts.shard_degree)  # a bad --world-size is an error here
    if args.target is not None:
        print(f"planned for {device} (--target; its FP8 library assumed installed)")
    print(plan)
    if blocks is not None:
        print(f"sharded per block: {len(blocks[0])} blocks ({blocks[1]}), then the root")
    for note in padding:
        print(f"note: {note}")
    return 0
