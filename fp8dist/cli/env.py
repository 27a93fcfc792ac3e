"""``fp8dist env``: versions (and whether each is in the tested range), devices, FP8 backends, the launcher."""

from __future__ import annotations

import argparse
from typing import Any

from ..config.axis import engine_packages

__all__ = ["HELP", "add_parser", "run"]


HELP = "versions, devices, installed FP8 backends and the launcher seen"
"""The command's line in ``fp8dist --help``."""


def add_parser(sub: Any) -> None:
    """Add ``fp8dist env`` and its flags to ``sub`` (the top-level parser's subparsers); called only when the
    command line names env (the other commands are a line of ``fp8dist --help``)."""
    sub.add_parser("env", help=HELP)


def run(args: argparse.Namespace) -> int:
    """Run ``fp8dist env`` with its parsed flags; returns the exit code (0: done). Raises what the library raises for
    bad values: :func:`fp8dist.cli.main` turns the errors fp8dist explains into one line and exit code 2."""
    from ..pipeline.env import describe_environment

    print(describe_environment(engine_packages()))
    return 0
