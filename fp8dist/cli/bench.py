"""``fp8dist bench``: the strategy x FP8 backend x model size matrix (:mod:`fp8dist.bench`), and its results."""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
import time
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..config.schema import add_arguments, cli_flag, field_docs, type_hints
from ..config.text import plural
from ..runtime.files import check_output_path
from ..train.config import TrainConfig

__all__ = ["HELP", "add_parser", "check_flags", "run"]


HELP = ("benchmark strategy x FP8 backend x model size: throughput, memory, communication, loss vs bf16, overhead "
        "vs the raw engine")
"""The command's line in ``fp8dist --help``."""


def add_parser(sub: Any) -> None:
    """Add ``fp8dist bench`` and its flags to ``sub`` (the top-level parser's subparsers); called only when the
    command line names bench (the other commands are a line of ``fp8dist --help``)."""
    # the flags' defaults are the engines' facts as the registries know them, without importing an engine
    from ..bench.settings import TextJob, variant_backends, variant_options, variants_of

    p = sub.add_parser("bench", help=HELP,
                       description="Train each cell of a strategy x FP8 backend x model size matrix for a few "
                                   "steps in fresh processes; record throughput, peak memory, model-state bytes per "
                                   "parameter, bytes communicated per step by collective type, the loss curve "
                                   "against bf16, and fp8dist's step time against the hand-wired FSDP2 engine; "
                                   "with --data, on real text, with the held-out loss at fixed steps and its spread "
                                   "across --seed values. Writes JSON and PNG named by date and device.")
    _settings_flags(p)
    for name in variant_backends():  # e.g. --torchao-recipe, --torchao-api: a cell per value
        for option in variant_options(name):
            values = variants_of(name, option)
            p.add_argument(cli_flag(option), metavar="LIST", default=values[0],
                           help=f"{option} values of the {name} cells: a matrix dimension (comma-separated, from "
                                f"{', '.join(values)}; default: {values[0]})")
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


def _settings_flags(p: argparse.ArgumentParser) -> None:
    """A flag per field of :class:`BenchSettings`, help from the field: a list is comma-separated, a boolean (on by
    default) is ``--no-NAME``, a device-dependent default is None until ``resolve_settings`` fills it (shown as its
    ``shown`` words, else as asked of each device type)."""
    from ..bench.settings import BenchSettings

    docs, hints = field_docs(BenchSettings), type_hints(BenchSettings)
    for f in fields(BenchSettings):
        meta = f.metadata
        name = meta.get("flag", f.name)
        hint = hints[f.name]
        doc = docs[f.name].rstrip(".")
        if name is None:
            continue
        if hint is bool:
            p.add_argument(f"--no-{name.replace('_', '-')}", dest=f.name, action="store_false",
                           help=f"{doc} (default: on; this flag: off)")
            continue
        listed, choices = typing.get_origin(hint) is tuple, [_text(c) for c in meta.get("choices", tuple)()]
        if "device" in meta:
            default, shown = None, meta.get("shown") or _per_device(meta["device"])
        else:
            default = shown = _text(f.default) if listed else f.default
        if listed:
            kind, metavar = str, "LIST"
        else:
            kind, metavar = hint, "{" + ",".join(choices) + "}" if choices else {int: "N", float: "X"}[hint]
        listing = f"comma-separated, from {', '.join(choices)}; " if listed and choices else ""
        p.add_argument(cli_flag(name), dest=f.name, default=default, type=kind, metavar=metavar,
                       help=f"{doc} ({listing}default: {shown})".replace("%", "%%"))


def _per_device(default: Any) -> str:
    cpu, gpu = (_text(default(d)) for d in ("cpu", "cuda"))
    return cpu if cpu == gpu else f"{cpu} on CPU, {gpu} on GPU"


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(_text, value))
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def check_flags(args: argparse.Namespace) -> None:
    """The flags' values that need no engine to check (each list item against its choices, the least values);
    ValueError names the flag, the value and the choices. ``fp8dist``'s main calls it before any engine loads."""
    from ..bench.settings import read_flags

    read_flags(args, None)


def run(args: argparse.Namespace) -> int:
    """``fp8dist bench``: run the benchmark matrix ``args`` (this subcommand's parsed flags) asks for, print a line per
    cell and the table, and write the JSON and PNG into ``--out``. Returns the exit code: 0, or 1 if a cell failed
    (its error is in the JSON).

    Raises:
        ValueError: a flag's value, a cell the settings refuse, an unusable ``--out``, or ``--plot`` without
            matplotlib, each before any cell runs (``fp8dist``'s main prints it and exits with ``USAGE_EXIT``).
    """
    from ..bench.results import cell_line, markdown_table, results_document, write_results
    from ..bench.runner import check_cells, check_text, device_type, plan_cells, resolve_settings, run_cells

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
