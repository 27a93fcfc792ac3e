"""``fp8dist launch``: the torchrun, deepspeed and SLURM scripts that ship inside the package."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["LAUNCH_DIR", "HELP", "add_parser", "run"]

LAUNCH_DIR = Path(__file__).resolve().parent.parent / "launch"
"""The launch scripts, shipped inside the package (the repository's launch/ links here)."""
_SCRIPTS = {path.stem: path.name for path in sorted(LAUNCH_DIR.glob("[!_]*.sh"))}
"""Each launcher's script by its name (``_common.sh`` is their shared part)."""


HELP = "run the launch scripts that ship with fp8dist (torchrun, deepspeed, SLURM sbatch)"
"""The command's line in ``fp8dist --help``."""


def add_parser(sub: Any) -> None:
    """Add ``fp8dist launch`` and its flags to ``sub`` (the top-level parser's subparsers); called only when the
    command line names launch (the other commands are a line of ``fp8dist --help``)."""
    p = sub.add_parser(
        "launch", help=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The scripts of the repository's launch/ folder, installed with the package:\n"
                    "  fp8dist launch torchrun [--dry-run] [fp8dist train flags | script.py ARGS | -m module ARGS]\n"
                    "  fp8dist launch deepspeed [--dry-run] [... as above]   (NODELIST / HOSTFILE for several nodes)\n"
                    "  fp8dist launch slurm torchrun|deepspeed [--dry-run] [SBATCH OPTIONS] [-- ARGS]   (submits)\n"
                    "  fp8dist launch path        print the folder that holds the scripts\n"
                    "Each script's header lists its environment variables; --dry-run prints the exact command.")
    p.add_argument("target", choices=[*_SCRIPTS, "slurm", "path"], help="what to launch")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script (slurm: sbatch options, then -- and "
                                                          "the job's arguments)")


def _sbatch_command(args: list[str]) -> tuple[list[str], bool]:
    """``slurm NAME [--dry-run] [SBATCH OPTIONS] [-- ARGS]`` -> (the sbatch command, dry run)."""
    if not args or args[0] not in _SCRIPTS:
        raise ValueError(f"fp8dist launch slurm needs a template: one of {', '.join(_SCRIPTS)} (e.g. fp8dist launch "
                         "slurm torchrun --nodes=2 -- --strategy fsdp).")
    name, rest = args[0], args[1:]
    dry = "--dry-run" in rest[: rest.index("--") if "--" in rest else len(rest)]
    if dry:
        rest.remove("--dry-run")
    options, job = (rest[: rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    return ["sbatch", *options, str(LAUNCH_DIR / "slurm" / f"{name}.sbatch"), *job], dry


def run(args: argparse.Namespace) -> int:
    """Run ``fp8dist launch`` with its parsed flags; returns the exit code (0: done). Raises what the library raises for
    bad values: :func:`fp8dist.cli.main` turns the errors fp8dist explains into one line and exit code 2."""
    if args.target == "path":
        print(LAUNCH_DIR)
        return 0
    if args.target in _SCRIPTS:
        return subprocess.run(["bash", str(LAUNCH_DIR / _SCRIPTS[args.target]), *args.args]).returncode
    command, dry = _sbatch_command(list(args.args))
    env = {**os.environ, "FP8DIST_LAUNCH_DIR": str(LAUNCH_DIR)}  # sbatch exports it: the job finds the scripts
    if dry:
        print(f"FP8DIST_LAUNCH_DIR={shlex.quote(str(LAUNCH_DIR))} {shlex.join(command)}")
        return 0
    if shutil.which("sbatch") is None:
        raise ValueError("sbatch is not on PATH: run fp8dist launch slurm on a SLURM login node (or use --dry-run to "
                         "see the command).")
    return subprocess.run(command, env=env).returncode
