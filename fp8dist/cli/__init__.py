"""The ``fp8dist`` command line: one module per subcommand, each with ``add_parser(sub)`` and ``run(args)`` (and
``check_flags(args)`` where some values are checked outside argparse, still without an engine). Flags are config
dataclass fields (default and help from there), over the keys of a ``--config FILE``. The library never imports the
CLI. Parsing a command's flags imports no engine (torch, transformers, ...): a bad flag, a bad value and ``--help``
answer at once, the engines load once the flags parse."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Sequence

from . import bench, ds_config, env, estimate, launch, plan, probe, train
from .launch import LAUNCH_DIR

__all__ = ["main", "LAUNCH_DIR"]

COMMANDS = {"train": train, "plan": plan, "probe": probe, "estimate": estimate, "bench": bench, "ds-config": ds_config,
            "env": env, "launch": launch}  # in the order fp8dist --help lists them


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fp8dist`` command; returns the exit code. Only the command named has its flags built; the others
    are a line of ``fp8dist --help``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    named = next((word for word in argv if not word.startswith("-")), None)  # the top level takes no other word
    parser = argparse.ArgumentParser(prog="fp8dist", description="FP8 training on sharded data parallelism.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if name == named:
            module.add_parser(sub)
        else:
            sub.add_parser(name, help=module.HELP)
    args = parser.parse_args(argv)
    from .common import one_line_warnings, quiet_cpu_noise
    from .errors import USAGE_EXIT, error_line, exit_code

    try:  # a command's checks of its values that need no engine (bench's lists) answer before any engine loads
        getattr(COMMANDS[args.command], "check_flags", lambda args: None)(args)
    except ValueError as err:
        print(error_line(args.command, str(err)), file=sys.stderr)
        return USAGE_EXIT
    quiet_cpu_noise()
    args.data_out = sys.stdout  # where a command's --json data goes
    try:
        with one_line_warnings(args.command), _only_data_on_stdout(args.json is True if "json" in args else False):
            return COMMANDS[args.command].run(args)
    except Exception as err:  # one line for what fp8dist explains (fp8dist.cli.errors), a traceback for the rest
        code = exit_code(err)
        if code is None:
            raise
        if _leads():
            print(error_line(args.command, str(err)), file=sys.stderr)
        return code


def _only_data_on_stdout(data: bool) -> contextlib.AbstractContextManager:
    """With ``--json`` (the JSON printed to ``args.data_out``), whatever else reaches stdout goes to stderr: a
    library's log lines (DeepSpeed's handler writes to the stdout of its import) never mix with the data."""
    return contextlib.redirect_stdout(sys.stderr) if data else contextlib.nullcontext()


def _leads() -> bool:
    """Every rank of a launched job checks the same flags: rank 0 says the error."""
    from ..runtime.env import LaunchError, detect_launch_env

    try:
        return detect_launch_env().rank == 0
    except LaunchError:  # the launcher's environment is what is wrong: said by every process
        return True
