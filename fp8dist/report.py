"""The precision and memory report of a live wrapped model: the row of the MS-AMP/Accelerate precision chart for
the run as configured (GEMM, communication, weight, master weight, weight gradient and optimizer-state dtypes),
per part of the model, and the bytes per parameter each category of model state takes on this rank.

Everything is read from the modules, the engines' policy objects, the optimizer and the tensors themselves; the
config is only used to name the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ._memory import CATEGORIES, StateBytes, StateTally, model_state_tensors

__all__ = ["PrecisionRow", "PrecisionReport", "report"]

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8 e4m3",
          torch.float8_e5m2: "fp8 e5m2", torch.int64: "int64", torch.uint8: "uint8", torch.int8: "int8"}
_PARTS = ("FP8 Linear", "Linear (high precision)", "other (embeddings, norms)")
_FP8_LIBRARIES = ("torchao", "transformer_engine", "msamp")


def dtype_name(dtype: torch.dtype | None) -> str:
    """Short name of a dtype: fp32, bf16, fp8 e4m3, ..."""
    return "none" if dtype is None else _NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _names(dtypes: set[torch.dtype], empty: str = "none") -> str:
    return "/".join(sorted(dtype_name(d) for d in dtypes)) or empty


@dataclass(frozen=True)
class PrecisionRow:
    """One part of the model (FP8 Linears, high-precision Linears, everything else) as the chart shows it."""

    part: str
    modules: int
    params: int
    """Elements of the full model in this part (all ranks together)."""
    gemm: str
    all_gather: str
    """What the weights travel in when they are gathered (FSDP, ZeRO-3; ZeRO-1/2 after the step)."""
    reduce: str
    """What gradients travel in when they are reduced."""
    weight: str
    """What the weights are stored in on this rank."""
    master_weight: str
    weight_grad: str
    optimizer_states: str


@dataclass(frozen=True)
class PrecisionReport(StateBytes):
    """Returned by :func:`report`; ``print`` it for the two tables."""

    strategy: str
    fp8: str
    rank: int
    world_size: int
    rows: tuple[PrecisionRow, ...]
    bytes: Mapping[str, int]
    """Bytes on this rank per category: parameters, master_weights, gradients, optimizer_states, fp8_buffers."""
    dtypes: Mapping[str, str]
    """The dtypes found in each category."""
    total_params: int
    """Elements of all parameters of the full model."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(bytes=dict(self.bytes), dtypes=dict(self.dtypes), model_state_bytes=self.model_state_bytes,
                   bytes_per_param=self.bytes_per_param)
        return out

    def __str__(self) -> str:
        head = (f"fp8dist report: strategy {self.strategy}, fp8 {self.fp8}, rank {self.rank} of {self.world_size}, "
                f"{self.total_params:,} parameters")
        cols = ["part", "modules", "params", "GEMM", "all-gather", "reduce", "weight", "master weight",
                "weight grad", "optimizer states"]
        rows = [[r.part, str(r.modules), f"{r.params:,}", r.gemm, r.all_gather, r.reduce, r.weight, r.master_weight,
                 r.weight_grad, r.optimizer_states] for r in self.rows]
        per_param = self.bytes_per_param
        mem = [[c.replace("_", " "), f"{per_param[c]:.3f}", f"{self.bytes[c] / 2**20:,.2f}", self.dtypes[c]]
               for c in CATEGORIES]
        mem.append(["total model states", f"{per_param['total']:.3f}", f"{self.model_state_bytes / 2**20:,.2f}", ""])
        return "\n".join([head, _table(cols, rows), "", _table(["model state (this rank)", "bytes/param", "MiB",
                                                                 "dtypes"], mem)])


def _table(cols: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _inner(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / FSDP1 / the DeepSpeed engine."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    from .strategies.deepspeed import is_deepspeed_engine

    if isinstance(model, (DistributedDataParallel, FullyShardedDataParallel)) or is_deepspeed_engine(model):
        return model.module
    return model


def _is_fp8_gemm(module: nn.Module) -> bool:
    name = type(module).__name__
    return type(module).__module__.split(".")[0] in _FP8_LIBRARIES and "Linear" in name


def _part(module: nn.Module) -> str:
    if _is_fp8_gemm(module):
        return _PARTS[0]
    return _PARTS[1] if isinstance(module, nn.Linear) else _PARTS[2]


def _modules_by_part(inner: nn.Module) -> dict[str, list[nn.Module]]:
    parts: dict[str, list[nn.Module]] = {p: [] for p in _PARTS}
    for module in inner.modules():
        if "FullyShardedDataParallel" in type(module).__name__:
            continue
        if any(True for _ in module.parameters(recurse=False)):
            parts[_part(module)].append(module)
    return {p: ms for p, ms in parts.items() if ms}


def report(model: nn.Module, optimizer: Any = None) -> PrecisionReport:
    """What precision each part of ``model`` (returned by :func:`fp8dist.wrap_model`) really trains in, and the
    bytes of model state per parameter on this rank. Local to this rank: no collectives.

    Call it after ``optimizer.step()`` and before ``zero_grad`` (DeepSpeed: after ``engine.backward(loss)``,
    before ``engine.step()``): the gradients counted are those held at the moment of the call, and optimizer
    states exist only after the first step.

    Args:
        model: the model ``wrap_model`` returned (the DeepSpeed engine for strategy "deepspeed").
        optimizer: its optimizer (ignored for DeepSpeed, whose engine holds it); None counts no optimizer state.

    Example::

        loss.backward(); optimizer.step()
        print(fp8dist.report(model, optimizer))
        optimizer.zero_grad()
    """
    from ._report_dtypes import row_for

    from .api import get_wrap_info
    from .sharding import sharding_summary

    info = get_wrap_info(model)
    inner = _inner(model)
    parts = _modules_by_part(inner)
    tally = StateTally()
    for category, tensors in model_state_tensors(model, optimizer, parts.get(_PARTS[0], [])).items():
        tally.add(category, tensors)
    rows = tuple(row_for(model, optimizer, part, modules) for part, modules in parts.items())
    return PrecisionReport(
        strategy=info.config.parallel.strategy, fp8=info.config.precision.fp8 or "none", rank=info.env.rank,
        world_size=info.env.world_size, rows=rows, bytes=dict(tally.bytes),
        dtypes={c: _names(d) for c, d in tally.dtypes.items()}, total_params=sharding_summary(model).total_numel)
