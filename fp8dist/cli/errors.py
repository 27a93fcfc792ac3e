"""How the command line ends on an error it can explain: one line ``fp8dist COMMAND: error: MESSAGE`` on stderr and
an exit code that says what happened, whether raised in the command's process or in a training rank (a spawned
rank reports it to the launching process)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..runtime.files import atomic_write_text

__all__ = ["USAGE_EXIT", "FAILED_EXIT", "INTERRUPTED_EXIT", "explained", "exit_code", "error_line",
           "report_error", "read_report"]

USAGE_EXIT = 2
"""Exit code for bad input (a value, a combination, the environment, missing memory): argparse's code for usage
errors. Nothing ran; fix the input and run again."""
FAILED_EXIT = 1
"""Exit code for a run that started as asked and failed (its loss diverged, or its gradients stayed non-finite)."""
INTERRUPTED_EXIT = 130
"""Exit code for an interrupted run (Ctrl-C): 128 + SIGINT, as shells report it."""


def explained() -> dict[type[BaseException], int]:
    """Errors whose message is the whole story, and the exit code of each (subclasses included). Some are the
    engines' (imported here, once a command runs: parsing its flags imports no engine)."""
    from ..runtime.env import LaunchError
    from ..runtime.guard import NonFiniteStepsError
    from ..plan.precision import FP8UnavailableError
    from ..train.checks import TrainingDiverged

    return {ValueError: USAGE_EXIT, TypeError: USAGE_EXIT, NotImplementedError: USAGE_EXIT, OSError: USAGE_EXIT,
            MemoryError: USAGE_EXIT, LaunchError: USAGE_EXIT, FP8UnavailableError: USAGE_EXIT,
            TrainingDiverged: FAILED_EXIT, NonFiniteStepsError: FAILED_EXIT}


def exit_code(err: BaseException) -> int | None:
    """The exit code of an error explained in one line; None for anything else (a bug: traceback)."""
    return next((code for cls, code in explained().items() if isinstance(err, cls)), None)


def error_line(command: str, message: str) -> str:
    """The one line a command prints on stderr for an error fp8dist explains: ``fp8dist COMMAND: error: MESSAGE``."""
    return f"fp8dist {command}: error: {message}"


def report_error(directory: str | os.PathLike, rank: int, err: BaseException, code: int) -> None:
    """Record a spawned rank's explained error ``err`` and its exit ``code`` as ``error_rank{rank}.json`` in
    ``directory`` (shared with the launching process), which prints it once (:func:`read_report`). Call it in the
    rank's error handler, before exiting with ``code``."""
    atomic_write_text(Path(directory) / f"error_rank{rank}.json",
                      json.dumps({"rank": rank, "type": type(err).__name__, "message": str(err), "code": code}))


def read_report(directory: str | os.PathLike) -> dict | None:
    """The lowest rank's error :func:`report_error` wrote into ``directory`` (``{"rank", "type", "message",
    "code"}``), or None when no rank reported one. The launching process calls it after the ranks exit."""
    reports = sorted(Path(directory).glob("error_rank*.json"), key=lambda p: int(p.stem.removeprefix("error_rank")))
    return json.loads(reports[0].read_text()) if reports else None
