"""Process group and device: found from the launcher's environment, initialized once.

Launchers recognised, in this order:
- torchrun / ``deepspeed`` / any launcher that exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``;
- SLURM ``srun`` (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``), the head node taken from
  ``MASTER_ADDR`` or ``scontrol show hostnames $SLURM_JOB_NODELIST``;
- nothing: one process, world size 1.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..config.text import plural
from .packages import package_version, supported_range
from .env_vars import LaunchError, check_variables, read
from .rendezvous import rendezvous_store, rendezvous_timeout

__all__ = ["LaunchError", "LaunchEnv", "DistEnv", "detect_launch_env", "launch_from_group", "current_launch",
           "init_distributed", "shutdown", "resolve_device", "local_world_size", "share_cpu_threads", "rank_imports",
           "peak_memory_mib"]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, read from the launcher's environment variables."""

    launcher: str
    """"env" (torchrun, deepspeed, ...), "slurm", "none", or "initialized" (a process group the user set up)."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    node_rank: int = 0
    """Index of this node in the job: torchrun's GROUP_RANK, deepspeed's CROSS_RANK or SLURM_NODEID; 0 alone."""


@dataclass(frozen=True)
class DistEnv:
    """The initialized job as fp8dist uses it."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    launcher: str


def _slurm_head_node(environ: Mapping[str, str]) -> str:
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("SLURM job without SLURM_JOB_NODELIST: set MASTER_ADDR to the head node's address.")
    if shutil.which("scontrol") is None:
        raise LaunchError("SLURM job but `scontrol` is not on PATH: set MASTER_ADDR to the head node's address.")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True)
    return out.stdout.split()[0]


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and rendezvous address from a launcher's environment variables (``environ``,
    default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    check_variables(environ)  # every variable read below, and the rest fp8dist reads later, before anything starts
    if ("RANK" in environ) != ("WORLD_SIZE" in environ):
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in environ else ("WORLD_SIZE", "RANK")
        raise LaunchError(f"{given}={environ[given]} is set but {missing} is not: a launcher sets both (and "
                          "MASTER_ADDR, MASTER_PORT) for every process, e.g. torchrun --nproc-per-node N. Set "
                          f"{missing} too, or unset {given} to run as one process.")
    if "RANK" in environ:  # and WORLD_SIZE: checked above
        launcher, names, local_name = "env", ("RANK", "WORLD_SIZE"), "LOCAL_RANK"
    elif "SLURM_PROCID" in environ and ("SLURM_STEP_NUM_TASKS" in environ or "SLURM_NTASKS" in environ):
        launcher, local_name = "slurm", "SLURM_LOCALID"
        names = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS")
    else:
        return LaunchEnv("none", 0, 1, 0, None, None)
    rank, world = read(environ, names[0]), read(environ, names[1])
    local = read(environ, local_name, rank if launcher == "env" else 0)
    addr, port = read(environ, "MASTER_ADDR"), read(environ, "MASTER_PORT")
    if launcher == "slurm":
        addr = addr or (_slurm_head_node(environ) if world > 1 else None)
        if port is None and "SLURM_JOB_ID" in environ:  # same on every task of the job, distinct between jobs
            port = 20000 + read(environ, "SLURM_JOB_ID") % 20000
    if rank >= world:
        raise LaunchError(f"{names[0]}={rank}: rank {rank} is outside world size {world} ({names[1]}={world}, ranks "
                          f"0 to {world - 1}): start every process with the same {names[1]} (the number started) "
                          f"and its own {names[0]} below it, as the launcher does.")
    if world > 1 and (addr is None or port is None):
        raise LaunchError(f"{launcher} launch with world size {world} but no rendezvous address: "
                           "set MASTER_ADDR and MASTER_PORT.")
    return LaunchEnv(launcher, rank, world, local, addr, port, _node_rank(environ))


def _node_rank(environ: Mapping[str, str]) -> int:
    return next((read(environ, n) for n in ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID") if n in environ), 0)


# processes per node, as torchrun, the deepspeed launcher and srun export it
_LOCAL_WORLD = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def local_world_size(environ: Mapping[str, str], default: int) -> int:
    """The number of processes on this node, as the launcher exports it; ``default`` when it does not."""
    return next((read(environ, n) for n in _LOCAL_WORLD if n in environ), default)


def launch_from_group(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """This process's place in a job whose default process group is already initialized (by the user, with any
    ``init_method``: ``env://``, ``tcp://``, ``file://``). The group is the truth for rank and world size; the
    local rank comes from ``LOCAL_RANK`` (or ``SLURM_LOCALID``), else ``rank % ranks per node`` (CUDA devices
    on this node, or ``LOCAL_WORLD_SIZE``). No rendezvous address is needed: the group has rendezvoused."""
    environ = os.environ if environ is None else environ
    rank, world = dist.get_rank(), dist.get_world_size()
    name = next((n for n in ("LOCAL_RANK", "SLURM_LOCALID") if n in environ), None)
    per_node = torch.cuda.device_count() if torch.cuda.is_available() else local_world_size(environ, world)
    local = read(environ, name) if name else rank % max(1, per_node)
    return LaunchEnv("initialized", rank, world, local, environ.get("MASTER_ADDR"), None, _node_rank(environ))


def current_launch() -> LaunchEnv:
    """The initialized process group's view (:func:`launch_from_group`) if there is one, else the launcher's
    environment (:func:`detect_launch_env`)."""
    return launch_from_group() if dist.is_available() and dist.is_initialized() else detect_launch_env()


def runs_on_cpu(device: str) -> bool:
    """Whether the ``device`` option puts a job started here on the CPU (``"auto"`` without CUDA)."""
    return device == "cpu" or not torch.cuda.is_available()


def aten_cpu_fp8_gemms() -> str | None:
    """Make torchao's FP8 GEMMs on this CPU run ATen's own kernel, when oneDNN's would be its reference one.

    On a CPU with AMX (amx_int8 / amx_fp16 in /proc/cpuinfo), torch sends ``torch._scaled_mm`` to oneDNN, which
    has only its reference FP8 kernel there: a 256x128x384 GEMM took 592 ms against 0.96 ms through ATen's kernel,
    bit-identical (torch 2.13, a Xeon with AMX, 2026-11-26). This turns oneDNN off for the process
    (``torch.backends.mkldnn.enabled = False``; bf16 GEMMs then also run ATen's kernels) and returns the line that
    says so; None where nothing changes. For a process that runs FP8 on the CPU (``fp8dist train`` calls it).
    """
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((set(line.split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return None
    if not flags & {"amx_int8", "amx_fp16"} or not torch.backends.mkldnn.enabled:
        return None
    torch.backends.mkldnn.enabled = False
    return ("cpu: oneDNN off for this process (its FP8 GEMM on this AMX CPU is its ~600x slower reference kernel; "
            "ATen's gives the same bits)")


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``"auto"`` -> cuda:LOCAL_RANK when CUDA is available, else cpu; ``"cuda"`` without CUDA is an error."""
    if device == "cuda" and not torch.cuda.is_available():
        raise LaunchError("device='cuda' but torch sees no CUDA device: use device='auto' or 'cpu'.")
    if runs_on_cpu(device):
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:  # two ranks on one GPU: nccl fails later, less clearly
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise LaunchError(f"LOCAL_RANK={local_rank} but torch sees {plural(count, 'CUDA device')} on this node"
                          + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "") + ": each rank "
                          f"needs its own GPU. Start at most {count} processes per node (torchrun --nproc-per-node "
                          f"{count}), or make more devices visible.")
    return torch.device("cuda", local_rank)


def init_distributed(*, device: str = "auto", backend: str | None = None,
                     timeout: datetime.timedelta | None = None) -> DistEnv:
    """Initialize the default process group from the launcher's environment, unless it already is.

    nccl on CUDA, gloo on CPU. With no launcher (world size 1) a single-process group is created in memory,
    so DDP and FSDP run the same code path as in a multi-process job.

    Args:
        device: "auto", "cpu" or "cuda".
        backend: process-group backend; None picks nccl for CUDA and gloo for CPU.
        timeout: collective timeout; None keeps torch's default. The ranks wait for each other to start for
            :data:`fp8dist.pipeline.rendezvous.RENDEZVOUS_TIMEOUT_S` (``FP8DIST_RENDEZVOUS_TIMEOUT`` seconds when
            set), then raise LaunchError saying how many joined; under torchrun its own rendezvous decides.
    """
    launch = current_launch()  # an initialized group (the user's): its rank and world size are the truth
    dev = resolve_device(device, launch.local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        return DistEnv(launch.rank, launch.world_size, launch.local_rank, dev, dist.get_backend(), launch.launcher)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    kwargs = {"timeout": timeout} if timeout is not None else {}
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent rendezvoused already
    if launch.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    elif agent and launch.launcher == "env" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        # torch 2.13's torchrun keeps one store for every attempt of the worker group, so the keys a dead attempt
        # wrote (gloo's peer addresses) are still there and a restarted rank may wait on its old peer forever
        # (1 restart in 3 hung): each attempt gets its own key prefix
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False)
        dist.init_process_group(backend, store=dist.PrefixStore(f"fp8dist/attempt_{attempt}", store),
                                rank=launch.rank, world_size=launch.world_size, **kwargs)
    elif agent:
        dist.init_process_group(backend, init_method="env://", rank=launch.rank, world_size=launch.world_size,
                                **kwargs)
    else:  # RANK/WORLD_SIZE by hand, deepspeed's launcher, SLURM: a rendezvous that gives up with a clear error
        store = rendezvous_store(launch.master_addr, launch.master_port, launch.rank, launch.world_size,
                                 rendezvous_timeout())
        dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size, **kwargs)
    if dev.type == "cpu":
        share_cpu_threads()
    return DistEnv(launch.rank, launch.world_size, launch.local_rank, dev, backend, launch.launcher)


def shutdown() -> None:
    """End a distributed run cleanly: every rank meets at a barrier, the process group is destroyed, and the
    backend's worker threads get the GIL for a moment to release their last collectives before the interpreter
    exits. Call it at the end of a successful run on every rank (after the last checkpoint or export), as
    ``torch.distributed.destroy_process_group()`` is meant to be called; not on the way out of an exception (a
    peer may still be inside a collective, and the barrier would wait for it).

    Why more than ``destroy_process_group``: a gloo worker thread releases a finished collective (its tensors kept
    alive for Python) just after the main thread was woken by its completion; if the interpreter is finalizing by
    then, taking the GIL ends that thread and ``std::terminate`` aborts the rank ("terminate called without an
    active exception") after all its work. ``destroy_process_group`` does not join those threads while FSDP's state
    still holds the group. Measured on 2 gloo ranks (examples/fsdp.py under torchrun, torch 2.13 CPU): aborts in
    1 of 12, 1 of 24 (with ``destroy_process_group``) and 1 of 40 runs (with a barrier before it); 0 of 60 with
    this wait. A no-op without a process group.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.1)  # the GIL is free: pending releases run now, not during finalization


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory: CUDA memory allocated on ``device``, or peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def share_cpu_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """Give each CPU rank of this node ``cores // ranks-per-node`` intra-op threads.

    torch gives every process all the cores, so N ranks on a node oversubscribe them N times, and OpenMP's
    spin-waiting makes that several times slower than sharing. torchrun guards against it with
    OMP_NUM_THREADS=1; the deepspeed launcher and a bare spawn do not. An OMP_NUM_THREADS set by the user or the
    launcher wins. Called by :func:`init_distributed` for CPU jobs. Returns the thread count set, or None.
    """
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ:
        return None
    local = local_world_size(environ, 1)
    if local <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // local)
    torch.set_num_threads(threads)
    return threads


def rank_imports(axes: Iterable[Any], model_module: str = "transformers.models.llama.modeling_llama") -> list[str]:
    """The heavy modules a training rank imports anyway, for a parent to import once before its ranks fork from it
    (a rank spends 5-10 s of CPU importing torch, transformers, torchao and DeepSpeed by itself): the model family's
    ``modeling_*`` module, the pipeline, and the ``rank_imports`` of each strategy and FP8 backend in ``axes``.
    Importing them starts no thread, process group or CUDA context."""
    return list(dict.fromkeys([model_module, "fp8dist.pipeline.api", *(m for a in axes for m in a.rank_imports)]))


def _version_line(name: str) -> str:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    version, wanted = package_version(name), supported_range(name)
    if version is None or not wanted:
        return f"{name:<20} {version or 'not installed'}"
    try:
        inside = SpecifierSet(wanted).contains(Version(version), prereleases=True)
    except InvalidVersion:
        inside = False
    verdict = "in range" if inside else "OUTSIDE the range fp8dist supports: install a version in range"
    return f"{name:<20} {version} ({verdict} {wanted})"


def describe_environment(packages: Sequence[str] = ("torch", "transformers")) -> str:
    """Versions of ``packages`` (each checked against the range fp8dist supports; ``fp8dist env`` adds every
    strategy's and FP8 backend's library), devices, FP8 capability and the launcher seen: what ``fp8dist env``
    prints."""
    from ..fp8 import fp8_hardware_reason
    from ..plan.hardware import find_gpu, hardware_of

    lines = [_version_line(name) for name in packages]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            hardware = hardware_of(torch.device("cuda", i))
            fp8 = "no FP8 tensor cores (sm < 8.9)" if fp8_hardware_reason(hardware) else "FP8 tensor cores"
            lines.append(f"cuda:{i:<15} {hardware.name} ({hardware.sm}, {fp8})")
            lookup = find_gpu(hardware)  # the figures the FP8 speed prediction reads
            lines.append(f"{'':<20} {lookup.spec.describe() if lookup.spec else lookup.reason}")
    else:
        lines.append(f"{'device':<20} cpu only (gloo); torchao float8 runs here, TE and MS-AMP need CUDA sm >= 8.9")
    launch = current_launch()
    lines.append(f"{'launcher':<20} {launch.launcher} (rank {launch.rank} of {launch.world_size})")
    return "\n".join(lines)
