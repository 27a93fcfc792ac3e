"""``fp8dist probe``: each planned FP8 layer's numerics on the built-in corpus or ``--data`` text, as a table. The
engines are imported once the flags parse."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from types import SimpleNamespace
from typing import Any

from ..config.resolve import FP8Config, StrategyConfig
from ..config.schema import add_arguments, normalize_fields
from ..runtime.files import atomic_write_text, check_output_path
from ..numerics.thresholds import Thresholds
from ..train.config import TrainConfig
from .common import FP8_DEFAULT_HELP, add_model_source, config_from_args, meta_model

__all__ = ["HELP", "add_parser", "run", "ProbeConfig", "probe_batches", "DATA_OPTIONS"]

DATA_OPTIONS = ("data", "tokenizer", "text_field", "data_cache")
"""The ``fp8dist train`` options ``fp8dist probe`` takes too, so the probe measures the text the run trains on."""


@dataclass(kw_only=True, frozen=True)
class ProbeConfig:
    """What the probe runs the model on."""

    batches: int = field(default=4, metadata={"min": 1})
    """Batches to run, forward and backward (the first ones fp8dist train reads with the same seed)."""
    batch_size: int = field(default=8, metadata={"min": 1})
    """Sequences per batch."""
    seq_len: int = field(default=128, metadata={"min": 1})
    """Tokens per sequence (bytes of the built-in corpus, or tokens of --data)."""
    seed: int = 0
    """Seed of the model initialization (a model without --pretrained) and of the batch order."""

    def __post_init__(self) -> None:
        normalize_fields(self)


HELP = "measure each FP8 layer's numerics and name the layers to keep out of FP8"
"""The command's line in ``fp8dist --help``."""


def add_parser(sub: Any) -> None:
    """Add ``fp8dist probe`` and its flags to ``sub`` (the top-level parser's subparsers); called only when the
    command line names probe (the other commands are a line of ``fp8dist --help``)."""
    p = sub.add_parser("probe", help=HELP,
                       description="Run the model in high precision on the built-in corpus (or on --data, as fp8dist "
                                   "train reads it) and, for every layer the "
                                   "plan runs in FP8, cast its input, weight and output gradient as the recipe does: "
                                   "SQNR, values flushed to zero, saturated, and the output's SQNR. Layers past the "
                                   "thresholds are listed as recommended_exclude (pass them as --fp8-exclude).")
    add_model_source(p)
    p.add_argument("--target", metavar="GPU",
                   help="plan for this machine (h100, b200, sm_90, ...): on a CPU, MoE experts are FP8 candidates "
                        "only for a GPU target (default: this machine, as if it had FP8)")
    p.add_argument("--json", metavar="FILE", help="also write the whole report as JSON")
    add_arguments(p, ProbeConfig, title="probe")
    add_arguments(p, TrainConfig, title="data (as fp8dist train reads it)",
                  skip=[f.name for f in fields(TrainConfig) if f.name not in DATA_OPTIONS])
    add_arguments(p, Thresholds, title="thresholds")
    add_arguments(p, StrategyConfig, title="strategy", skip=("seq_len",))  # --seq-len: the probe's batches
    add_arguments(p, FP8Config, title="fp8", shown_defaults={"fp8": FP8_DEFAULT_HELP})


def probe_batches(probe: ProbeConfig, corpus: Any = None) -> list:
    """The first batches ``fp8dist train`` reads under ``seed`` (one rank): of the built-in corpus, or of ``corpus``
    (a :class:`fp8dist.train.data.TokenCorpus`), whose windows of ``seq_len + 1`` tokens are read as the job does."""
    from ..train.data import Batches, TextBatches

    if corpus is None:
        grammar = Batches(batch_size=probe.batch_size, seq_len=probe.seq_len, seed=probe.seed)
        return [grammar[step] for step in range(probe.batches)]
    windows = TextBatches(corpus, batch_size=probe.batch_size, seq_len=probe.seq_len, seed=probe.seed)
    taken = [windows.next_batch() for _ in range(probe.batches)]
    return [dict(input_ids=w[:, :-1], labels=w[:, 1:], shift_labels=w[:, 1:].contiguous()) for w in taken]


def _probe_model(args: argparse.Namespace, config: Any, probe: ProbeConfig, corpus: Any) -> Any:
    """The model on the meta device, with the tokenizer's vocabulary under --data (as ``fp8dist train``); it must
    hold the corpus's ids and ``seq_len`` positions."""
    import torch

    from ..train.data import check_fits_corpus
    from ..train.models import job_model_config

    if corpus is None:
        model = meta_model(args)
        source = args.model_config or getattr(args, "pretrained", None)
        check_fits_corpus(model.config, probe.seq_len, repr(source) if source else "the built-in model")
        return model
    from transformers import AutoModelForCausalLM

    model_config, name = job_model_config(config, SimpleNamespace(model_config=args.model_config,
                                                                  model_size=args.model_size), corpus)
    positions = getattr(model_config, "max_position_embeddings", probe.seq_len)
    if positions < probe.seq_len:
        raise ValueError(f"{name} holds {positions} positions and seq_len={probe.seq_len}: pass --seq-len "
                         f"{positions} or less.")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)


def run(args: argparse.Namespace) -> int:
    """Run ``fp8dist probe`` with its parsed flags; returns the exit code (0: done). Raises what the library raises for
    bad values: :func:`fp8dist.cli.main` turns the errors fp8dist explains into one line and exit code 2."""
    import torch

    from ..numerics import measure_fp8_numerics
    from ..train.data.job import load_job_corpus

    config, routed = config_from_args(args, extra=(ProbeConfig, Thresholds))
    if args.json is not None:  # before the data is tokenized and the model measured
        check_output_path(args.json, name="--json")
    probe, thresholds = ProbeConfig(**routed[ProbeConfig]), Thresholds(**routed[Thresholds])
    data = TrainConfig(**{k: getattr(args, k) for k in DATA_OPTIONS if hasattr(args, k)})
    corpus = load_job_corpus(data, config.parallel.pretrained)  # None: the built-in corpus
    model = _probe_model(args, config, probe, corpus)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(probe.seed)  # the meta model's own initialization
        report = measure_fp8_numerics(model, probe_batches(probe, corpus), target=args.target, thresholds=thresholds,
                                      **config.to_dict())
    print(report)
    if args.json is not None:
        atomic_write_text(args.json, json.dumps(report.to_dict(), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0
