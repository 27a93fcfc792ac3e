"""The precision and memory report of a live wrapped model: per part of the model (FP8 GEMM, high-precision GEMM,
other), the dtypes of the MS-AMP/Accelerate precision chart, and the bytes per parameter of each category of model
state on this rank; all read from the modules, engines, optimizer and tensors, not from the config."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from .rows import Held, Members, Part, PrecisionRow, text_table
from .tensors import CATEGORIES, ParamGroup, StateBytes, StateTally, holds_words, model_state_tensors
from ..config.dtypes import dtype_name, dtype_names as _names
from ..config.text import byte_size
from ..fp8 import get_backend
from ..memory_levels import STANDARD
from ..plan.coverage import runs_gemm
from ..strategies import unwrap_model
from ..runtime.names import plain_name as _plan_name

__all__ = ["Part", "PrecisionRow", "PrecisionReport", "report"]


@dataclass(frozen=True)
class PrecisionReport(StateBytes):
    """Returned by :func:`report`; ``print`` it for the two tables (the precision chart, the model-state bytes)."""

    strategy: str
    """The strategy the model was wrapped with."""
    fp8: str
    """The FP8 backend ("none" without FP8)."""
    rank: int
    """The rank measured (this process's)."""
    world_size: int
    """Ranks in the job."""
    rows: tuple[PrecisionRow, ...]
    """The precision chart, one row per part of the model (:class:`~fp8dist.accounting.rows.Part`)."""
    bytes: Mapping[str, int]
    """Bytes on this rank per category (:data:`~fp8dist.accounting.tensors.CATEGORIES`)."""
    dtypes: Mapping[str, str]
    """The dtypes each category holds on this rank, as ``"bf16/fp32"``."""
    total_params: int
    """Elements of all parameters of the full model (all ranks)."""
    memory: str = STANDARD.name
    """The memory level (``memory=``)."""
    frozen_params: int = 0
    """Elements of the full model (all ranks) that do not train (``requires_grad=False``: a LoRA base)."""
    groups: tuple[ParamGroup, ...] = ()
    """The estimate's ``groups``, measured; () where all train or the split is not measured."""
    groups_unmeasured: str = ""
    """Why the frozen / trained split is not measured (an engine keeps both in one tensor); "" otherwise."""

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON data: every row (its part by name), the bytes and dtypes per category, the totals and
        bytes per parameter."""
        out = asdict(self)
        for row in out["rows"]:
            row["part"] = row["part"].value
        out.update(bytes=dict(self.bytes), dtypes=dict(self.dtypes), model_state_bytes=self.model_state_bytes,
                   bytes_per_param=self.bytes_per_param)
        return out

    def __str__(self) -> str:
        head = (f"fp8dist report: strategy {self.strategy}, fp8 {self.fp8}, rank {self.rank} of {self.world_size}, "
                f"{self.total_params:,} parameters"
                + (f" ({self.frozen_params:,} frozen)" if self.frozen_params else "")
                + (f", memory {self.memory}" if self.memory != STANDARD.name else ""))
        cols = ["part", "modules", "params", "GEMM", "all-gather", "reduce", "weight", "master weight",
                "weight grad", "optimizer states"]
        rows = [[r.part.label, str(r.modules), f"{r.params:,}", r.gemm, r.all_gather, r.reduce, r.weight,
                 r.master_weight, r.weight_grad, r.optimizer_states] for r in self.rows]
        mem = self.state_rows(lambda n: f"{n / 2**20:,.2f}")
        unmeasured = [f"note: {self.groups_unmeasured}"] if self.groups_unmeasured else []
        return "\n".join([head, text_table(cols, rows), "", text_table(["model state (this rank)", "bytes/param", "MiB",
                                                                 "dtypes"], mem), "", *self.group_table(byte_size),
                          *unmeasured]).rstrip()


def _part(module: nn.Module, name: str, held: list[Held], fp8: dict[str, bool]) -> Part:
    if name in fp8:
        return Part.FP8_GROUPED_GEMM if fp8[name] else Part.FP8_GEMM
    return Part.GEMM if runs_gemm(module, [h.shape for h in held]) else Part.OTHER


def _group_by_part(model: nn.Module, strategy: Any, fp8: dict[str, bool]) -> dict[Part, Members]:
    """The modules and parameters (full shapes) of each part of a wrapped ``model`` that has modules; ``fp8``: the
    plan's FP8 module names -> grouped."""
    full = strategy.full_shapes(model)
    members = {p: Members() for p in Part}
    owner: dict[int, tuple[Part, Held]] = {}
    order = list(Part)
    # a wrapper and the module it wraps share a planned name: the wrapped module, visited later, keeps it
    names = {_plan_name(name): module for name, module in unwrap_model(model).named_modules()}
    if fp8.keys() - names.keys():
        warnings.warn(f"fp8dist.report: the plan's FP8 modules {sorted(fp8.keys() - names.keys())} are not in the "
                      "wrapped model under their planned names; where they are, they are reported as high-precision "
                      "GEMMs", stacklevel=3)
    for name, module in names.items():
        if not strategy.holds_own_params(module):
            continue
        held = [Held(module, n, p, full.get((id(module), n), tuple(p.shape)))
                for n, p in module.named_parameters(recurse=False)]
        if not held:
            continue
        part = _part(module, name, held, fp8)
        members[part].modules.append(module)
        for h in held:  # a tied parameter goes to its GEMM holder (FP8 before high precision before none)
            if id(h.param) not in owner or order.index(part) < order.index(owner[id(h.param)][0]):
                owner[id(h.param)] = (part, h)
    for part, h in owner.values():
        members[part].params.append(h)
    return {p: m for p, m in members.items() if m.modules}


def _groups(strategy: Any, held: dict[str, list[Any]], optimizer: Any, frozen: list[Held],
            trained: int) -> tuple[ParamGroup, ...] | None:
    """The ``frozen`` parameters measured from the tensors holding them alone, the trained as every other storage
    the engine ``held``, FP8 buffers aside; None where the strategy cannot tell the frozen storage apart."""
    parts = strategy.group_parts([h.param for h in frozen])
    if parts is None:
        return None
    state = getattr(optimizer, "state", None) or {}
    alone = StateTally()
    alone.add("parameters", parts)
    alone.add("gradients", [h.param.grad for h in frozen])
    alone.add("optimizer_states", [state[h.param] for h in frozen if h.param in state])
    rest = StateTally(counted=alone)
    for category, tensors in held.items():  # the total's order: a storage lands in the same category
        rest.add(category, tensors)
    frozen_count = sum(h.numel for h in frozen)
    return (_param_group("frozen", frozen_count, alone), _param_group("trained", trained, rest))


def _param_group(label: str, count: int, tally: StateTally) -> ParamGroup:
    """The group ``label`` of ``count`` elements from the bytes and dtypes ``tally`` holds, FP8 buffers aside."""
    categories = CATEGORIES[:4]
    dtype_names = [{dtype_name(d) for d in tally.dtypes[c]} for c in categories]
    return ParamGroup(label, count, sum(tally.bytes[c] for c in categories), holds_words(dtype_names))


def report(model: nn.Module, optimizer: Any = None) -> PrecisionReport:
    """What precision each part of ``model`` really trains in, and the bytes of model state per parameter on this
    rank (no collectives). Call it after ``optimizer.step()`` and before ``zero_grad`` (DeepSpeed: after
    ``engine.backward(loss)``, before ``engine.step()``): gradients are counted as held now, optimizer states exist
    after the first step.

    Args:
        model: the model ``wrap_model`` returned (the DeepSpeed engine for strategy "deepspeed").
        optimizer: its optimizer (ignored for DeepSpeed, whose engine holds it); None counts no optimizer state.

    Example::

        loss.backward(); optimizer.step()
        print(fp8dist.report(model, optimizer))
        optimizer.zero_grad()
    """
    from .row_dtypes import wrapped_run, row_for

    run = wrapped_run(model, optimizer)
    info, strategy, _, held = run
    parts = _group_by_part(model, strategy, {e.name: e.grouped for e in info.plan.fp8})
    fp8_modules = [m for part in (Part.FP8_GEMM, Part.FP8_GROUPED_GEMM) if part in parts for m in parts[part].modules]
    tally = StateTally()
    for category, tensors in model_state_tensors(held, fp8_modules, get_backend(info.plan.backend)).items():
        tally.add(category, tensors)
    rows = tuple(row_for(run, optimizer, part, members) for part, members in parts.items())
    params = [h for m in parts.values() for h in m.params]
    frozen = [h for h in params if not h.param.requires_grad]
    groups = _groups(strategy, held, optimizer, frozen, sum(h.numel for h in params) - sum(h.numel for h in frozen)) \
        if frozen else ()
    unmeasured = "" if groups is not None else (
        f"the frozen / trained split is not measured under strategy {strategy.name!r}: its engine keeps frozen and "
        "trained parameters in shared tensors (fp8dist.estimate_memory's groups give it)")
    return PrecisionReport(
        strategy=info.config.parallel.strategy, fp8=get_backend(info.config.precision.fp8).name, rank=info.env.rank,
        world_size=info.env.world_size, rows=rows, bytes=dict(tally.bytes),
        dtypes={c: _names(d) for c, d in tally.dtypes.items()}, total_params=strategy.param_layout(model).total_numel,
        memory=info.config.parallel.memory,
        frozen_params=sum(h.numel for h in frozen), groups=groups or (), groups_unmeasured=unmeasured)
