"""Run fp8dist's command, scripts and torchrun as a user would: real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(cmd: list[str], *, timeout: float = 300, cwd: Path = ROOT,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion; output captured as text. ``python``, ``fp8dist`` and ``torchrun`` resolve to
    this interpreter's environment, activated or not (its bin folder leads PATH); ``env`` adds variables."""
    exe = {"python": sys.executable, "fp8dist": str(BIN / "fp8dist"), "torchrun": str(BIN / "torchrun"),
           "deepspeed": str(BIN / "deepspeed")}.get(cmd[0], cmd[0])
    # the deepspeed launcher starts `python` from PATH: make it this environment's
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           **(env or {})}
    return subprocess.run([exe, *cmd[1:]], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` picks a free port itself, so parallel tests do not collide."""
    return run(["torchrun", "--standalone", f"--nproc-per-node={nproc}", str(script), *args], timeout=timeout)
