"""The ``fp8dist`` command line: one module per subcommand, each with ``add_parser(sub)`` and ``run(args)``. Flags
are config dataclass fields (default and help from there), over the keys of a ``--config FILE``. The library never
imports the CLI."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..pipeline.env import LaunchError, detect_launch_env
from . import bench, ds_config, env, estimate, launch, plan, probe, train
from .common import one_line_warnings, quiet_cpu_noise
from .errors import error_line, exit_code
from .launch import LAUNCH_DIR

__all__ = ["main", "LAUNCH_DIR"]

COMMANDS = {"train": train, "plan": plan, "probe": probe, "estimate": estimate, "bench": bench, "ds-config": ds_config,
            "env": env, "launch": launch}  # in the order fp8dist --help lists them


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fp8dist`` command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="fp8dist", description="FP8 training on sharded data parallelism.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(sub)
    args = parser.parse_args(argv)
    quiet_cpu_noise()
    try:
        with one_line_warnings(args.command):
            return COMMANDS[args.command].run(args)
    except Exception as err:  # one line for what fp8dist explains (fp8dist.cli.errors), a traceback for the rest
        code = exit_code(err)
        if code is None:
            raise
        if _leads():
            print(error_line(args.command, str(err)), file=sys.stderr)
        return code


def _leads() -> bool:
    """Every rank of a launched job checks the same flags: rank 0 says the error."""
    try:
        return detect_launch_env().rank == 0
    except LaunchError:  # the launcher's environment is what is wrong: said by every process
        return True
