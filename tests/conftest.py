import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Spawned ranks import test modules by name: make the tests folder importable for them as well.
sys.path.insert(0, str(Path(__file__).parent))

# One ninja for every process of the run. DeepSpeed JIT-builds its CPU ops with whichever `ninja` is first on PATH:
# this environment's (pip's ninja 1.13, a DeepSpeed dependency) for the launchers and CLI subprocesses, which put
# its bin folder first, and the system's (1.11) for a pytest started as `.venv/bin/python -m pytest`. Each version
# reads the other's build log as foreign and rebuilds both ops (25-70 s a rank, under the build lock), so every
# DeepSpeed test paid a rebuild. With this environment's bin folder first everywhere, the ops build once.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

from ds_ops import DS_OPS as _DS_OPS  # noqa: E402  (the tests folder is on sys.path from the line above)


def _extensions_dir() -> Path:
    """Where torch's JIT extension builds go (torch.utils.cpp_extension's default on a CPU build)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    return Path(os.path.expanduser("~")) / ".cache" / "torch_extensions" / tag


def pytest_configure(config):
    """Build DeepSpeed's CPU ops once, before any test starts. Otherwise the first DeepSpeed
    tests on every xdist worker wait together on DeepSpeed's JIT build lock (minutes on a fresh machine)."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return  # an xdist worker (the controller built them), or no workers to wait together
    if importlib.util.find_spec("deepspeed") is None:
        return
    if _has_cuda():  # CUDA builds differ; those machines build on first use
        return
    # always ask DeepSpeed: a cached build made by another environment (other include paths) is rebuilt
    todo = list(_DS_OPS)
    fresh = not all(list((_extensions_dir() / name).glob(f"{name}*.so")) for name in _DS_OPS.values())
    print(f"fp8dist tests: checking DeepSpeed's CPU ops ({', '.join(_DS_OPS.values())})"
          + ("; first build on this machine, about 1-2 minutes" if fresh else ""), flush=True)
    start = time.monotonic()
    code = "import sys; from deepspeed.accelerator import get_accelerator as a; " \
           "a().create_op_builder(sys.argv[1]).load(verbose=False)"
    procs = [subprocess.Popen([sys.executable, "-c", code, b], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for b in todo]
    for builder, proc in zip(todo, procs):
        _, err = proc.communicate()
        if proc.returncode != 0:  # the DeepSpeed tests will fail with the full error; say why here too
            print(f"fp8dist tests: building {builder} failed:\n{err[-2000:]}", file=sys.stderr)
    print(f"fp8dist tests: DeepSpeed ops ready in {time.monotonic() - start:.0f}s", flush=True)


def pytest_collection_modifyitems(session, config, items):
    """Modules holding a test marked slow run first, each module's tests kept together and in order (their module
    fixtures set up once): with two xdist workers on two cores, a long test left for the end of the run keeps one
    core idle while the other finishes it; short tests fill the end instead."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)  # stable: the order within each group stays


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture
def one_rank_group():
    """A 1-process gloo group in this pytest process, removed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
