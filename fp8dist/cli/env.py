"""``fp8dist env``: versions (and whether each is in the tested range), devices, FP8 backends, the launcher."""

from __future__ import annotations

import argparse
from typing import Any

from ..config.axis import engine_packages

__all__ = ["HELP", "add_parser", "run"]


HELP = "versions, devices, installed FP8 backends and the launcher seen"
"""The command's line in ``fp8dist --help``."""


def add_parser(sub: Any) -> None:
    sub.add_parser("env", help=HELP)


def run(args: argparse.Namespace) -> int:
    from ..pipeline.env import describe_environment

    print(describe_environment(engine_packages()))
    return 0
