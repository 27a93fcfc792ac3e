import os
import sys
from pathlib import Path

import pytest

# Spawned ranks import test modules by name: make the tests folder importable for them as well.
sys.path.insert(0, str(Path(__file__).parent))

# Every process the suite starts (ranks, the CLI, examples, launchers) loads tests/site/sitecustomize.py, which turns
# oneDNN off on a CPU whose oneDNN has only its reference FP8 GEMM (AMX hosts: ~600x slower, same bits; its
# docstring has the figures); this process applies it too. Elsewhere it changes nothing.
_SITE = Path(__file__).parent / "site"
os.environ["PYTHONPATH"] = os.pathsep.join([str(_SITE), *filter(None, [os.environ.get("PYTHONPATH")])])
sys.path.insert(0, str(_SITE))
import sitecustomize as _host_kernels  # noqa: E402  (installs its import hook when torch is not imported yet)

if _host_kernels._has_amx() and "torch" in sys.modules:
    sys.modules["torch"].backends.mkldnn.enabled = False

# Python writes the bytecode of the modules the tests import, once, for every later process to read: the install
# (README, CI) runs pip with --no-compile, and byte-compiling every installed file up front cost ~31 s of CI for the
# few thousand of ~12,700 files the suite imports. With PYTHONDONTWRITEBYTECODE set (some shells and containers do),
# every fresh process would compile them again (~9 s of CPU each); the variable stays unset for the test processes.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The suite runs more processes than the machine has cores (two xdist workers, each test's ranks, launchers): an
# OpenMP thread that finished its share of a parallel region spins for the next one (libgomp's default), taking a
# core another process is waiting for. Passive threads sleep instead; no number changes. Set before torch loads
# libgomp here, and inherited by every process the tests start. The whole suite on 2 cores (2026-11-25): 906 CPU-s
# in 467 s passive, 945 CPU-s in 485 s spinning; the plain-python example (2 threads) 14.7 s vs 21.1 s.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(session, config, items):
    """Modules holding a test marked slow run first: with two xdist workers on two cores, a long test left for the
    end of the run keeps one core idle while the other finishes it; short tests fill the end instead. pyproject's
    --dist loadscope hands each module to one worker, in this order (--no-loadscope-reorder), so a module fixture (a
    training run of 10-60 s that several tests read) is set up once: dealt test by test, it ran once per worker."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)  # stable: the order within each group stays


@pytest.fixture
def one_rank_group():
    """A 1-process gloo group in this pytest process, removed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
