"""``fp8dist env``: versions (and whether each is in the tested range), devices, FP8 backends, the launcher."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    sub.add_parser("env", help="versions, devices, installed FP8 backends and the launcher seen")


def run(args: argparse.Namespace) -> int:
    from ..fp8 import BACKENDS, get_backend
    from ..pipeline.env import describe_environment
    from ..strategies import STRATEGIES

    engines = [*(s.package for s in STRATEGIES.values()), *(get_backend(name).package for name in BACKENDS)]
    print(describe_environment(("torch", "transformers", *dict.fromkeys(p for p in engines if p))))
    return 0
