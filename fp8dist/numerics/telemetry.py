"""FP8 health while training: every ``every`` steps, per FP8 layer of a backend with health telemetry (its
``health_casts`` hook: torchao's), the amax, scale and share flushed to zero of its input, weight and output gradient
as its casts scale them; one JSON line per sampled step, and a warning once per layer past the probe's thresholds.
Between sampled steps no hook is attached."""

from __future__ import annotations

import functools
import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config.schema import normalize_value
from ..runtime.agree import on_all_ranks, rank_world
from ..fp8.base import FP8Backend, HealthCasts
from ..fp8.casts import CastSpec
from .casts import CONTRACTION_DIM
from .stats import json_number
from .thresholds import DEFAULT_THRESHOLDS, Thresholds, as_thresholds

__all__ = ["FP8Telemetry", "ROLES"]

ROLES = ("input", "weight", "grad_output")
"""The operands of a Linear the telemetry samples, in the order its records list them."""
# each role is sampled under the cast of the GEMM that consumes it first
_USE = {"input": ("input", "output"), "weight": ("weight", "output"), "grad_output": ("grad_output", "grad_input")}


class _Layer:
    """One FP8 layer's casts and, on a sampled step, its running ``[amax, nonzero, flushed]`` per role."""

    def __init__(self, name: str, module: nn.Module, casts: HealthCasts) -> None:
        self.name, self.module = name, module
        self.specs: dict[str, CastSpec] = {role: _sampled(name, role, getattr(casts, role)) for role in ROLES}
        self.autocasts = casts.autocast_input
        self.acc: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def sample(self, role: str, x: torch.Tensor) -> None:
        """Add ``x``, what ``role`` carries in this step, to the role's running amax, non-zero and flushed counts."""
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        spec = self.specs[role]
        x = x.detach().reshape(-1, x.shape[-1])
        rowwise = {"scaling_granularity": ScalingGranularity.AXISWISE, "axiswise_dim": CONTRACTION_DIM[_USE[role]]}
        amax = tensor_to_amax(x, **(rowwise if spec.scaling == "rowwise" else {}))
        scale = amax_to_scale(amax, spec.dtype, round_scales_to_power_of_2=spec.pow2)
        bits = hp_tensor_and_scale_to_float8(x, scale, spec.dtype)._data
        nonzero = x != 0
        now = torch.stack([amax.max().double(), nonzero.sum().double(), (nonzero & (bits == 0)).sum().double()])
        old = self.acc.get(role)
        self.acc[role] = now if old is None else torch.cat([old[:1].maximum(now[:1]), old[1:] + now[1:]])

    def hook(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        """The forward hook of a sampled step: samples the input, and the output gradient through a tensor hook."""
        if not module.training:  # an evaluation inside a sampled step is not what training casts
            return
        x = args[0]
        if self.autocasts and torch.is_autocast_enabled():  # as Float8Linear.forward casts it
            x = x.to(torch.get_autocast_gpu_dtype())
        self.sample("input", x)
        if out.requires_grad:
            out.register_hook(lambda g: self.sample("grad_output", g))


class FP8Telemetry:
    """Sampled FP8 health of a wrapped model's FP8 layers: those a registered backend's ``health_casts`` answers
    for (torchao's ``Float8Linear``, GPT-2's ``Float8Conv1D``, a Linear under torchao's Float8 weight wrapper:
    ``torchao_api="weight_wrapper"``).

    Create it after :func:`fp8dist.wrap_model` (fsdp, fsdp1, ddp or none with such a backend); it ends each step
    itself after any optimizer holding the model steps (only ``optimizer`` when given), reducing over the world
    group on every rank. Steps 0, every, 2 x every, ... are sampled (all their micro-batches, and the weights as
    updated). ``step``: the number of the step about to run (a resumed run's: its checkpoint's). ValueError:
    ``every`` < 1 or ``step`` < 0 (or not a whole number), a bad threshold, no FP8 layer to sample, or a layer whose
    casts are neither tensorwise nor rowwise; TypeError:
    ``thresholds``, ``optimizer`` or ``log`` of the wrong type.

    ``jsonl``: append one JSON line per sampled step here (rank 0); None: no file.
    ``log``: called with a one-line summary of each sampled step (rank 0), e.g. ``print``.
    ``thresholds``: the limits a layer is warned about (once per layer and problem).
    """

    def __init__(self, model: nn.Module, *, every: int, jsonl: str | os.PathLike | None = None,
                 thresholds: Thresholds | dict[str, float] = DEFAULT_THRESHOLDS,
                 optimizer: torch.optim.Optimizer | None = None,
                 log: Callable[[str], Any] | None = None, step: int = 0) -> None:
        from ..runtime.files import check_output_path
        from ..runtime.optim import STEP_HOOKS
        from ..strategies import unwrap_model
        from ..runtime.names import plain_name

        every = _steps("every", every, 1, "a whole number of steps >= 1 (1 samples every step)")
        step = _steps("step", step, 0, "the number of the step about to run, >= 0 (a resumed run's: its checkpoint's "
                                       "step)")
        thresholds = as_thresholds(thresholds)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer={optimizer!r} is not a torch.optim.Optimizer: pass the one that steps the "
                            "model, or leave it out to end steps after any optimizer holding the model.")
        if log is not None and not callable(log):
            raise TypeError(f"log={log!r} is not callable: pass a function of one line of text (e.g. print), or "
                            "leave it out.")
        # rank 0 writes jsonl; every rank takes part (a job may pass jsonl to rank 0 alone) and raises alike
        check = (lambda: check_output_path(jsonl, name="jsonl")) if rank_world()[0] == 0 and jsonl is not None else None
        on_all_ranks("FP8Telemetry: checking jsonl", check, error=ValueError, passthrough=(ValueError,))
        self.model = model
        self.every = every
        self.thresholds = thresholds
        self.log = log
        self.jsonl = Path(jsonl) if jsonl is not None else None
        sampled = _backends_with_health()
        self.layers = [_Layer(plain_name(n), m, casts) for n, m in unwrap_model(model).named_modules()
                       if (casts := _health_casts(sampled, m)) is not None]
        if not self.layers:
            with_health = " or ".join(f"fp8={b.name!r}" for b in sampled) or "a backend with health telemetry"
            raise ValueError("FP8Telemetry found no FP8 layer it can sample (one a backend's health_casts answers "
                             "for: a Float8Linear, or a Linear under torchao's Float8 weight wrapper) in the model: "
                             f"wrap it with {with_health} first, and check fp8dist.get_plan(model) lists FP8 "
                             "layers.")
        self.steps = step  # the number of the step under way
        self.records: list[dict[str, Any]] = []  # one per sampled step, as the JSON lines
        self.warned: set[tuple[str, str]] = set()
        self._handles: list[Any] = []
        self._step_hook = optimizer.register_step_post_hook(lambda *args: self.step()) if optimizer else None
        if optimizer is None:  # any optimizer of the model, the user's own included; held while the model lives
            STEP_HOOKS.add(model, post=lambda model, optimizer: self.step())
        if self.sampling:
            self._arm()

    @property
    def sampling(self) -> bool:
        """Whether the step under way is sampled (its number a multiple of ``every``)."""
        return self.steps % self.every == 0

    def _arm(self) -> None:  # only while no hook is attached
        self._handles = [layer.module.register_forward_hook(layer.hook) for layer in self.layers]

    def _disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def step(self) -> dict[str, Any] | None:
        """End a step (the optimizer's step hook calls it): a sampled step's record, written and checked against
        the thresholds; None for the others."""
        record = self._finish() if self.sampling else None
        self.steps += 1
        if self.sampling and not self._handles:
            self._arm()
        elif not self.sampling:
            self._disarm()
        return record

    def close(self) -> None:
        """Detach every hook (the optimizer's too)."""
        self._disarm()
        if self._step_hook is not None:
            self._step_hook.remove()

    def _finish(self) -> dict[str, Any]:
        amax, counts, seen = (t.tolist() for t in self._reduced())
        record: dict[str, Any] = {"step": self.steps, "layers": {}}
        for i, layer in enumerate(self.layers):
            entry = {}
            for r, role in enumerate(ROLES):
                if not seen[i][r]:
                    entry[role] = {"amax": None, "scale": None, "flushed_share": None, "finite": True}
                    continue
                nonzero, flushed = counts[i][r]
                entry[role] = {"amax": json_number(amax[i][r]),
                               "scale": json_number(_scale(amax[i][r], layer.specs[role])),
                               # nan: a weight under rowwise scaling, amax and scale only
                               "flushed_share": None if math.isnan(nonzero) else flushed / nonzero if nonzero else 0.0,
                               "finite": math.isfinite(amax[i][r])}
            record["layers"][layer.name] = entry
            layer.acc = {}
        self.records.append(record)
        self._warn(record)
        if rank_world()[0] == 0:
            if self.jsonl is not None:
                with open(self.jsonl, "a") as f:
                    f.write(json.dumps(record) + "\n")
            if self.log is not None:
                self.log(summary(record))
        return record

    def _reduced(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Over every rank: amax, (nonzero, flushed) and ranks that saw it, per layer and role; two all-reduces."""
        device = next(self.model.parameters()).device
        shape = (len(self.layers), len(ROLES))
        amax = torch.full(shape, -1.0, dtype=torch.float64, device=device)  # -1: not seen on this rank
        counts = torch.zeros((*shape, 2), dtype=torch.float64, device=device)
        seen = torch.zeros(shape, dtype=torch.float64, device=device)
        weights = self._weight_shards()
        for i, layer in enumerate(self.layers):
            for r, role in enumerate(ROLES):
                if role in layer.acc:
                    amax[i, r] = layer.acc[role][0]
                    counts[i, r] = layer.acc[role][1:]
                    seen[i, r] = 1.0
            weight = weights[i]()
            if weight.numel():
                amax[i, 1] = weight.abs().max()
            del weight
        _all_reduce(amax, dist.ReduceOp.MAX)
        for i, layer in enumerate(self.layers):
            counts[i, 1], seen[i, 1] = _weight_counts(weights[i](), amax[i, 1], layer.specs["weight"]), 1.0
        packed = torch.cat([counts.flatten(), seen.flatten()])
        _all_reduce(packed, dist.ReduceOp.SUM)
        return amax, packed[:counts.numel()].view_as(counts), packed[counts.numel():].view_as(seen)

    def _weight_shards(self) -> list[Callable[[], torch.Tensor]]:
        """Per layer, what makes this rank's weight values when called: a view of the weight, or a base held in FP8
        dequantized then (one layer in fp32 at a time, never the whole base)."""
        from ..fp8.hf_format import SCALE_ATTR, dequantize, granularity_of_scale
        from ..fp8.weight_wrapper import weight_data
        from ..strategies import unwrap_model
        from ..runtime.names import plain_name
        from ..strategies.local_shards import local_params

        scales = {plain_name(n): getattr(p, SCALE_ATTR) for n, p in unwrap_model(self.model).named_parameters()
                  if hasattr(p, SCALE_ATTR)}  # a base held in FP8: its bits times its scale (whole on each rank)

        def values(name: str, piece) -> torch.Tensor:
            w = piece.local
            if name not in scales:
                return weight_data(w).detach()  # torchao's FP8 all-gather or weight wrapper unwrapped
            scale = scales[name].to(w.device)
            if scale.numel() > 1 and piece.region.box:  # per channel, the weight sharded by rows (FSDP2): its rows
                start, length = piece.region.box[0]
                scale = scale[start:start + length]
            return dequantize(w.detach(), scale, granularity_of_scale(tuple(w.shape), tuple(scale.shape)))

        pieces = {name: p for p in local_params(self.model) for name in p.names}
        return [functools.partial(values, f"{layer.name}.weight", pieces[f"{layer.name}.weight"])
                for layer in self.layers]

    def _warn(self, record: dict[str, Any]) -> None:
        t = self.thresholds
        for name, entry in record["layers"].items():
            for role, stats in entry.items():
                limit = t.max_grad_flushed_share if role == "grad_output" else t.max_flushed_share
                share = stats["flushed_share"]
                problem = ("non-finite values (amax inf or nan)" if not stats["finite"] else
                           f"{100 * share:.2f}% of non-zero values flush to zero in FP8 (threshold {100 * limit:g}%)"
                           if share is not None and share > limit else None)
                if problem and (name, role) not in self.warned:
                    self.warned.add((name, role))
                    warnings.warn(
                        f"FP8 telemetry, step {record['step']}: {name} {role}: {problem}. Keep it out of FP8 from "
                        f"your next checkpoint with fp8_exclude=[{name!r}] (fp8dist.measure_fp8_numerics on your "
                        "batches shows every layer).", RuntimeWarning, stacklevel=2)


def summary(record: dict[str, Any]) -> str:
    """One line: the worst flushed share per role and where, and the largest amax."""
    parts = []
    for role in ROLES:
        shares = [(e[role]["flushed_share"], n) for n, e in record["layers"].items()
                  if e[role]["flushed_share"] is not None]
        if shares:
            share, name = max(shares)
            parts.append(f"{role} flushed <= {100 * share:.3f}% ({name})")
    amaxes = [(e["input"]["amax"], n) for n, e in record["layers"].items() if e["input"]["amax"] is not None]
    if amaxes:
        amax, name = max(amaxes)
        parts.append(f"input amax <= {amax:.3g} ({name})")
    return f"fp8 health, step {record['step']}: " + "; ".join(parts)


def _steps(name: str, value: Any, least: int, what: str) -> int:
    """A whole number >= ``least`` (a bool is refused: True would read as 1); else ValueError: it must be ``what``."""
    try:
        value = normalize_value(name, value, int)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be {what}.") from None
    if value < least:
        raise ValueError(f"{name}={value!r} must be {what}.")
    return value


def _all_reduce(t: torch.Tensor, op: Any) -> None:
    if rank_world()[1] > 1:
        dist.all_reduce(t, op=op)


def _scale(amax: float, spec: CastSpec) -> float:
    """torchao's scale for ``amax`` (tensorwise; under rowwise, the scale of the row with the largest amax)."""
    from torchao.float8.float8_utils import amax_to_scale

    if not math.isfinite(amax) or amax < 0:
        return math.nan
    return float(amax_to_scale(torch.tensor(amax), spec.dtype, round_scales_to_power_of_2=spec.pow2))


def _backends_with_health() -> list[FP8Backend]:
    """The registered backends whose layers the telemetry can sample (their ``health_casts`` is their own)."""
    from ..fp8 import BACKENDS, get_backend

    return [backend for backend in map(get_backend, BACKENDS) if backend.health_telemetry]


def _health_casts(backends: list[FP8Backend], module: nn.Module) -> HealthCasts | None:
    """How the first of ``backends`` that knows ``module`` as its FP8 layer samples it; None: none does."""
    return next((casts for b in backends if (casts := b.health_casts(module)) is not None), None)


_SAMPLED = ("tensorwise", "rowwise")  # the scalings whose amax, scale and flushed share the telemetry computes


def _sampled(name: str, role: str, spec: CastSpec) -> CastSpec:
    """``spec`` when the telemetry can sample it; else ValueError naming the layer, the cast and what it samples."""
    if not isinstance(spec, CastSpec) or spec.scaling not in _SAMPLED:
        raise ValueError(f"FP8Telemetry: {name} {role}: its backend's health_casts gives {spec!r}; the telemetry "
                         f"samples CastSpecs of scaling {' or '.join(map(repr, _SAMPLED))} only. Return None from "
                         "health_casts for such a layer, or probe it with fp8dist.measure_fp8_numerics instead.")
    return spec


@torch.no_grad()
def _weight_counts(w: torch.Tensor, amax: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    """``[nonzero, flushed]`` of this rank's weight shard under the whole weight's tensorwise scale (as torchao's
    precompute casts it); nan under rowwise scaling, whose rows a shard may split."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    if spec.scaling != "tensorwise" or w.numel() == 0:
        return torch.full((2,), math.nan if spec.scaling != "tensorwise" else 0.0, dtype=torch.float64, device=w.device)
    w = w.float()
    scale = amax_to_scale(amax.float().clamp(min=0), spec.dtype, round_scales_to_power_of_2=spec.pow2)
    nonzero = w != 0
    flushed = nonzero & (to_fp8_saturated(w * scale, spec.dtype) == 0)
    return torch.stack([nonzero.sum(), flushed.sum()]).double()

