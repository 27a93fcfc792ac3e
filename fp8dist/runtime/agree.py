"""What every rank of a job must agree on (:func:`check_ranks_agree`: other settings on one rank hang the first
step, other weights train a silent mixture), and failures no rank may hide (:func:`on_all_ranks`: a rank failing
alone leaves the others waiting forever in the next collective)."""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
from collections.abc import Iterator
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["check_ranks_agree", "RanksDisagreeError", "rank_world", "on_all_ranks", "RankFailure", "alone"]

_T = TypeVar("_T")
_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8dist_alone", default=False)


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Inside, this process works on its own even within a job (the numerics probe on one rank)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size of the default process group; (0, 1) without one, or :func:`alone`."""
    if dist.is_available() and dist.is_initialized() and not _ALONE.get():
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


def on_all_ranks(what: str, action: Callable[[], _T] | None, *, error: type[Exception],
                 passthrough: tuple[type[Exception], ...] = (), way_out: str = "") -> _T | None:
    """Run ``action`` on this rank (None: nothing to do here) and return its result; if it raised an ``Exception``
    on any rank, raise ``error`` on every rank, naming ``what`` and the first rank that failed, ending with
    ``way_out``. A ``passthrough`` error (a refusal complete in itself) keeps its class, and its message when every
    rank raised the same. Call it on every rank in the same order; one small ``all_gather_object``: per file or
    phase, never per tensor. Example: ``on_all_ranks(f"creating {tmp}", tmp.mkdir if rank == 0 else None,
    error=CheckpointError)``."""
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


class RanksDisagreeError(ValueError):
    """The ranks of a job were given different settings, models or weights (the message says which)."""


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _fingerprint(model: nn.Module, cfg: Any, plan: Any, *, weights: bool) -> dict[str, Any]:
    """What must be equal on every rank: config (by key), plan, structure and, with ``weights``, parameter sums."""
    out: dict[str, Any] = {
        "config": cfg.to_dict(),
        "plan": _digest([(e.name, e.precision, e.converted_to) for e in plan]),
        "structure": _digest([(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]),
    }
    params = [p for p in model.parameters() if not p.is_meta]
    if weights and params:
        sums = torch.stack([p.detach().float().sum() + (p.detach().float().flatten()[::97]).sum() for p in params])
        out["weights"] = _digest([round(float(x), 4) for x in sums.double().cpu()])
    return out


def _differences(prints: list[dict[str, Any]]) -> list[str]:
    first = prints[0]
    lines = []
    for key in sorted({k for k, v in first["config"].items() if any(p["config"].get(k) != v for p in prints)}):
        values = ", ".join(f"rank {r} {p['config'].get(key)!r}" for r, p in enumerate(prints))
        lines.append(f"option {key}: {values}")
    for part, what in (("structure", "model structure (parameter names, shapes, dtypes)"),
                       ("plan", "precision plan"), ("weights", "weights")):
        other = [r for r, p in enumerate(prints) if p.get(part) != first.get(part)]
        if other and (part != "plan" or not lines):  # a config difference explains a plan difference
            lines.append(f"{what}: ranks {other} differ from rank 0")
    return lines


def check_ranks_agree(model: nn.Module, cfg: Any, plan: Any, env: Any) -> None:
    """Raise :class:`RanksDisagreeError` on every rank when the ranks' fingerprints differ (one all-gather), before
    ``wrap_model`` converts or shards anything. Weights are compared only with ``check_ranks="all"``, where the
    strategy does not copy rank 0's and they do not come later (a meta model, ``pretrained=``). ``model``: the
    unwrapped model; ``cfg``: its resolved config (``check_ranks``: "off", "settings" or "all"); ``plan``: its
    precision plan; ``env``: this rank's :class:`~fp8dist.runtime.env.DistEnv`. Collective: call it on every rank;
    it returns at once for one process or ``check_ranks="off"``."""
    level = cfg.parallel.check_ranks
    if level == "off" or env.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    weights = level == "all" and cfg.parallel.pretrained is None and not plan.facts.broadcasts_weights
    mine = _fingerprint(model, cfg, plan, weights=weights)
    prints: list[Any] = [None] * env.world_size
    dist.all_gather_object(prints, mine)
    differ = _differences(prints)
    if differ:
        raise RanksDisagreeError(
            "the ranks of this job were given different models or settings: " + "; ".join(differ) + ". Every rank "
            "must build the same model (same seed or checkpoint) and call wrap_model with the same options; pass "
            "check_ranks='settings' where weights differ on purpose, or check_ranks='off'.")
