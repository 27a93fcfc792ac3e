"""The rendezvous of a job launched without torchrun's agent (``RANK``/``WORLD_SIZE`` set by hand or by a script,
SLURM ``srun``): rank 0 hosts a TCP store at ``MASTER_ADDR:MASTER_PORT``, every rank checks in, and a rank that
waits too long stops with an error naming what is missing instead of hanging silently.

torch's own ``env://`` rendezvous waits for the default collective timeout (30 minutes on gloo) without a word
and then reports a store timeout. torchrun's agent has its own rendezvous (``--rdzv-conf join_timeout=``); jobs
under it keep ``env://``.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Mapping

import torch.distributed as dist

__all__ = ["LaunchError", "RENDEZVOUS_TIMEOUT_S", "TIMEOUT_VARIABLE", "rendezvous_timeout", "rendezvous_store"]

RENDEZVOUS_TIMEOUT_S = 600.0
"""How long the ranks wait for each other to start, by default: torchrun's own rendezvous default
(``join_timeout``, 600 s), long enough for the nodes of a SLURM job that start minutes apart."""

TIMEOUT_VARIABLE = "FP8DIST_RENDEZVOUS_TIMEOUT"
"""The environment variable that changes it (seconds): torch has none for its ``env://`` rendezvous, and the
launcher's environment is where the rest of the rendezvous (``MASTER_ADDR``, ``WORLD_SIZE``) is set."""

_NOTICE_S = 30.0  # a job still waiting after this long says so, once
_JOINED = "fp8dist/rendezvous/joined"


class LaunchError(RuntimeError):
    """The launcher's environment is incomplete or inconsistent, or the ranks did not meet (says what to set)."""


def rendezvous_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds to wait for every rank: ``FP8DIST_RENDEZVOUS_TIMEOUT`` when set (a positive number), else
    :data:`RENDEZVOUS_TIMEOUT_S`."""
    environ = os.environ if environ is None else environ
    text = environ.get(TIMEOUT_VARIABLE)
    if text is None:
        return RENDEZVOUS_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise LaunchError(f"{TIMEOUT_VARIABLE}={text!r} must be a positive number of seconds (default "
                    f"{RENDEZVOUS_TIMEOUT_S:.0f}).")
    return value


def rendezvous_store(addr: str, port: int, rank: int, world: int, timeout_s: float) -> dist.Store:
    """A store every one of the ``world`` ranks has checked into, for ``init_process_group(store=...)``; LaunchError
    (naming the address, how many ranks joined and the way out) when that takes longer than ``timeout_s``."""
    where = f"{addr}:{port}"
    longer = f"{TIMEOUT_VARIABLE}=SECONDS waits longer (now {timeout_s:g} s)"
    try:
        store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, ValueError) as err:  # DistNetworkError / DistStoreError are RuntimeErrors
        if rank == 0:
            raise LaunchError(f"rank 0 could not host the rendezvous at {where} (MASTER_ADDR:MASTER_PORT): {err}. "
                              "Use an address of this machine and a free port.") from None
        raise LaunchError(f"rank {rank} of {world} could not reach rank 0 at {where} (MASTER_ADDR:MASTER_PORT) within "
                    f"{timeout_s:g} s: rank 0 is not running there. Start every rank with the same MASTER_ADDR and "
                    f"MASTER_PORT (torchrun --nnodes N --nproc-per-node M sets them); {longer}.") from None
    joined, start, noticed = store.add(_JOINED, 1), time.monotonic(), False
    while joined < world:
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise LaunchError(f"rank {rank}: only {joined} of WORLD_SIZE={world} processes joined the rendezvous at "
                        f"{where} in {timeout_s:g} s: {world - joined} never started or cannot reach it. Start all "
                        f"{world} (torchrun --nproc-per-node N sets RANK and WORLD_SIZE for each), or set WORLD_SIZE "
                        f"to the number you start; {longer}.")
        if not noticed and rank == 0 and waited > _NOTICE_S:
            print(f"fp8dist: rank 0 waiting for {world - joined} more of {world} processes at {where} (gives up "
                  f"after {timeout_s:g} s; {TIMEOUT_VARIABLE})", file=sys.stderr, flush=True)
            noticed = True
        time.sleep(0.05)
        joined = store.add(_JOINED, 0)
    return store
