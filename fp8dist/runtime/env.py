"""Process group and device, from the launcher's environment: ``RANK``/``WORLD_SIZE`` (torchrun, deepspeed, ...),
else SLURM's ``SLURM_PROCID``/``SLURM_NTASKS`` (head node from ``MASTER_ADDR`` or ``scontrol``), else one process."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..config.text import plural
from .env_vars import LaunchError, check_variables, read
from .rendezvous import rendezvous_store, rendezvous_timeout

__all__ = ["LaunchError", "LaunchEnv", "DistEnv", "detect_launch_env", "current_launch", "init_distributed", "shutdown",
           "resolve_device", "local_world_size", "share_cpu_threads", "rank_imports", "peak_memory_mib"]


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, read from the launcher's environment variables."""

    launcher: str
    """"env" (torchrun, deepspeed, ...), "slurm", "none", or "initialized" (a process group the user set up)."""
    rank: int
    """This process's global rank (0 without a launcher)."""
    world_size: int
    """Processes in the job (1 without a launcher)."""
    local_rank: int
    """This process's index on its node: its CUDA device."""
    master_addr: str | None
    """The rendezvous host (``MASTER_ADDR``, or SLURM's head node); None for one process."""
    master_port: int | None
    """The rendezvous port (``MASTER_PORT``, or one derived from the SLURM job id); None for one process."""
    node_rank: int = 0
    """Index of this node in the job: torchrun's GROUP_RANK, deepspeed's CROSS_RANK or SLURM_NODEID; 0 alone."""


@dataclass(frozen=True)
class DistEnv:
    """The initialized job as fp8dist uses it (:func:`init_distributed` returns it; ``WrapInfo.env`` keeps it)."""

    rank: int
    """This process's rank in the default process group."""
    world_size: int
    """Ranks in the default process group."""
    local_rank: int
    """This process's index on its node."""
    device: torch.device
    """Where this rank's model runs: cuda:``local_rank`` or cpu."""
    backend: str | None
    """The process group's backend ("nccl", "gloo")."""
    launcher: str
    """What started the job: as :attr:`LaunchEnv.launcher`."""


def _slurm_head_node(environ: Mapping[str, str]) -> str:
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("SLURM job without SLURM_JOB_NODELIST: set MASTER_ADDR to the head node's address.")
    if shutil.which("scontrol") is None:
        raise LaunchError("SLURM job but `scontrol` is not on PATH: set MASTER_ADDR to the head node's address.")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True)
    return out.stdout.split()[0]


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Rank, world size and rendezvous address from a launcher's environment variables (``environ``; default
    ``os.environ``): torchrun / the deepspeed launcher (``RANK``, ``WORLD_SIZE``, ``MASTER_*``), else SLURM's
    ``SLURM_*`` (the head node from ``scontrol`` and a port from the job id where not set), else one process
    (launcher "none"). Call it before the process group starts; :func:`current_launch` once it has.

    Raises:
        LaunchError: a variable fp8dist reads has a bad value, ``RANK`` without ``WORLD_SIZE`` (or the reverse), a
            rank outside the world size, several ranks without a rendezvous address, or a SLURM job whose head node
            cannot be found (no ``SLURM_JOB_NODELIST``, no ``scontrol``).
    """
    environ = os.environ if environ is None else environ
    check_variables(environ)  # every variable read below, and the rest fp8dist reads later, before anything starts
    if ("RANK" in environ) != ("WORLD_SIZE" in environ):
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in environ else ("WORLD_SIZE", "RANK")
        raise LaunchError(f"{given}={environ[given]} is set but {missing} is not: a launcher sets both (and "
                          "MASTER_ADDR, MASTER_PORT) for every process, e.g. torchrun --nproc-per-node N. Set "
                          f"{missing} too, or unset {given} to run as one process.")
    if "RANK" in environ:  # and WORLD_SIZE: checked above
        launcher = "env"
        names = ("RANK", "WORLD_SIZE")
        local_name = "LOCAL_RANK"
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


def local_world_size(environ: Mapping[str, str], default: int) -> int:
    """The number of processes on this node, as torchrun, the deepspeed launcher or srun export it; else ``default``."""
    return next((read(environ, n) for n in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE") if n in environ),
                default)


def current_launch() -> LaunchEnv:
    """The launcher's environment (:func:`detect_launch_env`), or an initialized process group's rank and world size,
    the local rank from ``LOCAL_RANK``/``SLURM_LOCALID``, else ``rank %`` the CUDA devices (or ranks) per node."""
    if not (dist.is_available() and dist.is_initialized()):
        return detect_launch_env()
    environ = os.environ
    rank = dist.get_rank()
    world = dist.get_world_size()
    name = next((n for n in ("LOCAL_RANK", "SLURM_LOCALID") if n in environ), None)
    per_node = torch.cuda.device_count() if torch.cuda.is_available() else local_world_size(environ, world)
    local = read(environ, name) if name else rank % max(1, per_node)
    return LaunchEnv("initialized", rank, world, local, environ.get("MASTER_ADDR"), None, _node_rank(environ))


def runs_on_cpu(device: str) -> bool:
    """Whether the ``device`` option puts a job started here on the CPU (``"auto"`` without CUDA)."""
    return device == "cpu" or not torch.cuda.is_available()


def aten_cpu_fp8_gemms() -> str | None:
    """On a CPU with AMX, turn oneDNN off for this process and return the line that says so (None: nothing changed).

    There torch sends ``torch._scaled_mm`` to oneDNN's reference FP8 kernel: a 256x128x384 GEMM took 592 ms against
    0.96 ms through ATen's, bit-identical (torch 2.13, a Xeon with AMX, 2026-11-26). For a process running FP8 on CPU;
    its bf16 GEMMs then run ATen's kernels too.
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
    """The torch device of the ``device`` option for the rank with ``local_rank`` on its node: ``"auto"`` ->
    cuda:``local_rank`` when CUDA is available, else cpu; ``"cpu"`` -> cpu; ``"cuda"`` -> cuda:``local_rank``.

    Raises:
        LaunchError: ``"cuda"`` without a CUDA device, or ``local_rank`` beyond the devices this node sees (more
            ranks per node than GPUs).
    """
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
    """Initialize the default process group from the launcher's environment, unless it already is (then the
    existing group's rank and world size are used as they are). ``wrap_model`` calls it; call it yourself only to
    have the group before ``wrap_model`` (e.g. to build a ``DeviceMesh``). Sets this rank's CUDA device.

    With no launcher (world size 1) a single-process group is created in memory, so DDP and FSDP run the same code
    path as in a multi-process job.

    Args:
        device: "auto", "cpu" or "cuda".
        backend: process-group backend; None picks nccl for CUDA and gloo for CPU.
        timeout: collective timeout; None keeps torch's default. The ranks wait for each other to start for
            ``FP8DIST_RENDEZVOUS_TIMEOUT`` seconds (default 600), then raise LaunchError saying how many joined;
            under torchrun its own rendezvous decides.

    Returns:
        The :class:`DistEnv` of this rank.

    Raises:
        LaunchError: the launcher's variables are inconsistent (:func:`detect_launch_env`), the device cannot be had
            (:func:`resolve_device`), or the other ranks did not join within the rendezvous timeout.
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
        # torchrun (torch 2.13) keeps one store for every attempt: a dead attempt's keys hung 1 restart in 3
        store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False)
        prefix = f"fp8dist/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}"
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=launch.rank,
                                world_size=launch.world_size, **kwargs)
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
    """End a distributed run cleanly: a barrier, ``destroy_process_group``, then a moment for the backend's worker
    threads to release their last collectives. Call it on every rank at the end of a successful run (after the last
    checkpoint or export), not on the way out of an exception (the barrier would wait for a peer inside a
    collective). A no-op without a process group.

    Why the wait: a gloo worker releasing a finished collective while the interpreter finalizes aborts the rank
    ("terminate called without an active exception"), and ``destroy_process_group`` does not join those threads
    while FSDP's state still holds the group. On 2 gloo ranks (examples/fsdp.py, torch 2.13 CPU) 1 run in 12
    aborted with no cleanup, 1 in 24 with ``destroy_process_group`` alone, 1 in 40 with a barrier before it, 0 of 60
    with this wait.
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
    """Give each CPU rank of this node ``cores // ranks-per-node`` intra-op threads (torch gives each all the cores:
    N ranks oversubscribe them N times); returns the count set, or None (one rank, or ``OMP_NUM_THREADS`` set)."""
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ or (local := local_world_size(environ, 1)) <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // local)
    torch.set_num_threads(threads)
    return threads


def rank_imports(axes: Iterable[Any], model_module: str = "transformers.models.llama.modeling_llama") -> list[str]:
    """The heavy modules a training rank imports anyway (5-10 s of CPU per rank), for a parent to import once before
    its ranks fork: the model's ``modeling_*`` module, the pipeline, and each axis's ``rank_imports``. Importing
    them starts no thread, process group or CUDA context."""
    return list(dict.fromkeys([model_module, "fp8dist.pipeline.api", *(m for a in axes for m in a.rank_imports)]))
