"""``fp8dist probe``: measure each planned FP8 layer's numerics on the built-in corpus and print the table
(:func:`fp8dist.measure_fp8_numerics`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from .._schema import add_arguments, normalize_fields
from ..config import FP8Config, StrategyConfig
from ..numerics import Thresholds
from .common import FP8_DEFAULT_HELP, add_model_source, config_from_args, meta_model

__all__ = ["add_parser", "run", "ProbeConfig", "probe_batches"]


@dataclass(kw_only=True, frozen=True)
class ProbeConfig:
    """What the probe runs the model on."""

    batches: int = 4
    """Batches to run, forward and backward (the first ones fp8dist train reads with the same seed)."""

    batch_size: int = 8
    """Sequences per batch."""

    seq_len: int = 128
    """Tokens (bytes) per sequence."""

    seed: int = 0
    """Seed of the model initialization (a model without --pretrained) and of the batch order."""

    def __post_init__(self) -> None:
        normalize_fields(self)
        for name in ("batches", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("probe", help="measure each FP8 layer's numerics and name the layers to keep out of FP8",
                       description="Run the model in high precision on the built-in corpus and, for every layer the "
                                   "plan runs in FP8, cast its input, weight and output gradient as the recipe does: "
                                   "SQNR, values flushed to zero, saturated, and the output's SQNR. Layers past the "
                                   "thresholds are listed as recommended_exclude (pass them as --fp8-exclude).")
    add_model_source(p)
    p.add_argument("--target", metavar="GPU",
                   help="plan for this machine (h100, b200, sm_90, ...): on a CPU, MoE experts are FP8 candidates "
                        "only for a GPU target (default: this machine, as if it had FP8)")
    p.add_argument("--json", metavar="FILE", help="also write the whole report as JSON")
    add_arguments(p, ProbeConfig, title="probe")
    add_arguments(p, Thresholds, title="thresholds")
    add_arguments(p, StrategyConfig, title="strategy", skip=("seq_len",))  # --seq-len: the probe's batches
    add_arguments(p, FP8Config, title="fp8", shown_defaults={"fp8": FP8_DEFAULT_HELP})


def probe_batches(args: argparse.Namespace, probe: ProbeConfig) -> list:
    """The batches the probe runs: the built-in corpus, steps 0 .. batches-1 of its order under ``seed`` (one
    rank). The data source of ``fp8dist train`` plugs in here when it gains one (``--data``)."""
    from ..data import Batches

    corpus = Batches(batch_size=probe.batch_size, seq_len=probe.seq_len, seed=probe.seed)
    return [corpus[step] for step in range(probe.batches)]


def run(args: argparse.Namespace) -> int:
    import torch

    from .._files import atomic_write_text
    from ..data import check_fits_corpus
    from ..numerics import measure_fp8_numerics

    config, routed = config_from_args(args, extra=(ProbeConfig, Thresholds))
    probe, thresholds = ProbeConfig(**routed[ProbeConfig]), Thresholds(**routed[Thresholds])
    for note in config.unused_options():
        print(f"fp8dist probe: note: {note}", file=sys.stderr)
    model = meta_model(args)
    source = args.model_config or getattr(args, "pretrained", None)
    check_fits_corpus(model.config, probe.seq_len, repr(source) if source else "the built-in model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(probe.seed)  # the meta model's own initialization
        report = measure_fp8_numerics(model, probe_batches(args, probe), target=args.target, thresholds=thresholds,
                                      **config.to_dict())
    print(report)
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(report.to_dict(), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0
