"""What several subcommands share: the model to build on the meta device, the Config the flags and ``--config``
file make together, and the quieting of CPU-only log noise."""

from __future__ import annotations

import argparse
import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any

from ..config.schema import flat_fields
from ..config.resolve import Config, FP8Config, StrategyConfig, load_config_file, resolve_config
from ..train.models import LLAMA_SIZES

__all__ = ["add_model_source", "meta_model", "config_from_args", "FP8_DEFAULT_HELP", "quiet_cpu_noise",
           "one_line_warnings"]

FP8_DEFAULT_HELP = "torchao where it runs (torchao installed; CPU or CUDA sm_89+), else none"
"""Every subcommand's ``--fp8`` default, shown in its help (the Python API's default is none)."""


def config_from_args(args: argparse.Namespace,
                     extra: tuple[type, ...] = ()) -> tuple[Config, dict[type, dict[str, Any]]]:
    """The flags the user gave over the ``--config FILE`` keys, through the one merge path
    (:func:`fp8dist.resolve_config`), with the commands' own default for ``fp8`` (:func:`fp8dist.train.job.default_fp8`:
    torchao where it runs; the Python API's default is none). ``extra`` dataclasses (``TrainConfig``) take their keys
    from the same file and flags; their kwargs come back routed by class."""
    import dataclasses

    from ..config.schema import route_keys
    from ..train.job import default_fp8

    own = {f.name for cls in extra for f in dataclasses.fields(cls)}
    flat = load_config_file(args.config) if args.config else {}
    keys = {f.name for section in (StrategyConfig, FP8Config) for _, f in flat_fields(section)}
    given = {k: v for k, v in vars(args).items() if k in keys or k in own}
    merged = {**flat, **given}
    jobs = route_keys({k: v for k, v in merged.items() if k in own}, extra, source=args.config or "the command line")
    options = {k: v for k, v in merged.items() if k not in own}
    config = resolve_config(options, defaults={"fp8": default_fp8()}, source=args.config or "the command line")
    return config, jobs


def add_model_source(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and the model to build on the meta device: ``--model-size`` or ``--model-config``
    (read by :func:`meta_model`, which also takes ``--pretrained DIR``'s config.json); shared by ``plan`` and
    ``estimate``."""
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file with strategy/fp8 keys; flags override it")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model-size", choices=list(LLAMA_SIZES), default="tiny",
                        help="built-in Llama preset (default: tiny)")
    source.add_argument("--model-config", metavar="JSON", help="a Hugging Face config.json of a causal LM")


def meta_model(args: argparse.Namespace):
    """The model on the meta device: ``--model-config``, else the config.json of ``--pretrained DIR``, else the
    built-in ``--model-size``."""
    import torch

    from ..train.models import build_llama, causal_lm, pretrained_config, read_model_config

    pretrained = getattr(args, "pretrained", None)
    with torch.device("meta"):
        if args.model_config is None and pretrained is None:
            return build_llama(args.model_size)
        if args.model_config is not None:
            return causal_lm(read_model_config(args.model_config), args.model_config)
        # trained in fp32 (master weights), whatever dtype the checkpoint was saved in
        return causal_lm(pretrained_config(pretrained), pretrained, dtype=torch.float32)


def quiet_cpu_noise() -> None:
    """On a CPU-only torch, an FP8 backend's library logs that its CUDA kernels did not load (torchao does), and
    torch that torchao registers enums the old way: true, and irrelevant to the user of this command. A strategy's
    engine's INFO lines (:attr:`Strategy.noisy_loggers`) are shown from WARNING up."""
    import torch

    from ..fp8 import BACKENDS, get_backend
    from ..strategies import STRATEGIES

    if not torch.cuda.is_available():
        libraries = [get_backend(backend).package for backend in BACKENDS]
        for name in ("torch.utils._pytree", *filter(None, libraries)):  # None would be the root logger
            logging.getLogger(name).setLevel(logging.ERROR)
    for name in (logger for strategy in STRATEGIES.values() for logger in strategy.noisy_loggers):
        logging.getLogger(name).setLevel(logging.WARNING)


@contextlib.contextmanager
def one_line_warnings(command: str) -> Iterator[None]:
    """Inside, warnings are shown one line each, ``fp8dist COMMAND: warning: MESSAGE``: Python's default adds the
    file and line that warned and that line's source, which say nothing to the user of a command (and named
    fp8dist's own code). Another category than UserWarning keeps its name (``FutureWarning: ...``). Python's
    format is back on the way out (a command run in-process, from a test or a notebook)."""

    def one_line(message, category, filename, lineno, line=None) -> str:
        kind = "warning" if category is UserWarning else category.__name__
        return f"fp8dist {command}: {kind}: {message}\n"

    saved, warnings.formatwarning = warnings.formatwarning, one_line
    try:
        yield
    finally:
        warnings.formatwarning = saved
