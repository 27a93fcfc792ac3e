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
    p.add_argument("--ignore-hardware", action="store_true",
                   help="plan as if the backend and FP8 hardware were present (plan for another machine)")
    p.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="ranks to shard over: with --strategy fsdp, a note says when FSDP2's dim-0 padding is large "
                        "(default: 1)")
    add_arguments(p, StrategyConfig, title="strategy")
    add_arguments(p, FP8Config, title="fp8", shown_defaults={"fp8": FP8_DEFAULT_HELP})


def run(args: argparse.Namespace) -> int:
    from ..env import resolve_device
    from ..plan import plan_precision

    config, _ = config_from_args(args)
    for note in config.unused_options():
        print(f"fp8dist plan: note: {note}", file=sys.stderr)
    model = meta_model(args)
    device = resolve_device(config.parallel.device, 0)
    plan = plan_precision(model, config, device=device, check_hardware=not args.ignore_hardware)
    blocks = None
    if config.parallel.strategy in ("fsdp", "fsdp1"):
        from ..strategies.common import find_blocks

        blocks = find_blocks(model, config.parallel.block_classes)  # a bad block_classes is an error here too
    padding = ()
    if config.parallel.strategy == "fsdp":
        from ..strategies.fsdp import fsdp_padding_notes

        padding = fsdp_padding_notes(model, args.world_size)  # a bad --world-size is an error here
    print(plan)
    if blocks is not None:
        print(f"sharded per block: {len(blocks[0])} blocks ({blocks[1]}), then the root")
    for note in padding:
        print(f"note: {note}")
    return 0
