"""Collective operations in which one rank can fail alone (its disk, its file, its part of a tensor): every rank
learns of the failure and raises the same error, so none waits forever in the next collective for a rank that
has left.

    on_all_ranks(f"creating {tmp}", (lambda: tmp.mkdir()) if rank == 0 else None, error=CheckpointError)

The cost is one ``all_gather_object`` of a few bytes per call: call it per file or per phase, never per tensor.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch.distributed as dist

__all__ = ["rank_world", "on_all_ranks", "RankFailure"]

T = TypeVar("T")


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class RankFailure(Exception):
    """A failure of rank ``rank`` that this rank already knows of (a collective inside the action shared it, as
    torch.distributed.checkpoint does): :func:`on_all_ranks` names ``rank``, not the rank that raised this."""

    def __init__(self, rank: int, detail: str):
        super().__init__(detail)
        self.rank, self.detail = rank, detail


def _report(err: Exception, rank: int, error: type[Exception],
            passthrough: tuple[type[Exception], ...]) -> tuple[int, str, type[Exception], bool]:
    """(rank that failed, what failed, the class every rank raises, whether it is a ``passthrough`` error)."""
    if isinstance(err, RankFailure):
        return err.rank, err.detail, error, False
    if isinstance(err, passthrough):
        return rank, str(err), type(err), True
    return rank, f"{type(err).__name__}: {err}", error, False


def on_all_ranks(what: str, action: Callable[[], T] | None, *, error: type[Exception],
                 passthrough: tuple[type[Exception], ...] = (), way_out: str = "") -> T | None:
    """Run ``action`` on this rank (None: this rank has nothing to do), then learn from every rank whether its
    action worked; if any failed, raise on every rank the same error, naming ``what`` and the first rank that
    failed (the failing rank chains its own exception). Call it on every rank, in the same order.

    Args:
        what: the operation, as the message names it ("saving ckpt/step_00000002 (writing ...)").
        action: this rank's part; an ``Exception`` it raises is the failure (``KeyboardInterrupt`` is not caught).
        error: the class every rank raises (it takes one message).
        passthrough: classes of errors whose message is complete in itself (a refusal naming the way out): such
            a failure keeps its class on every rank, and its message too when every rank raised the same.
        way_out: a sentence the message ends with (what to do about it).

    Returns:
        ``action()``'s result on this rank (None where ``action`` is None).

    Raises:
        error: on every rank, when ``action`` raised on any rank (or the ``passthrough`` class raised).
    """
    failure: Exception | None = None
    result = None
    if action is not None:
        try:
            result = action()
        except Exception as err:  # shared below: every rank raises, none hangs waiting for this one
            failure = err
    rank, world = rank_world()
    mine = None if failure is None else _report(failure, rank, error, passthrough)
    reports: list[Any] = [mine]
    if world > 1:
        reports = [None] * world
        dist.all_gather_object(reports, mine)
    failed = sorted((r for r in reports if r is not None), key=lambda r: r[0])
    if not failed:
        return result
    first, detail, cls, own = failed[0]
    ranks = {r[0] for r in failed}
    everywhere = len(ranks) == world and len({r[1] for r in failed}) == 1  # not one rank's: said once
    where = "" if everywhere else f" on rank {first}" + (
        f" (also on rank {', '.join(map(str, sorted(ranks - {first})))})" if len(ranks) > 1 else "")
    message = detail if everywhere and own else f"{what} failed{where}: {detail}"  # a refusal: as raised
    if way_out:
        message += ("" if message.endswith((".", ")")) else ".") + f" {way_out}"
    raise cls(message) from failure
