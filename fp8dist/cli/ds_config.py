"""``fp8dist ds-config``: a complete DeepSpeed ZeRO config for the ``deepspeed`` launcher."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from ..runtime.files import atomic_write_text, check_output_path
from ..train.config import LLAMA_SIZES
from .common import meta_model

__all__ = ["HELP", "add_parser", "run"]


HELP = "write a complete DeepSpeed ZeRO config (json for the deepspeed launcher)"
"""The command's line in ``fp8dist --help``."""


def add_parser(sub: Any) -> None:
    """Add ``fp8dist ds-config`` and its flags to ``sub`` (the top-level parser's subparsers); called only when the
    command line names ds-config (the other commands are a line of ``fp8dist --help``)."""
    p = sub.add_parser("ds-config", help=HELP,
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


def run(args: argparse.Namespace) -> int:
    """Run ``fp8dist ds-config`` with its parsed flags; returns the exit code (0: done). Raises what the library raises
    for bad values: :func:`fp8dist.cli.main` turns the errors fp8dist explains into one line and exit code 2."""
    from ..strategies.deepspeed import model_hidden_size, zero_config

    if args.output:
        check_output_path(args.output, name="-o/--output")
    hidden = args.hidden_size
    if args.model or args.model_config:
        args.model_size = (args.model or "llama-tiny").removeprefix("llama-")
        hidden = model_hidden_size(meta_model(args))
    optimizer = {"type": args.optimizer, "params": {"lr": args.lr, "weight_decay": args.weight_decay}} \
        if args.optimizer else None
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                "warmup_num_steps": args.warmup_steps}} \
        if args.warmup_steps is not None else None
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
    atomic_write_text(args.output, text)  # all or nothing: no half-written json on disk
    print(f"wrote {Path(args.output)} (ZeRO-{args.stage}, hidden size "
          f"{hidden or 'unknown: DeepSpeed default buckets'})", file=sys.stderr)
    return 0
