"""Does one rank fit the target GPU's memory, and if not, what would: the estimate re-run with each way out (more
ranks, activation checkpointing, the lean level, ZeRO-3 offload). A rank's GPU bytes are its model states not in
host memory plus the modelled activations; they fit within :data:`MEMORY_FRACTION` of the GPU's memory."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

from ..memory_levels import LEVELS
from ..strategies import STRATEGIES

__all__ = ["Fit", "WayOut", "StepCheckpointing", "budget", "device_bytes", "check_fit", "ways_out", "levers",
           "step_checkpointing", "MAX_RANKS", "MEMORY_FRACTION"]

MEMORY_FRACTION = 0.9
"""Share of a GPU's memory a rank may plan on (``fp8dist bench`` too): the rest is for what the estimate leaves out,
transient buffers, the CUDA context and the allocator's fragmentation."""
MAX_RANKS = 16384
"""The most ranks the search for a rank count that fits tries; above it the way out "more ranks" is given up."""

CHECKPOINTING = ("activation checkpointing", {"activation_checkpointing": "full"})


def levers() -> tuple[tuple[str, Mapping[str, Any]], ...]:
    """The ways out tried beside more ranks, each a change of options: activation checkpointing, then each memory
    level's and strategy's ``fit_way_out``."""
    axes = (*LEVELS.values(), *STRATEGIES.values())
    return (CHECKPOINTING, *(axis.fit_way_out for axis in axes if axis.fit_way_out is not None))


@dataclass(frozen=True)
class WayOut:
    """One change of the run and the per-rank GPU bytes the estimate computes with it."""

    change: Mapping[str, Any]
    """The options changed (``world_size`` for a rank count)."""
    what: str
    """The way out in words ("more ranks", "activation checkpointing", a memory level's or strategy's own)."""
    device_bytes: int
    """Per-rank GPU bytes with the change (:func:`device_bytes`)."""
    fits: bool
    """Whether those bytes are within the budget."""


@dataclass(frozen=True)
class Fit:
    """Whether one rank of the estimate fits the target GPU, and the ways out when not."""

    gpu: str
    """The target GPU's name ("H100")."""
    capacity_bytes: int
    """Its memory in bytes."""
    device_bytes: int
    """The estimate's per-rank GPU bytes (:func:`device_bytes`)."""
    activations_counted: bool
    """False where no activation formula covers the model: judged on model states alone."""
    ways_out: tuple[WayOut, ...] = ()
    """Where it does not fit: each change tried, its bytes and whether it fits; () where it fits."""
    no_rank_count: str = ""
    """Why no rank count (up to :data:`MAX_RANKS`) fits; empty when one does or it fits."""

    @property
    def budget_bytes(self) -> int:
        """The bytes a rank may plan on: the planned fraction of the device's capacity (:func:`budget`)."""
        return budget(self.capacity_bytes)

    @property
    def fits(self) -> bool:
        """Whether the rank's predicted bytes are within :attr:`budget_bytes`."""
        return self.device_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        """The fit as JSON data: every field, whether it fits, the budget and each way out with the options it
        changes."""
        ways_out = [{**asdict(w), "change": dict(w.change)} for w in self.ways_out]
        return {**asdict(self), "fits": self.fits, "budget_bytes": self.budget_bytes, "ways_out": ways_out}

    def lines(self, size: Callable[[int], str]) -> list[str]:
        """One line saying whether a rank fits, then (when it does not) one per way out; ``size`` formats a byte
        count ("1.2 GiB"), as the caller's table does."""
        counted = "" if self.activations_counted else " (model states only: activations not estimated)"
        plan = (f"a rank may plan on {size(self.budget_bytes)}, {MEMORY_FRACTION:.0%} of its "
                f"{self.capacity_bytes / 2**30:g} GiB (the rest: transient buffers, the CUDA context, fragmentation)")
        if self.fits:
            return [f"fits the {self.gpu}: {size(self.device_bytes)} per rank{counted}; {plan}"]
        lines = [f"does NOT fit the {self.gpu}: {size(self.device_bytes)} per rank{counted}; {plan}. Ways out, "
                 "each computed by this estimate:"]
        if self.no_rank_count:
            lines.append(f"  more ranks: {self.no_rank_count}")
        for way in self.ways_out:
            change = ", ".join(f"{k}={v!r}" for k, v in way.change.items())
            verdict = "fits" if way.fits else "does not fit"
            lines.append(f"  {way.what} ({change}): {size(way.device_bytes)} per rank, {verdict}")
        return lines


@dataclass(frozen=True)
class StepCheckpointing:
    """The activation checkpointing a predicted step assumes, and why; ``mode`` None where no checkpointing makes a
    rank fit (then predict no step: ``fit`` says so and lists the ways out)."""

    mode: str | None
    """The checkpointing the step is predicted with ("none", "full", "selective"); None: none fits."""
    configured: str
    """The run's own ``activation_checkpointing``."""
    why: str
    """Why this mode, in words."""
    fit: Fit | None = None
    """The fit at that mode (None: no fit was asked, no target GPU or memory)."""

    def to_dict(self) -> dict[str, Any]:
        """The checkpointing a predicted step assumes, as JSON data: the mode, the configured one, why, and whether
        it fits (None: no fit was asked)."""
        return {"mode": self.mode, "configured": self.configured, "why": self.why,
                "fits": self.fit.fits if self.fit else None}


def step_checkpointing(fit: Fit | None, configured: str, size: Callable[[int], str]) -> StepCheckpointing:
    """What a step prediction of the run judged by ``fit`` assumes: the ``configured`` checkpointing where a rank fits
    with it (or the fit is unknown: ``fit`` None), else this estimate's activation checkpointing way out where it
    alone fits at the same rank count, else none (mode None). ``size`` formats bytes."""
    if fit is None:
        return StepCheckpointing(configured, configured, "as configured; whether a rank fits is not judged (no GPU "
                                                         "memory to judge it by)")
    if fit.fits:
        return StepCheckpointing(configured, configured, f"as configured: a rank fits the {fit.gpu} with it "
                                                         f"({size(fit.device_bytes)} of {size(fit.budget_bytes)})")
    what, change = CHECKPOINTING
    for way in fit.ways_out:
        if way.fits and dict(way.change) == dict(change):
            mode = change["activation_checkpointing"]
            return StepCheckpointing(mode, configured, (
                f"{mode}, not the configured {configured}: a rank does not fit the {fit.gpu} without it "
                f"({size(fit.device_bytes)} per rank; {size(way.device_bytes)} with {what}; a rank may plan on "
                f"{size(fit.budget_bytes)})"), fit)
    return StepCheckpointing(None, configured, f"no step predicted: a rank does not fit the {fit.gpu} at this rank "
                                               f"count, with or without {what}", fit)


def budget(capacity_bytes: int) -> int:
    """Bytes a rank may plan on of a GPU of ``capacity_bytes``."""
    return int(MEMORY_FRACTION * capacity_bytes)


def device_bytes(est: Any) -> int:
    """Per-rank GPU bytes of the :class:`~fp8dist.accounting.estimate.MemoryEstimate` ``est``: model states not
    offloaded, plus the activations where modelled."""
    states = sum(b for category, b in est.bytes.items() if category not in est.offloaded)
    return states + (est.activation_bytes if est.activations_modelled else 0)


Rerun = Callable[..., Any]  # rerun(world_size, **changes) -> MemoryEstimate; ValueError where refused


def check_fit(est: Any, gpu: str, capacity_bytes: int, rerun: Rerun, *, rank_step: int = 1) -> Fit:
    """The :class:`Fit` of ``est`` on a GPU of ``capacity_bytes``, with the ways out (through ``rerun``) when it
    does not fit; ``rank_step``: rank counts must be multiples of it (HSDP's replicas)."""
    fit = Fit(gpu, capacity_bytes, device_bytes(est), est.activations_modelled)
    if fit.fits:
        return fit
    ways, no_ranks = ways_out(est, fit.budget_bytes, rerun, rank_step=rank_step)
    return replace(fit, ways_out=tuple(ways), no_rank_count=no_ranks)


def ways_out(est: Any, allowed: int, rerun: Rerun, *, rank_step: int = 1,
             extra: tuple[tuple[str, Mapping[str, Any]], ...] = ()) -> tuple[list[WayOut], str]:
    """(every way out of ``est`` needing more than ``allowed`` bytes, why no rank count fits or ""): more ranks,
    :func:`levers` and ``extra`` (the caller's own changes), then checkpointing with each when none fits alone."""
    need = device_bytes(est)
    world = est.world_size
    ways = []
    if est.activations_modelled and est.activation_bytes >= allowed:  # ranks shard states, not activations
        found, no_ranks = None, "the activations of one micro-batch alone exceed it, whatever the rank count"
    else:
        found, no_ranks = _ranks_that_fit(rerun, world, rank_step, allowed, need, {})
    if found:
        ways.append(WayOut({"world_size": found[0]}, "more ranks", found[1], True))
    pulled = [(change, _lever(rerun, world, what, change, need, allowed)) for what, change in (*levers(), *extra)]
    ways += [way for _, tried in pulled for way in tried]
    _, tried = pulled[0]
    if tried and not any(w.fits for w in ways):  # activations and model states both too big: checkpointing too
        ways += _with_checkpointing(rerun, world, rank_step, allowed, tried[0], pulled[1:])
    return ways, no_ranks


def _with_checkpointing(rerun: Rerun, world: int, step: int, allowed: int, checkpointing: WayOut,
                        others: list[tuple[Mapping[str, Any], list[WayOut]]]) -> list[WayOut]:
    """Activation checkpointing together with more ranks, and with each other way out that saved something."""
    ways = []
    both, _ = _ranks_that_fit(rerun, world, step, allowed, checkpointing.device_bytes, checkpointing.change)
    if both:
        ways.append(WayOut({**checkpointing.change, "world_size": both[0]}, f"{checkpointing.what} and more ranks",
                           both[1], True))
    for change, tried in others:
        for way in tried:
            ways += _lever(rerun, world, f"{checkpointing.what} and {way.what}", {**checkpointing.change, **change},
                           way.device_bytes, allowed)
    return ways


def _lever(rerun: Rerun, world: int, what: str, change: Mapping[str, Any], need: int,
           allowed: int) -> list[WayOut]:
    """The way out ``change`` makes, as a one-item list; empty when refused or it saves nothing."""
    bytes_ = _bytes_with(rerun, world, change)
    return [WayOut(dict(change), what, bytes_, bytes_ <= allowed)] if bytes_ is not None and bytes_ < need else []


def _bytes_with(rerun: Rerun, world: int, change: Mapping[str, Any]) -> int | None:
    try:
        return device_bytes(rerun(world, **change))
    except ValueError:
        return None


def _ranks_that_fit(rerun: Rerun, world: int, step: int, allowed: int, need: int,
                    change: Mapping[str, Any]) -> tuple[tuple[int, int] | None, str]:
    """((the fewest ranks above ``world``, a multiple of ``step``, that fit with ``change``, their bytes), "") or
    (None, why not): doubling until one fits (or the bytes stop shrinking), then bisecting."""
    bytes_at = partial(_bytes_with, rerun, change=change)
    low = world
    n = _multiple(world + 1, step)
    last = need
    try:
        got = device_bytes(rerun(n, **change))
    except ValueError as err:
        return None, f"not with this strategy ({err})"
    if (guessed := _guess(bytes_at, (world, need), (n, got), step, allowed)) is not None:
        return guessed, ""
    while got is not None and got < last:
        if got <= allowed:
            return _narrow(bytes_at, low, n, got, step, allowed), ""
        low = n
        last = got
        n = _multiple(2 * n, step)
        if n > MAX_RANKS:
            return None, f"none up to {MAX_RANKS} ranks fits with the rest as given"
        got = bytes_at(n)
    return None, "more ranks do not shrink a rank's bytes here (each rank holds the whole model state)"


def _guess(bytes_at: Callable[[int], int | None], at: tuple[int, int], then: tuple[int, int], step: int,
           allowed: int) -> tuple[int, int] | None:
    """The fewest ranks that fit, found in two more estimates where bytes go as ``A + S / ranks`` (states shard,
    activations do not) through the two points ``at`` and ``then``: the guess fits and one step fewer does not.
    None where the guess is not confirmed (uneven shards, padding): the caller searches step by step."""
    (n0, b0), (n1, b1) = at, then
    sharded = (b0 - b1) / (1 / n0 - 1 / n1)
    if sharded <= 0 or allowed <= (kept := b0 - sharded / n0):
        return None
    guess = _multiple(max(n1, math.ceil(sharded / (allowed - kept))), step)
    if guess > MAX_RANKS:
        return None
    got = b1 if guess == n1 else bytes_at(guess)
    if got is None or got > allowed:
        return None
    below = guess - step
    if below <= n0:
        return guess, got
    fewer = b1 if below == n1 else bytes_at(below)
    return (guess, got) if fewer is not None and fewer > allowed else None


def _narrow(bytes_at: Callable[[int], int | None], low: int, high: int, high_bytes: int, step: int,
            allowed: int) -> tuple[int, int]:
    """Bisect between ``low`` (does not fit) and ``high`` (fits)."""
    while high - low > step:
        mid = _multiple((low + high) // 2, step)
        if mid in (low, high):
            break
        got = bytes_at(mid)
        if got is not None and got <= allowed:
            high, high_bytes = mid, got
        else:
            low = mid
    return high, high_bytes


def _multiple(n: int, step: int) -> int:
    return -(-n // step) * step
