"""A non-finite step never reaches the weights (one would turn every weight NaN): :class:`StepGuard` skips it on every
rank alike, warns naming the modules, and raises :class:`NonFiniteStepsError` after ``max_skipped_steps`` in a row.
A step is non-finite when a gradient holds an inf or NaN or when the gradients' norm is not finite (finite values past
float32's range: clipping by that norm would zero every gradient, and the optimizer would step on zeros). An engine
that checks inside its own step (DeepSpeed: an invalid global norm too) reports its verdict to the guard instead."""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config.text import listing
from .names import plain_name

__all__ = ["StepGuard", "NonFiniteStepsError"]


class NonFiniteStepsError(RuntimeError):
    """Too many consecutive steps had non-finite gradients (or one did, with ``nonfinite_step="error"``)."""


@dataclass
class StepGuard:
    """What ``nonfinite_step`` does, and what it has seen (every rank holds the same counts)."""

    mode: str
    """"skip" or "error" ("off" installs no guard)."""
    max_consecutive: int
    """Consecutive skips after which :class:`NonFiniteStepsError` is raised; 0: never."""
    device: torch.device = torch.device("cpu")
    """Where the flags are reduced (the process group's device)."""
    names: dict[int, str] = field(default_factory=dict)
    """Parameter id -> its module's name (the user's names, wrappers' prefixes dropped)."""
    steps: int = 0
    """Optimizer steps seen so far, skipped ones included."""
    skipped_steps: int = 0
    """Steps skipped so far because their gradients were non-finite."""
    consecutive: int = 0
    """Steps skipped in a row up to now (0 after a finite one)."""
    clipped_norm: float | None = None
    """The non-finite gradient norm :meth:`saw_norm` was given since the last step; None: none."""

    @classmethod
    def for_model(cls, model: nn.Module, cfg: Any, device: torch.device) -> "StepGuard":
        """The guard ``cfg`` asks for (``nonfinite_step``, ``max_skipped_steps``) over ``model``'s parameters, its
        flags on ``device`` (the rank's: the all-reduce of the verdict runs there)."""
        names = {id(p): plain_name(n).rpartition(".")[0] or plain_name(n) for n, p in model.named_parameters()}
        return cls(cfg.parallel.nonfinite_step, cfg.parallel.max_skipped_steps, device, names)

    def saw_norm(self, norm: torch.Tensor | float) -> None:
        """Call with the gradient norm measured for clipping (:func:`fp8dist.clip_grad_norm_` does), before the
        optimizer steps: a non-finite one makes that step non-finite, on every rank (its clipping zeroed or NaN'd every
        gradient, which the optimizer would step with); a finite norm measured after it (of the zeroed gradients)
        does not undo that."""
        value = float(norm)
        if not math.isfinite(value):
            self.clipped_norm = value

    def before_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Before ``optimizer`` steps: if any rank's gradients are non-finite, or their norm (this rank's, or the one
        given to :meth:`saw_norm`), skip (every gradient set to None: the optimizer leaves weights and state as they
        were) or raise, on every rank alike."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm, self.clipped_norm = self.clipped_norm, None
        flags = _nonfinite(params, self.device, norm is not None).tolist()
        bad, norm_bad = flags[:-1], flags[-1]
        if any(flags):
            for p in params:
                p.grad = None  # the optimizer skips a parameter without a gradient: weights and state untouched
        modules = tuple(dict.fromkeys(self.names.get(id(p), "?") for p, b in zip(params, bad) if b))
        self.after_engine_step(any(flags), modules, norm=None if any(bad) or not norm_bad else
                               norm if norm is not None else math.inf)

    def after_engine_step(self, skipped: bool, modules: tuple[str, ...] = (), norm: float | None = None) -> None:
        """Count a step and whether it was skipped (``modules``: where gradients were non-finite; ``norm``: their
        non-finite norm, when no gradient was; an engine that skips inside its own step reports here); warn of a
        skip, raise after too many."""
        self.steps += 1
        if not skipped:
            self.consecutive = 0
            return
        self.skipped_steps += 1
        self.consecutive += 1
        where = f" in {listing(modules, 8)}" if modules else \
            f" of norm {norm}, values past float32's range when squared," if norm is not None else ""
        if self.mode == "error":
            raise NonFiniteStepsError(f"step {self.steps}: non-finite gradients{where.rstrip(',')}; nothing was "
                                      f"updated. {_WAY_OUT} (nonfinite_step='skip' skips such steps instead).")
        if self.max_consecutive and self.consecutive >= self.max_consecutive:
            raise NonFiniteStepsError(f"{self.consecutive} consecutive steps had non-finite gradients (the last"
                                      f"{where.rstrip(',')}), each skipped; the run is not recovering. {_WAY_OUT}.")
        warnings.warn(f"step {self.steps} skipped: non-finite gradients{where} on some rank; weights and optimizer "
                      f"state are as before the step ({self.skipped_steps} skipped so far).", RuntimeWarning,
                      stacklevel=_caller_level())


def _caller_level() -> int:
    """The stack level of the first frame outside fp8dist and torch: the user's ``optimizer.step()`` line."""
    inside = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))
    frame, level = inspect.currentframe(), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level - 1


_WAY_OUT = ("Lower the learning rate, keep the layers named out of FP8 (fp8_exclude=[...]; fp8dist probe measures "
            "them), or resume from the last checkpoint")


def _nonfinite(params: Iterable[torch.Tensor], device: torch.device, norm_bad: bool = False) -> torch.Tensor:
    """Per parameter, whether its gradient holds an inf or NaN on any rank, then whether any rank's gradients have a
    non-finite norm (as torch's clipping computes it: the norm of the per-parameter norms) or ``norm_bad`` on any
    rank: one fused norm per dtype, one all-reduce."""
    params = list(params)
    flags = torch.zeros(len(params) + 1, dtype=torch.float32, device=device)
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for i, p in enumerate(params):
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a DTensor's part on this rank
        if g is not None and g.numel():
            by_dtype.setdefault(g.dtype, []).append((i, g))
    norms = [torch.zeros((), device=device)]
    for items in by_dtype.values():
        norms.append(torch.stack(torch._foreach_norm([g for _, g in items])).float().to(device))
        flags[torch.tensor([i for i, _ in items], device=device)] = (~torch.isfinite(norms[-1])).float()
    flags[-1] = float(norm_bad or not torch.isfinite(torch.linalg.vector_norm(torch.cat([n.flatten() for n in norms]))))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags.cpu() > 0
