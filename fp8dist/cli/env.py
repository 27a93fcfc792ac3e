"""``fp8dist env``: versions (and whether each is in the tested range), devices, FP8 backends, the launcher."""

from __future__ import annotations

import argparse
from typing import Any

from ..config.axis import engine_packages
from ..pipeline.env import describe_environment

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    sub.add_parser("env", help="versions, devices, installed FP8 backends and the launcher seen")


def run(args: argparse.Namespace) -> int:
    print(describe_environment(engine_packages()))
    return 0
