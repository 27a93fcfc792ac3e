"""CPU seconds of ``fp8dist plan``/``estimate --target`` after imports: the command run twice in one process, the
second call timed (``time.process_time``, user + sys of this process), every import then done. Usage:
``python benchmarks/planner/measure.py estimate --model-config CONFIG.json --target h100 --world-size 8 ...``."""

from __future__ import annotations

import contextlib
import io
import sys
import time

from fp8dist.cli import main


def cpu_seconds(argv: list[str]) -> float:
    """The process CPU seconds of one ``fp8dist`` call (its output discarded)."""
    start = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"fp8dist {' '.join(argv)} exited {code}")
    return time.process_time() - start


if __name__ == "__main__":
    first, second = cpu_seconds(sys.argv[1:]), cpu_seconds(sys.argv[1:])
    print(f"first call (with its imports) {first:.2f} CPU s; second call (after imports) {second:.2f} CPU s")
