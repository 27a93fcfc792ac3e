"""A small multi-process harness on the model of PyTorch's MultiProcessTestCase.

``run_ranks(fn, *args, world_size=2)`` starts ``world_size`` real processes, each joining a gloo process group
that rendezvous through a file in a fresh temp dir (no ports, so it is safe under ``pytest -n auto``), runs
``fn(rank, world_size, *args)`` and returns every rank's return value to the test, in rank order.

gloo ranks are forked from a fork server (one per test process, started at its first ``run_ranks``) that has
imported what every rank imports (tests/rank_preload.py: torch, transformers, torchao, fp8dist, DeepSpeed and its
CPU ops): a spawned rank spent 85% of its CPU time on those imports, ~8 s per rank, and on a busy 2-core machine
that, not the training, was the test's time. A forked rank then takes the test's current environment, working
directory, sys.path, stdout and stderr, as a spawned one inherits them. nccl (CUDA) ranks are spawned: CUDA must
not be touched before a fork.

- A rank that raises fails the test with every rank's traceback.
- A per-call timeout: hung ranks are asked for a stack dump of all their threads (faulthandler on SIGUSR1),
  then killed; the test fails with those dumps.
- ``pytest.skip`` inside a rank is passed back as an exit code and skips the test.

``fn`` must be a module-level function (it is pickled by reference into the rank processes).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest

SKIP_EXIT_CODE = 77
DEFAULT_TIMEOUT_S = 240.0


def _rank_entry(fn: Callable[..., Any], rank: int, world_size: int, workdir: str, args: tuple,
                backend: str = "gloo", test: _TestProcess | None = None) -> None:
    if test is not None:  # forked from the fork server: become what a rank spawned by the test would be
        test.adopt()
    work = Path(workdir)
    dump = open(work / f"stack.{rank}", "w")
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only: no interface guessing, no traffic off the box
    import torch
    import torch.distributed as dist

    if backend == "gloo":
        torch.set_num_threads(1)  # several CPU ranks share two cores
    code = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{work / 'rendezvous'}", rank=rank,
                                world_size=world_size)
        # every rank's connections made before any rank may leave: a rank that skipped at once exited while its
        # peer was still connecting, and the peer failed in gloo's connectFullMesh ("Connection closed by peer")
        dist.barrier()
        result = fn(rank, world_size, *args)
        with open(work / f"result.{rank}", "wb") as f:
            pickle.dump(result, f)
    except pytest.skip.Exception as skip:
        (work / f"skip.{rank}").write_text(str(skip))
        code = SKIP_EXIT_CODE
    except BaseException:
        (work / f"error.{rank}").write_text(traceback.format_exc())
        code = 1
    finally:
        if dist.is_initialized() and code == 0:
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a rank with a failed peer must not hang in atexit handlers


class _TestProcess:
    """The test process's environment, working directory, sys.path and pid, for a forked rank to adopt."""

    def __init__(self):
        self.environ, self.cwd, self.path, self.pid = dict(os.environ), os.getcwd(), list(sys.path), os.getpid()

    def adopt(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path
        for fd in (1, 2):  # where the test's output goes now (pytest's capture), not where the server's went
            try:
                target = os.open(f"/proc/{self.pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
            except OSError:  # not reopenable (a socket): keep the server's
                continue
            os.dup2(target, fd)
            os.close(target)


def _context(backend: str) -> tuple[Any, _TestProcess | None]:
    if backend != "gloo" or _cuda_available():
        return multiprocessing.get_context("spawn"), None
    _start_fork_server()
    return multiprocessing.get_context("forkserver"), _TestProcess()


def _start_fork_server() -> None:
    """Start this process's fork server once, with tests/rank_preload.py imported. Python 3.11's fork server does
    not apply the sys.path it is given before importing, so the tests folder reaches it through PYTHONPATH, for its
    start only. Should the preload fail, the server runs without it and ranks import what they need themselves."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(["rank_preload"])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *([saved] if saved else [])])
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = DEFAULT_TIMEOUT_S,
              backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results in rank order.
    ``backend="nccl"`` puts rank r on cuda:r (GPU tests)."""
    ctx, test = _context(backend)
    with tempfile.TemporaryDirectory(prefix="fp8dist-ranks-") as workdir:
        work = Path(workdir)
        procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, workdir, args, backend, test),
                             name=f"rank{r}") for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        timed_out = False
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0, SKIP_EXIT_CODE) for p in procs):
                failed_at = now  # peers of a failed rank usually hang in a collective: give them a moment
            if now > deadline or (failed_at is not None and now > failed_at + 15):
                timed_out = now > deadline
                for p in procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGUSR1)
                time.sleep(1.0)
                for p in procs:
                    if p.is_alive():
                        p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.join()
        codes = [p.exitcode for p in procs]
        if codes == [SKIP_EXIT_CODE] * world_size or (SKIP_EXIT_CODE in codes and set(codes) <= {0, SKIP_EXIT_CODE}):
            pytest.skip(_read(work / f"skip.{codes.index(SKIP_EXIT_CODE)}"))
        if timed_out or any(c != 0 for c in codes):
            report = [f"{fn.__name__} on {world_size} ranks: exit codes {codes}"
                      + (f", timed out after {timeout:.0f}s" if timed_out else "")]
            for r in range(world_size):
                text = _read(work / f"error.{r}") or _read(work / f"stack.{r}") or "(no traceback: killed or exited)"
                report.append(f"--- rank {r} (exit {codes[r]}) ---\n{text}")
            pytest.fail("\n".join(report), pytrace=False)
        results = []
        for r in range(world_size):
            with open(work / f"result.{r}", "rb") as f:
                results.append(pickle.load(f))
        return results
