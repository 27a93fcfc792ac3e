"""What several subcommands share: the model built on the meta device, the Config of the flags and ``--config`` file,
and quieter logs and warnings. The engines (torch, transformers) are imported by the functions that use them, after
the flags parse."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..train.config import LLAMA_SIZES

if TYPE_CHECKING:
    from ..config.resolve import Config

__all__ = ["add_model_source", "meta_model", "config_from_args", "FP8_DEFAULT_HELP", "quiet_cpu_noise",
           "one_line_warnings"]

FP8_DEFAULT_HELP = "torchao where it runs (torchao installed; CPU or CUDA sm_89+), else none"
"""Every subcommand's ``--fp8`` default, as its help shows it (the Python API's is none)."""


def config_from_args(args: argparse.Namespace,
                     extra: tuple[type, ...] = ()) -> tuple[Config, dict[type, dict[str, Any]]]:
    """The Config of the flags given over the ``--config FILE`` keys, with the commands' default ``fp8``, and the
    kwargs of each ``extra`` dataclass (``TrainConfig``) from the same file and flags, by class."""
    from ..config.resolve import FP8Config, StrategyConfig, load_config_file, resolve_config
    from ..config.schema import flat_fields, route_keys
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
    """Add to the subcommand parser ``p`` ``--config FILE`` and the flags choosing the model :func:`meta_model`
    builds: ``--model-size`` or ``--model-config`` (one of them)."""
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
    """On a CPU-only torch, silence the FP8 libraries' and torch's notes about CUDA kernels and enums (true, and
    irrelevant to the user); a strategy's ``noisy_loggers`` show WARNING up."""
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
    """Inside, a warning is one line, ``fp8dist COMMAND: warning: MESSAGE`` (another category than UserWarning keeps
    its name), without the file, line and source Python adds."""

    def one_line(message, category, filename, lineno, line=None) -> str:
        kind = "warning" if category is UserWarning else category.__name__
        return f"fp8dist {command}: {kind}: {message}\n"

    saved, warnings.formatwarning = warnings.formatwarning, one_line
    try:
        yield
    finally:
        warnings.formatwarning = saved
