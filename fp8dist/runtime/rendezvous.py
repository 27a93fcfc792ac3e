"""The rendezvous of a job launched without torchrun's agent (``RANK``/``WORLD_SIZE`` by hand, SLURM): rank 0 hosts a
TCP store at ``MASTER_ADDR:MASTER_PORT`` and a rank that waits longer than ``FP8DIST_RENDEZVOUS_TIMEOUT`` (connection
included) stops with an error naming what is missing, where torch's ``env://`` waits 30 minutes without a word."""

from __future__ import annotations

import contextlib
import datetime
import errno
import ipaddress
import os
import socket
import stat
import sys
import threading
import time
from typing import Any, Mapping

import torch.distributed as dist

from .env_vars import RENDEZVOUS_TIMEOUT_S, TIMEOUT_VARIABLE, LaunchError, read

__all__ = ["LaunchError", "RENDEZVOUS_TIMEOUT_S", "TIMEOUT_VARIABLE", "rendezvous_timeout", "rendezvous_store"]

_NOTICE_S = 30.0  # a job still waiting after this long says so, once
_JOINED = "fp8dist/runtime/rendezvous/joined"
_POLL_S = 0.1  # after the timeout, how often a rank given up on rank 0 looks for the connection to close
_FREE_PORT = "choose a free MASTER_PORT, the same for every rank"


def rendezvous_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds to wait for every rank: ``FP8DIST_RENDEZVOUS_TIMEOUT`` when set, else :data:`RENDEZVOUS_TIMEOUT_S`."""
    return read(os.environ if environ is None else environ, TIMEOUT_VARIABLE, RENDEZVOUS_TIMEOUT_S)


def rendezvous_store(addr: str, port: int, rank: int, world: int, timeout_s: float) -> dist.Store:
    """A store all ``world`` ranks have checked into, for ``init_process_group(store=...)``; LaunchError naming how
    many joined and the way out when that takes longer than ``timeout_s`` (the connection to rank 0 included)."""
    start = time.monotonic()
    where = f"{addr}:{port}"
    store = _connect(addr, port, rank, world, timeout_s)
    joined, noticed = _count(store, 1, rank, where), False
    while joined < world:
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise LaunchError(f"rank {rank}: only {joined} of WORLD_SIZE={world} processes joined the rendezvous at "
                              f"{where} in {timeout_s:g} s: {world - joined} never started or cannot reach it. Start "
                              f"all {world} (torchrun --nproc-per-node N sets RANK and WORLD_SIZE for each), or set "
                              f"WORLD_SIZE to the number you start; {TIMEOUT_VARIABLE}=SECONDS waits longer (now "
                              f"{timeout_s:g} s).")
        if not noticed and rank == 0 and waited > _NOTICE_S:
            print(f"fp8dist: rank 0 waiting for {world - joined} more of {world} processes at {where} (gives up "
                  f"after {timeout_s:g} s; {TIMEOUT_VARIABLE})", file=sys.stderr, flush=True)
            noticed = True
        time.sleep(0.05)
        joined = _count(store, 0, rank, where)
    return store


def _connect(addr: str, port: int, rank: int, world: int, timeout_s: float) -> dist.Store:
    """Rank 0's store, or a client of it within ``timeout_s``; else LaunchError saying what is there."""
    store, err, unanswered = _make_store(addr, port, rank, world, timeout_s)
    if store is not None:
        return store
    where = f"{addr}:{port} (MASTER_ADDR:MASTER_PORT)"
    if rank == 0 and unanswered:  # the store listens here, and MASTER_ADDR leads to another machine's program
        raise LaunchError(f"rank 0 hosts the rendezvous on port {port} of this machine, but the program at {where} "
                          f"accepted a connection and did not answer as it within {timeout_s:g} s: MASTER_ADDR names "
                          "another machine. Set it to this machine's address, the same for every rank.")
    if rank == 0 and _in_use(port):
        raise LaunchError(f"rank 0 cannot host the rendezvous at {where}: port {port} is in use by another program "
                          f"on this machine. Stop that program (ss -ltnp 'sport = :{port}' names it), or "
                          f"{_FREE_PORT}.")
    if rank == 0:
        raise LaunchError(f"rank 0 could not host the rendezvous at {where}: {str(err).splitlines()[0]}. Start rank 0 "
                          f"on the machine MASTER_ADDR names, and {_FREE_PORT}.")
    if unanswered:
        raise LaunchError(f"rank {rank} of {world}: the program at {where} accepted a connection but did not answer "
                          f"as rank 0's rendezvous within {timeout_s:g} s: another program holds that port. Stop it "
                          f"(ss -ltnp 'sport = :{port}' on that machine names it), or {_FREE_PORT}.")
    raise LaunchError(f"rank {rank} of {world} could not reach rank 0 at {where} within {timeout_s:g} s: rank 0 is "
                      f"not running there. Start every rank with the same MASTER_ADDR and MASTER_PORT (torchrun "
                      f"--nnodes N --nproc-per-node M sets them); {TIMEOUT_VARIABLE}=SECONDS waits longer (now "
                      f"{timeout_s:g} s).")


def _in_use(port: int) -> bool:
    """Whether another socket holds ``port`` here: a bind as torch's store binds fails with EADDRINUSE."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def _make_store(addr: str, port: int, rank: int, world: int,
                timeout_s: float) -> tuple[dist.Store | None, Exception | None, bool]:
    """(torch's store or None, its error, whether a connection to ``addr:port`` was left unanswered). torch's client
    waits for the store's first answer with no timeout (torch 2.13), so it is made in a thread, and at ``timeout_s``
    its connection is shut down: the thread ends before this returns (one inside torch at exit aborts the process)."""
    try:
        peers = {_endpoint(info[4]) for info in socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        raise LaunchError(f"rank {rank} of {world}: MASTER_ADDR={addr!r} does not resolve to an address here: set it "
                          "to rank 0's machine (an address, or a name every machine resolves), the same for every "
                          "rank.") from None
    made: dict[str, Any] = {}

    def make() -> None:
        try:
            made["store"] = dist.TCPStore(addr, port, world, is_master=rank == 0, wait_for_workers=False,
                                          timeout=datetime.timedelta(seconds=timeout_s), multi_tenant=True)
        except (RuntimeError, ValueError) as err:  # DistNetworkError and DistStoreError are RuntimeErrors
            made["error"] = err

    before = set(_socket_fds())
    thread = threading.Thread(target=make, name="fp8dist-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s)
    unanswered = False
    while thread.is_alive():  # torch's own deadline, the same timeout, has passed: it does not try again for long
        unanswered |= _close_connections(set(_socket_fds()) - before, peers)
        thread.join(_POLL_S)
    return made.get("store"), made.get("error"), unanswered


def _socket_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                fds.append(int(name))
    return fds


def _endpoint(address: tuple) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """(IP, port) of a socket address, IPv4 the same when IPv6-mapped (torch's client: ``::ffff:127.0.0.1``)."""
    ip = ipaddress.ip_address(address[0].split("%")[0])
    return (ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else ip, address[1]


def _close_connections(fds: set[int], peers: set) -> bool:
    """Shut down those of ``fds`` connected to one of ``peers`` (a read waiting on them returns); whether any was."""
    closed = False
    for fd in fds:
        # OSError: not connected (yet), or closed meanwhile
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and _endpoint(sock.getpeername()) in peers:
                sock.shutdown(socket.SHUT_RDWR)
                closed = True
    return closed


def _count(store: dist.Store, add: int, rank: int, where: str) -> int:
    try:
        return store.add(_JOINED, add)
    except RuntimeError:  # DistNetworkError: the connection to rank 0 closed
        raise LaunchError(f"rank {rank}: rank 0's rendezvous at {where} closed while the ranks were meeting: rank 0 "
                          "stopped. Its own error says why; start the job again.") from None
