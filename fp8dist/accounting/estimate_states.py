"""Model-state bytes on every rank, from parameter shapes alone (the private half of :mod:`fp8dist.estimate`).

Each strategy's layout is followed exactly where it runs here (and is tested against :func:`fp8dist.report`):

- ``none`` / ``ddp``: every rank holds every parameter, its gradient (DDP's are views of its buckets) and the
  optimizer states, in the parameters' stored dtype; torch's Adam/AdamW add a 4-byte ``step`` per parameter.
- ``fsdp`` (FSDP2): each parameter is cut along dim 0 with ``torch.chunk``; every rank's storage is padded to
  ``ceil(dim0 / W)`` rows (parameters and the reduce-scatter output that holds the gradients), while the
  optimizer states follow the unpadded local rows (:mod:`fp8dist.strategies.padding`, which also says when a
  dim 0 shorter than W -- Mixtral's fused experts -- multiplies the bytes).
- ``fsdp1``: each wrapped unit's parameters are flattened (each start aligned to 16 bytes of the compute
  dtype, as ``use_orig_params=True`` does), padded to a multiple of W and cut into W equal shards; optimizer
  states follow the original parameters' unpadded pieces.
- ``deepspeed`` ZeRO-1/2: one flat buffer of ``param_dtype`` weights padded to a multiple of 2W on every rank,
  an fp32 master partition of 1/W of it, and gradients for every parameter that overlaps this rank's partition
  (whole parameters, in the weights' dtype). ZeRO-3: each parameter partitioned to ``ceil(numel / W)``
  elements for weights, master weights, gradients and states; small parameters (numel <= the persistence
  threshold) are also kept whole. On a CPU the engine's Adam is torch's (``torch_adam_on_cpu``): one 4-byte
  ``step`` more for the flat partition it updates.

Derived from documented behaviour, not measured (neither runs here): Transformer Engine's FP8 buffers (per FP8
``te.Linear``, DelayedScaling keeps a scale and an ``amax_history_len`` amax history for each of its 5 FP8 tensors
-- input, weight and output forward, output and input gradients backward; TE 2.x keeps no separate scale_inv
there; current scaling keeps none) and MS-AMP's bytes, which follow its chart: O1 FP16 weights and FP8
gradients for every converted Linear with FP32+FP32 Adam states, O2 FP8+FP16 Adam states for every parameter,
O3 (DeepSpeed) FP8 weights with FP16 master weights; 12 bytes of scaling meta per scaled tensor of a Linear.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from ..strategies.padding import shard_padding

__all__ = ["CATEGORIES", "OPTIMIZER_STATES", "DTYPE_BYTES", "ParamInfo", "ElementBytes", "element_bytes",
           "rank_states", "lean_state_bytes", "fp8_buffer_bytes", "category_dtypes", "worst_rank"]

CATEGORIES = ("parameters", "master_weights", "gradients", "optimizer_states", "fp8_buffers")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
"""States per parameter element: Adam/AdamW exp_avg and exp_avg_sq, SGD's momentum buffer, plain SGD none."""
_STEP_BYTES = 4  # torch Adam/AdamW: one fp32 ``step`` tensor per parameter (DeepSpeed's FusedAdam: in the group)
_SCALING_META_BYTES = 12  # MS-AMP ScalingMeta: scale, scale_inv and a 1-long amax window, fp32
_LEAN_MIN, _LEAN_BLOCK = 4096, 256  # torchao 8-bit AdamW: smallest quantized tensor, elements per scale
_TE_FP8_TENSORS = 5  # per te.Linear GEMM: input, weight, output (forward); grad output, grad input (backward)


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per parameter element in each category, and the dtype names shown."""

    weight: int
    master: int
    grad: int
    states: int
    dtypes: tuple[str, str, str, str]


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the model as the layouts need it."""

    name: str
    numel: int
    shape: tuple[int, ...]
    unit: str
    """The FSDP unit (block) that owns it; "" for the root."""
    bytes: ElementBytes


def _msamp_bytes(cfg: Any, converted: bool, base: ElementBytes, n_states: int) -> ElementBytes:
    """MS-AMP's chart: converted Linear weights FP16 (O3: FP8 with an FP16 master), FP8 gradients; O2/O3 Adam
    states FP8 + FP16 for every parameter."""
    level = cfg.precision.opt_level
    states, state_name = (base.states, base.dtypes[3]) if level == "O1" or n_states != 2 else (3, "fp8/fp16")
    if not converted:
        return ElementBytes(base.weight, base.master, base.grad, states, base.dtypes[:3] + (state_name,))
    if level == "O3":
        return ElementBytes(1, 2, 1, states, ("fp8", "fp16", "fp8", state_name))
    return ElementBytes(2, 0, 1, states, ("fp16", "none", "fp8", state_name))


def element_bytes(cfg: Any, optimizer: str, stored_dtype: str, msamp_converted: bool,
                  ds_dtype: str | None = None) -> ElementBytes:
    """Bytes per element of one parameter under ``cfg`` (strategy, FP8 backend). ``stored_dtype``: the model's
    own dtype for this parameter; ``ds_dtype``: the dtype DeepSpeed casts the module to (its bf16/fp16 block)."""
    n_states = OPTIMIZER_STATES[optimizer]
    if getattr(cfg.parallel, "memory", "standard") == "lean":  # states counted per local tensor: lean_state_bytes
        return ElementBytes(2, 0, 2, 0, ("bf16", "none", "bf16", "8-bit/bf16"))
    if cfg.parallel.strategy == "deepspeed":
        model = ds_dtype or cfg.parallel.param_dtype  # gradients accumulate in the module's dtype too
        base = ElementBytes(DTYPE_BYTES[model], 4, DTYPE_BYTES[model], 4 * n_states,
                            (model, "fp32", model, "fp32" if n_states else "none"))
    else:  # FSDP, DDP and none keep the model's own dtype: the stored weight is the master
        size = DTYPE_BYTES[stored_dtype]
        base = ElementBytes(size, 0, size, size * n_states,
                            (stored_dtype, "none", stored_dtype, stored_dtype if n_states else "none"))
    if cfg.precision.fp8 == "msamp":
        return _msamp_bytes(cfg, msamp_converted, base, n_states)
    return base


def _spread(per_rank: list[int], start: int, stop: int, size: int, value_of) -> None:
    """Add ``value_of(overlap)`` to every rank whose range [r*size, (r+1)*size) meets [start, stop)."""
    for rank in range(start // size, min((stop - 1) // size + 1, len(per_rank))):
        overlap = min(stop, (rank + 1) * size) - max(start, rank * size)
        if overlap > 0:
            per_rank[rank] += value_of(overlap)


def _steps(optimizer: str) -> int:
    return _STEP_BYTES if optimizer in ("adam", "adamw") else 0


def _replicated(params: list[ParamInfo], world: int, optimizer: str) -> list[dict[str, int]]:
    one = {"parameters": sum(p.numel * p.bytes.weight for p in params),
           "master_weights": sum(p.numel * p.bytes.master for p in params),
           "gradients": sum(p.numel * p.bytes.grad for p in params),
           "optimizer_states": sum(p.numel * p.bytes.states + _steps(optimizer) for p in params)}
    return [dict(one) for _ in range(world)]


def _fsdp2(params: list[ParamInfo], world: int, optimizer: str) -> list[dict[str, int]]:
    """torch.chunk along dim 0: every rank's storage padded to the first chunk (:func:`shard_padding`); the
    optimizer states on each rank's real rows: ranks before the last chunk a full one, the rank of the last chunk
    the rest, later ranks none (summed through a difference array, so 1024 ranks cost no more than 2)."""
    padding = shard_padding({p.name: p.shape for p in params}, world)
    change = [0] * (world + 1)
    for p, pad in zip(params, padding):
        full = pad.dim0 // pad.rows_per_rank if pad.rows_per_rank else 0
        change[0] += pad.padded_numel * p.bytes.states
        change[full] -= pad.padded_numel * p.bytes.states
        if full < world:
            rest = pad.rows_on(full) * pad.row_numel * p.bytes.states
            change[full] += rest
            change[full + 1] -= rest
    states = list(itertools.accumulate(change[:world]))
    padded = sum(pad.padded_numel for pad in padding)
    b = params[0].bytes
    steps = _steps(optimizer) * len(params)
    return [{"parameters": padded * b.weight, "master_weights": 0, "gradients": padded * b.grad,
             "optimizer_states": s + steps} for s in states]


def _fsdp1_unit(unit: list[ParamInfo], world: int, align: int) -> tuple[list[tuple[int, int]], int]:
    """Offsets of a FlatParameter's pieces (alignment padding before a piece, world-size padding at the end)
    and its shard size."""
    segments, total = [], 0
    for p in unit:
        pad = align - total % align if align else 0
        if 0 < pad < align:
            total += pad
        segments.append((total, total + p.numel))
        total += p.numel
    pad = world - total % world
    if 0 < pad < world:
        total += pad
    return segments, total // world


def _fsdp1(params: list[ParamInfo], world: int, optimizer: str, compute_bytes: int) -> list[dict[str, int]]:
    units: dict[str, list[ParamInfo]] = {}
    for p in params:
        units.setdefault(p.unit, []).append(p)
    b = params[0].bytes
    shard_total = 0
    states = [0] * world
    for unit in units.values():
        segments, shard = _fsdp1_unit(unit, world, 16 // compute_bytes)
        shard_total += shard
        for (start, stop), p in zip(segments, unit):
            _spread(states, start, stop, shard, lambda overlap, p=p: overlap * p.bytes.states + _steps(optimizer))
    return [{"parameters": shard_total * b.weight, "master_weights": 0, "gradients": shard_total * b.grad,
             "optimizer_states": s} for s in states]


def _zero12(params: list[ParamInfo], world: int) -> list[dict[str, int]]:
    """One flat group padded to a multiple of 2W; gradients of whole parameters overlapping the partition."""
    b = params[0].bytes
    total = sum(p.numel for p in params)
    aligned = -(-total // (2 * world)) * (2 * world)
    part = aligned // world
    grads = [0] * world
    start = 0
    for p in params:
        _spread(grads, start, start + p.numel, part, lambda overlap, p=p: p.numel * b.grad)
        start += p.numel
    return [{"parameters": aligned * b.weight, "master_weights": part * b.master, "gradients": g,
             "optimizer_states": part * b.states} for g in grads]


def _zero3(params: list[ParamInfo], world: int, persistence: int) -> list[dict[str, int]]:
    """Every parameter partitioned to ceil(numel / W); persistent (small) ones also kept whole."""
    out = {c: 0 for c in CATEGORIES[:4]}
    for p in params:
        part = -(-p.numel // world)
        out["parameters"] += part * p.bytes.weight + (p.numel * p.bytes.weight if p.numel <= persistence else 0)
        out["master_weights"] += part * p.bytes.master
        out["gradients"] += part * p.bytes.grad
        out["optimizer_states"] += part * p.bytes.states
    return [dict(out) for _ in range(world)]


def _zero_chart(params: list[ParamInfo], world: int, stage: int) -> list[dict[str, int]]:
    """MS-AMP under DeepSpeed (derived): ZeRO's partitioning by stage applied to the chart's bytes."""
    def share(numel: int, partitioned: bool) -> int:
        return -(-numel // world) if partitioned else numel
    out = {"parameters": sum(share(p.numel, stage >= 3) * p.bytes.weight for p in params),
           "master_weights": sum(share(p.numel, True) * p.bytes.master for p in params),
           "gradients": sum(share(p.numel, stage >= 2) * p.bytes.grad for p in params),
           "optimizer_states": sum(share(p.numel, True) * p.bytes.states for p in params)}
    return [dict(out) for _ in range(world)]


def lean_state_bytes(numel: int) -> int:
    """``memory="lean"``: torchao's 8-bit AdamW states (exp_avg, exp_avg_sq) of a local tensor of ``numel``
    elements. torchao quantizes a tensor of at least 4096 elements that is a multiple of its 256-element block: one
    byte per element, an fp32 scale per block and a 256-entry fp32 code map per state; others stay bf16."""
    if numel >= _LEAN_MIN and numel % _LEAN_BLOCK == 0:
        return 2 * (numel + numel // _LEAN_BLOCK * 4 + _LEAN_BLOCK * 4)
    return 2 * 2 * numel


def _add_lean_states(per_rank: list[dict[str, int]], params: list[ParamInfo], world: int, strategy: str) -> None:
    """Each rank's lean states, from the elements it holds of each parameter (FSDP2: its dim-0 rows)."""
    if strategy != "fsdp":
        for states in per_rank:
            states["optimizer_states"] += sum(lean_state_bytes(p.numel) for p in params)
        return
    for p, pad in zip(params, shard_padding({p.name: p.shape for p in params}, world)):
        for rank, states in enumerate(per_rank):
            states["optimizer_states"] += lean_state_bytes(pad.rows_on(rank) * pad.row_numel)


def rank_states(params: list[ParamInfo], cfg: Any, world: int, optimizer: str,
                ds: dict[str, Any] | None = None) -> list[dict[str, int]]:
    """Bytes per category (fp8_buffers excluded) on each of the ``world`` ranks. ``ds``: the DeepSpeed config's
    ``stage`` and ``persistence`` threshold."""
    strategy = cfg.parallel.strategy
    if strategy == "deepspeed":
        stage = ds["stage"]
        if cfg.precision.fp8 == "msamp":
            return _zero_chart(params, world, stage)
        out = _zero3(params, world, ds["persistence"]) if stage == 3 else _zero12(params, world)
        for states in out:  # torch's AdamW keeps a step tensor for the one flat partition it updates
            states["optimizer_states"] += _STEP_BYTES if ds["torch_adam"] else 0
        return out
    if strategy == "fsdp":  # HSDP: each replica's ranks hold what FSDP2 over one shard group holds
        shard = world // cfg.parallel.replicate_degree
        group = _fsdp2(params, shard, optimizer)
        if getattr(cfg.parallel, "memory", "standard") == "lean":
            _add_lean_states(group, params, shard, strategy)
        return [dict(d) for _ in range(cfg.parallel.replicate_degree) for d in group]
    if strategy == "fsdp1":
        return _fsdp1(params, world, optimizer, DTYPE_BYTES[cfg.parallel.param_dtype])
    out = _replicated(params, world, optimizer)
    if getattr(cfg.parallel, "memory", "standard") == "lean":
        _add_lean_states(out, params, world, strategy)
    return out


def fp8_buffer_bytes(cfg: Any, plan: Any) -> int:
    """FP8 scaling state on every rank (replicated): TE's fp8_meta per FP8 te.Linear, MS-AMP's scaling metas;
    torchao's dynamic scaling keeps only the weight scales FSDP2's FP8 all-gather precomputes (4 bytes each).
    MoE experts in FP8 grouped GEMMs keep none: their scales are computed inside each GEMM."""
    fp8 = cfg.precision.fp8
    linears = sum(not e.grouped for e in plan.fp8) if plan is not None else 0
    if fp8 == "te":
        history = cfg.precision.amax_history_len if cfg.precision.te_recipe == "delayed" else 0
        per_tensor = 4 * (1 + history) if history else 0  # a scale and the amax history, fp32
        return linears * _TE_FP8_TENSORS * per_tensor
    if fp8 == "msamp":
        return 4 * linears * _SCALING_META_BYTES  # weight, input, wgrad and ograd metas per Linear
    if fp8 == "torchao":
        from ..fp8.torchao import fp8_all_gather

        return 4 * linears if fp8_all_gather(cfg, plan.facts) else 0  # the fp32 scale precomputed after each step
    return 0


def category_dtypes(params: list[ParamInfo], fp8_bytes: int) -> dict[str, str]:
    """The dtypes each category holds, as ``"bf16/fp32"``."""
    found: dict[str, set[str]] = {c: set() for c in CATEGORIES}
    for p in params:
        for category, name in zip(CATEGORIES[:4], p.bytes.dtypes):
            if name != "none":
                found[category].add(name)
    if fp8_bytes:
        found["fp8_buffers"].add("fp32")
    return {c: "/".join(sorted(names)) or "none" for c, names in found.items()}


def worst_rank(per_rank: list[dict[str, int]]) -> int:
    """The rank holding the most model-state bytes (the lowest such rank)."""
    totals = [sum(d.values()) for d in per_rank]
    return totals.index(max(totals))

