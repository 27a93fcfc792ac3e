"""Run fp8dist's command, scripts and torchrun as a user would: real subprocesses."""

from __future__ import annotations

import os
import re
import socket
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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for launchers that take --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_losses_printed(stdout: str) -> list[float]:
    """The per-step losses ``fp8dist train`` printed (lines may carry ``srun --label``'s "N: " prefix)."""
    return [float(x) for x in re.findall(r"^(?:\d+: )?step +\d+/\d+ .* loss (\d+\.\d+) \|", stdout, flags=re.M)]


def train_on_gloo_ranks(rank: int, world: int, argv: list[str]) -> list[str]:
    """``fp8dist ARGV`` (``["train", ...]``) as each rank of its launch runs it (``run_training`` with the config
    its flags give), on the dist harness's ranks: ``run_ranks(train_on_gloo_ranks, argv)``. They fork from a fork
    server that has imported torch (one per test process, started by its first ``run_ranks``), where a launch starts
    processes that each import it (~6 s of CPU apiece). Returns the lines the job printed (rank 0's)."""
    import argparse

    from fp8dist.cli import train as train_cli
    from fp8dist.train.job import run_training

    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    config, job = train_cli._config_and_job(parser.parse_args(argv))
    lines: list[str] = []
    run_training(config, job, log=lines.append)
    return lines


def assigned_names(node: object) -> list[str]:
    """The plain names a module-level statement binds by assignment (``X = ...``, ``X: T = ...``); [] for any other
    statement (the source checks in test_layers.py and test_lint.py read module bodies with it)."""
    import ast

    if isinstance(node, ast.Assign):
        return [target.id for target in node.targets if isinstance(target, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []
