"""``fp8dist estimate``: per-rank memory of a model built on the meta device, before anything is allocated. The engines
are imported once the flags parse."""

from __future__ import annotations

import argparse
from dataclasses import fields
import json
import sys
import warnings
from typing import Any

from ..config.schema import add_arguments
from ..config.rules import facts_of
from ..config.dtypes import DTYPE_NAMES
from ..config.resolve import FP8Config, StrategyConfig, torch_dtype
from ..config.options import DEFAULT_SEQ_LEN
from ..accounting.optimizers import OPTIMIZER_STATES
from .common import FP8_DEFAULT_HELP, add_model_source, config_from_args, meta_model
from .plan import checkpointing_json, fastest_line, fitted_steps, step_text, steps_json
from ..train.config import TrainConfig

__all__ = ["HELP", "add_parser", "run"]

_MODEL_DTYPE = "fp32"  # weights built in fp32, which FSDP/DDP keep as the master


HELP = "predict per-rank memory (model states, activations) before allocating"
"""The command's line in ``fp8dist --help``."""


def add_parser(sub: Any) -> None:
    """Add ``fp8dist estimate`` and its flags to ``sub`` (the top-level parser's subparsers); called only when the
    command line names estimate (the other commands are a line of ``fp8dist --help``)."""
    p = sub.add_parser("estimate", help=HELP,
                       description="Build the model on the meta device (nothing allocated) and predict the bytes "
                                   "of parameters, master weights, gradients, optimizer states and FP8 buffers on "
                                   "one rank, and the activations of one micro-batch.")
    add_model_source(p)
    p.add_argument("--world-size", type=int, default=1, metavar="N", help="data-parallel ranks (default: 1)")
    p.add_argument("--target", metavar="GPU",
                   help="the GPU the run is for (h100, b200, ...): planned for it (fp8_select, MoE experts), with its "
                        "predicted GEMM time per micro-batch beside the memory (default: none, no GEMM time)")
    p.add_argument("--optimizer", choices=list(OPTIMIZER_STATES), default="adamw",
                   help="adamw/adam: 2 states per parameter, sgd_momentum: 1, sgd: none (default: adamw)")
    p.add_argument("--rank", type=int, metavar="R", help="describe this rank (default: the one with the most)")
    p.add_argument("--model-dtype", choices=list(DTYPE_NAMES), default=_MODEL_DTYPE,
                   help="dtype the weights are stored in before wrapping, which FSDP/DDP keep (default: fp32, "
                        "whatever torch_dtype a config.json names: that is its checkpoint's dtype; with --lora-rank "
                        "the frozen base's: bf16 halves it, PEFT keeps the adapters in fp32)")
    p.add_argument("--loss-chunks", type=int, default=1, metavar="N",
                   help="your loop computes the output head and the loss N chunks of the sequence at a time "
                        "(torchtitan's ChunkedLossWrapper: 8); default 1, a Hugging Face model's loss: the whole "
                        "micro-batch's logits and their fp32 log-softmax at once")
    p.add_argument("--selective-gemms", metavar="OP[,OP]", type=lambda text: tuple(text.split(",")),
                   help="activation_checkpointing=selective: the ops whose every other output your policy keeps "
                        "(torchtitan's: aten.mm.default,aten.linear.default); default: fp8dist's own policy")
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    add_arguments(p, TrainConfig, title="LoRA (estimate a run of fp8dist train --lora-rank R: adapters over a frozen "
                  "base)", skip=[f.name for f in fields(TrainConfig) if not f.name.startswith("lora_")])  # train's
    add_arguments(p, StrategyConfig, title="strategy", skip=("device",),
                  shown_defaults={"micro_batch_size": "1; also the activations' micro-batch",
                                  "seq_len": f"none: {DEFAULT_SEQ_LEN}; also the activations' sequence"})
    add_arguments(p, FP8Config, title="fp8", skip=("on_unsupported", "use_autocast_during_eval"),
                  shown_defaults={"fp8": FP8_DEFAULT_HELP})


def run(args: argparse.Namespace) -> int:
    """Run ``fp8dist estimate`` with its parsed flags; returns the exit code (0: done). Raises what the library raises
    for bad values: :func:`fp8dist.cli.main` turns the errors fp8dist explains into one line and exit code 2."""
    from ..accounting.estimate import check_counts, estimate_memory
    from ..runtime.hardware import parse_target

    config, _ = config_from_args(args)
    seq_len = config.parallel.seq_len or DEFAULT_SEQ_LEN
    check_counts(args.world_size, config.parallel.micro_batch_size, seq_len, config)
    target = parse_target(args.target) if args.target is not None else None
    model = _with_lora(meta_model(args).to(torch_dtype(args.model_dtype)), args)  # meta: nothing is allocated
    with warnings.catch_warnings(record=True) as caught:  # said as fp8dist plan says its notes
        warnings.simplefilter("always")
        est = estimate_memory(model, config, world_size=args.world_size, optimizer=args.optimizer, rank=args.rank,
                              target=target, loss_chunks=args.loss_chunks, selective_gemms=args.selective_gemms)
    notes = [str(w.message) for w in caught]
    if args.model_dtype != _MODEL_DTYPE and facts_of(config).engine_owns_params:
        notes.append(f"model_dtype={args.model_dtype!r} has no effect here (strategy={config.parallel.strategy!r}: "
                     f"the engine casts the module to its own dtype, param_dtype={config.parallel.param_dtype!r}).")
    for note in dict.fromkeys(notes):
        print(f"fp8dist estimate: note: {note}", file=sys.stderr)
    predicted = est.speed is not None and est.speed.step is not None  # a --target GPU, a speed model for the backend
    steps, checkpointing = fitted_steps(model, config, est.speed, args.world_size, est.fit) if predicted else ((), None)
    if args.json:
        data = {**est.to_dict(), **(steps_json(steps) if steps else {}),
                **{k: v for k, v in checkpointing_json(checkpointing).items() if k != "fit"}}
        print(json.dumps(data, indent=2), file=args.data_out)
    else:
        print(est)
        if steps:
            print(f"{fastest_line(steps)}\n{step_text(steps, checkpointing)}")
        elif checkpointing is not None:
            print(checkpointing.why)  # the estimate's lines above say that it does not fit and the ways out
    return 0


def _with_lora(model: Any, args: argparse.Namespace) -> Any:
    """``model`` as ``fp8dist train`` trains it under the LoRA flags given (PEFT adapters over its frozen base)."""
    from ..train.lora import apply_lora

    given = {name: getattr(args, name) for name in vars(args) if name.startswith("lora_")}
    train = TrainConfig(**given)  # the job's checks: ranges, and no LoRA option without --lora-rank
    return apply_lora(model, train) if train.lora_rank else model
