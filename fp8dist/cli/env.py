"""``fp8dist env``: versions (and whether each is in the tested range), devices, FP8 backends, the launcher."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ..config.axis import engine_packages

__all__ = ["HELP", "add_parser", "run", "describe_environment"]


HELP = "versions, devices, installed FP8 backends and the launcher seen"
"""The command's line in ``fp8dist --help``."""


def add_parser(sub: Any) -> None:
    """Add ``fp8dist env`` and its flags to ``sub`` (the top-level parser's subparsers); called only when the
    command line names env (the other commands are a line of ``fp8dist --help``)."""
    sub.add_parser("env", help=HELP)


def run(args: argparse.Namespace) -> int:
    """Run ``fp8dist env`` with its parsed flags; returns the exit code (0: done). Raises what the library raises for
    bad values: :func:`fp8dist.cli.main` turns the errors fp8dist explains into one line and exit code 2."""
    print(describe_environment(engine_packages()))
    return 0


def _version_line(name: str) -> str:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    from ..runtime.packages import package_version, supported_range

    version, wanted = package_version(name), supported_range(name)
    if version is None or not wanted:
        return f"{name:<20} {version or 'not installed'}"
    try:
        inside = SpecifierSet(wanted).contains(Version(version), prereleases=True)
    except InvalidVersion:
        inside = False
    verdict = "in range" if inside else "OUTSIDE the range fp8dist supports: install a version in range"
    return f"{name:<20} {version} ({verdict} {wanted})"


def describe_environment(packages: Sequence[str] = ("torch", "transformers")) -> str:
    """What ``fp8dist env`` prints: versions of ``packages`` against the ranges fp8dist supports, devices, FP8
    capability and the launcher seen."""
    import torch

    from ..fp8 import fp8_hardware_reason
    from ..runtime.env import current_launch
    from ..runtime.hardware import find_gpu, hardware_of

    lines = [_version_line(name) for name in packages]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            hardware = hardware_of(torch.device("cuda", i))
            fp8 = "no FP8 tensor cores (sm < 8.9)" if fp8_hardware_reason(hardware) else "FP8 tensor cores"
            lines.append(f"cuda:{i:<15} {hardware.name} ({hardware.sm}, {fp8})")
            lookup = find_gpu(hardware)  # the figures the FP8 speed prediction reads
            lines.append(f"{'':<20} {lookup.spec.describe() if lookup.spec else lookup.reason}")
    else:
        lines.append(f"{'device':<20} cpu only (gloo); torchao float8 runs here, TE and MS-AMP need CUDA sm >= 8.9")
    launch = current_launch()
    lines.append(f"{'launcher':<20} {launch.launcher} (rank {launch.rank} of {launch.world_size})")
    return "\n".join(lines)
