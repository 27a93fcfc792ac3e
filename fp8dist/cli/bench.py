"""``fp8dist bench``: the strategy x FP8 backend x model size matrix (:mod:`fp8dist.bench`), and its results."""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..config.text import plural
from ..config.schema import add_arguments
from ..bench.cell import TIMING_WARMUP, TextJob, variants_of
from ..bench.runner import (DEFAULTS, check_cells, check_text, default_strategies, device_type, fp8_choices,
                            plan_cells, resolve_settings, run_cells, variant_backends)
from ..fp8 import NO_FP8, get_backend
from ..memory_levels import LEVELS, STANDARD
from ..strategies import STRATEGIES
from ..train.config import TrainConfig
from ..train.models import LLAMA_SIZES
from ..train.schedule import LR_SCHEDULES

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Register ``fp8dist bench`` on an argparse subparsers object."""
    p = sub.add_parser("bench", help="benchmark strategy x FP8 backend x model size: throughput, memory, "
                                     "communication, loss vs bf16, overhead vs the raw engine",
                       description="Train each cell of a strategy x FP8 backend x model size matrix for a few "
                                   "steps in fresh processes; record throughput, peak memory, model-state bytes per "
                                   "parameter, bytes communicated per step by collective type, the loss curve "
                                   "against bf16, and fp8dist's step time against the hand-wired FSDP2 engine; "
                                   "with --data, on real text, with the held-out loss at fixed steps and its spread "
                                   "across --seed values. Writes JSON and PNG named by date and device.")
    def default(i: int, per_device: Any = DEFAULTS) -> str:
        cpu, gpu = per_device["cpu"][i], per_device["cuda"][i]
        return f"default: {cpu}" if cpu == gpu else f"default: {cpu} on CPU, {gpu} on GPU"

    strategies = {d: [",".join(default_strategies(d, installed=False))] for d in DEFAULTS}
    p.add_argument("--strategies", metavar="LIST", default=None,
                   help=f"comma-separated, from {', '.join(STRATEGIES)} ({default(0, strategies)}; each where "
                        "installed)")
    p.add_argument("--fp8", metavar="LIST", default=None,
                   help=f"comma-separated FP8 backends, from {', '.join(fp8_choices())}; each FP8 cell also runs its "
                        f"bf16 ({NO_FP8.name}) counterpart (default: {NO_FP8.name} and fp8dist train's default backend "
                        "where it runs)")
    p.add_argument("--sizes", metavar="LIST", default=None,
                   help=f"comma-separated Llama presets, from {', '.join(LLAMA_SIZES)} ({default(0)})")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help=f"steps per cell: {TIMING_WARMUP} warm-up, then timed, the last one counted "
                        f"(communication, model state) and not timed ({default(1)})")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help=f"sequences per process per step ({default(2)})")
    p.add_argument("--seq-len", type=int, default=None, metavar="N", help=f"tokens per sequence ({default(3)})")
    p.add_argument("--nproc", type=int, default=None, metavar="N",
                   help="processes per cell (default: one per GPU, or 2 on CPU; a strategy without a process group "
                        "always runs 1)")
    p.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=2,
                   help="ZeRO stage of the cells whose strategy reads zero_stage (default: 2)")
    p.add_argument("--compile", metavar="LIST", default="off",
                   help="comma-separated, from off, on: torch.compile each block (a matrix dimension; default: off)")
    p.add_argument("--activation-checkpointing", metavar="LIST", default="none",
                   help="comma-separated, from none, full, selective (a matrix dimension; default: none)")
    p.add_argument("--memory", metavar="LIST", default=STANDARD.name,
                   help=f"comma-separated, from {', '.join(LEVELS)}: the model-state memory level (a matrix dimension; "
                        f"a level's cells only where its strategy allows it; default: {STANDARD.name})")
    p.add_argument("--lr", type=float, default=1e-3, metavar="X",
                   help="AdamW's (peak) learning rate (default: 1e-3)")
    p.add_argument("--lr-schedule", default="constant", metavar="{" + ",".join(LR_SCHEDULES) + "}",
                   help="constant: --lr at every step; cosine: fp8dist train's schedule, linear warm-up over the first "
                        "10%% of --steps, then cosine decay toward 10%% of --lr (default: constant, as the committed "
                        "results)")
    p.add_argument("--seed", default="0", metavar="LIST",
                   help="model initialization and batch order seed, or comma-separated seeds (a matrix dimension: "
                        "the spread of each figure across seeds; default: 0)")
    for name in variant_backends():  # e.g. --torchao-recipe: a cell per value
        option, values = get_backend(name).variant_option, variants_of(name)
        p.add_argument("--" + option.replace("_", "-"), metavar="LIST", default=values[0],
                       help=f"comma-separated {option} values, from {', '.join(values)} (a matrix dimension of the "
                            f"{name} cells; default: {values[0]})")
    p.add_argument("--no-raw", dest="raw", action="store_false",
                   help="skip the fp8dist-vs-hand-wired FSDP2 cells (the overhead ratio); default: run them")
    p.add_argument("--no-plot", dest="plot", action="store_false",
                   help="write the JSON only; default: JSON and PNG (the PNG needs matplotlib: "
                        "pip install 'fp8dist[bench]')")
    p.add_argument("--out", metavar="DIR", default="benchmarks/results",
                   help="directory for the JSON and PNG (default: benchmarks/results)")
    # fp8dist train's data flags, documented there: every cell trains on the text and records its held-out loss
    keep = {f.name for f in fields(TextJob)}
    add_arguments(p, TrainConfig, title="real text (instead of the built-in grammar corpus)",
                  skip=[f.name for f in fields(TrainConfig) if f.name not in keep],
                  shown_defaults={"data": "none, the built-in corpus"})


def run(args: argparse.Namespace) -> int:
    """Run the benchmark matrix and write its JSON and PNG; returns the exit code (1 if a cell failed)."""
    from ..pipeline.files import check_output_path
    from ..bench.results import cell_line, markdown_table, results_document, write_results

    device = device_type()
    settings = resolve_settings(args, device)
    cells = plan_cells(settings)
    check_cells(cells, settings, device)
    try:  # checked before the matrix runs, not after it
        if args.plot:
            importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise ValueError("the PNG plot needs matplotlib, which is not installed: pip install 'fp8dist[bench]' "
                         "(or pass --no-plot to write the JSON only).") from None
    out = check_output_path(args.out, name="--out", directory=True)  # before the text is tokenized and any cell runs
    text = check_text(settings)  # tokenized here once; the cells read the cache
    out.mkdir(parents=True, exist_ok=True)
    started, load_start = time.time(), os.getloadavg()
    print(f"fp8dist bench: {plural(len(cells), 'cell')} on {device}, {plural(settings.nproc, 'process')} each, "
          f"{plural(settings.steps, 'step')}; results in {out}/", flush=True)
    if text:
        print(text, flush=True)
    results = run_cells(cells, settings, cell_line)
    doc = results_document(results, settings, device, command=_command_line(),
                           load_average=[load_start, os.getloadavg()], wall_s=time.time() - started)
    paths = write_results(doc, out, plot=args.plot)
    print(markdown_table(doc))
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    failed = [r["name"] for r in results if "error" in r]
    if failed:
        print(f"fp8dist bench: {plural(len(failed), 'cell')} failed: {', '.join(failed)} (errors in the JSON)",
              file=sys.stderr)
    return 1 if failed else 0


def _command_line() -> str:
    return shlex.join(["fp8dist", *sys.argv[1:]]) if Path(sys.argv[0]).name == "fp8dist" else shlex.join(sys.argv)
