"""``reduce_dtype="fp8"``: gradients cross the wire as FP8 blocks with fp32 scales. Each rank quantizes its gradient
once (per block of ``block`` elements, the block's amax mapped to e4m3's largest value), the blocks and their scales
go to the rank that owns them in one all-to-all, and that rank dequantizes and sums them in fp32: FSDP2's
reduce-scatter through :meth:`FSDPModule.set_custom_reduce_scatter`, DDP's all-reduce through a comm hook (the summed
chunk quantized once more and all-gathered, so every replica dequantizes the same bytes and stays identical).

Every byte a rank sends to another rank is counted at the collective, in a :class:`GradWire` the run reports."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = ["WIRE_DTYPE", "GradWire", "WireTally", "FP8ReduceScatter", "FP32ReduceScatter", "unit_owning",
           "FP8HookState", "fp8_all_reduce_hook",
           "quantize_blocks", "dequantize_blocks", "fp8_reduce_scatter", "fp8_all_reduce", "apply_fp8_reduce_scatter",
           "model_grad_wire", "fp8_wire_words", "reduce_wire_bytes", "BF16_BYTES",
           "predict_reduce_scatter", "predict_all_reduce", "describe_tally"]

WIRE_DTYPE = torch.float8_e4m3fn
"""The FP8 format on the wire: e4m3. Per-block scales already cover the range e5m2's extra exponent bit would buy,
and e4m3's extra mantissa bit keeps 6 dB more signal: the small Llama's gradients at block 128 keep 31.4 dB SQNR in
e4m3, 25.1 dB in e5m2; both keep the tiny Llama's loss over 30 steps, e4m3 closer (mean gap 0.00029 against
0.00036 nats). benchmarks/grad_comm/formats.py, benchmarks/results/grad_comm_formats.json."""
BF16_BYTES = 2
"""Bytes of a bf16 gradient element: the reduction FP8 gradients are compared with."""
_SCALE_BYTES = 4


@dataclass(frozen=True)
class WireTally:
    """Gradient-reduction traffic of one rank: ``sent`` bytes (FP8 payload and fp32 scales) sent to other ranks,
    ``bf16`` what a bf16 ring reduction of the same gradients sends, ``elements`` the gradient elements reduced."""

    sent: int = 0
    scales: int = 0
    bf16: int = 0
    elements: int = 0

    def __add__(self, other: WireTally) -> WireTally:
        return WireTally(self.sent + other.sent, self.scales + other.scales, self.bf16 + other.bf16,
                         self.elements + other.elements)

    def __sub__(self, other: WireTally) -> WireTally:
        return WireTally(self.sent - other.sent, self.scales - other.scales, self.bf16 - other.bf16,
                         self.elements - other.elements)

    def per_step(self, steps: int) -> WireTally:
        """This tally of ``steps`` steps as the mean step's (whole bytes)."""
        return WireTally(*(v // max(1, steps) for v in (self.sent, self.scales, self.bf16, self.elements)))

    @property
    def ratio(self) -> float | None:
        """Bytes sent / a bf16 reduction's; None before any reduction."""
        return self.sent / self.bf16 if self.bf16 else None


class GradWire:
    """The FP8 reduction's settings (``block`` elements per scale) and its running byte count on this rank. Read
    :attr:`total`; a step's traffic is ``after - before`` of two readings."""

    def __init__(self, block: int) -> None:
        if block < 1:
            raise ValueError(f"reduce_fp8_block={block} must be a positive number of elements per fp32 scale.")
        self.block = block
        self.total = WireTally()
        self.fp32_units: tuple[str, ...] = ()
        """What crosses in fp32 instead (a layer the numerics probe flagged), as the report names it: FSDP2 units
        by first name, DDP's split-out layers."""

    def add(self, *, sent: int, scales: int, bf16: int, elements: int) -> None:
        """Count one collective's bytes (sent, of them scales, a bf16 reduction's, elements)."""
        self.total += WireTally(sent, scales, bf16, elements)


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (rows, n) as FP8 bytes (rows, n padded to whole blocks; uint8, the bytes of :data:`WIRE_DTYPE`) and
    fp32 scales (rows, blocks). An inf or NaN in a block makes its scale non-finite, so the whole block dequantizes
    to NaN: a non-finite gradient stays non-finite after the reduction (e4m3 itself would saturate an inf)."""
    rows, n = x.shape
    x = nn.functional.pad(x.float(), (0, -n % block)).reshape(rows, -1, block)
    top = torch.finfo(WIRE_DTYPE).max
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / top)
    q = (x / scale).clamp(-top, top).to(WIRE_DTYPE)
    return q.view(torch.uint8).reshape(rows, -1), scale.reshape(rows, -1)


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """fp32 (rows, ``n``) from :func:`quantize_blocks`'s bytes and scales."""
    rows, blocks = scales.shape
    x = q.view(WIRE_DTYPE).float().reshape(rows, blocks, -1) * scales.unsqueeze(-1)
    return x.reshape(rows, -1)[:, :n]


def _exchange(rows: torch.Tensor, wire: GradWire, group: dist.ProcessGroup, elements: int) -> torch.Tensor:
    """``rows`` (world, n): row ``r`` goes to rank ``r`` as FP8 blocks; returns the fp32 sum of the rows this rank
    received (its own row included), counting the bytes sent to the others and a bf16 ring reduce-scatter's of the
    ``elements`` gradient elements (padding left out)."""
    world, n = rows.shape
    q, s = quantize_blocks(rows, wire.block)
    q_in, s_in = torch.empty_like(q), torch.empty_like(s)
    dist.all_to_all_single(q_in, q, group=group)
    dist.all_to_all_single(s_in, s, group=group)
    others = world - 1
    wire.add(sent=others * (q[0].numel() + s[0].numel() * _SCALE_BYTES), scales=others * s[0].numel() * _SCALE_BYTES,
             bf16=others * elements * BF16_BYTES // world, elements=elements)
    return dequantize_blocks(q_in, s_in, n).sum(0)


def fp8_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, *, average: bool,
                       wire: GradWire) -> None:
    """``output`` (n elements) = the sum (``average``: the mean) over ``group`` of every rank's chunk of ``input``
    (world x n elements, chunk ``r`` for rank ``r``), each element quantized once to FP8, summed in fp32."""
    world, n = group.size(), output.numel()
    total = _exchange(input.reshape(world, n), wire, group, input.numel())
    output.copy_(total.div_(world) if average else total)


def fp8_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup, wire: GradWire,
                   elements: int | None = None) -> torch.Tensor:
    """The mean over ``group`` of the 1-D ``flat``, as a new fp32 tensor of its shape: an FP8 reduce-scatter, then the
    summed chunks quantized once more and all-gathered, so every rank dequantizes the same bytes. ``elements``: the
    gradient elements ``flat`` holds, counted as a bf16 reduction's (None: all; fewer where it holds padding)."""
    world, n = group.size(), flat.numel()
    elements = n if elements is None else elements
    chunk = math.ceil(n / (world * wire.block)) * wire.block
    rows = nn.functional.pad(flat.float(), (0, world * chunk - n)).reshape(world, chunk)
    mine = _exchange(rows, wire, group, elements).div_(world)
    q, s = quantize_blocks(mine.unsqueeze(0), wire.block)
    q_all = q.new_empty((world, q.shape[1]))
    s_all = s.new_empty((world, s.shape[1]))
    dist.all_gather_into_tensor(q_all, q, group=group)
    dist.all_gather_into_tensor(s_all, s, group=group)
    others = world - 1
    wire.add(sent=others * (q.numel() + s.numel() * _SCALE_BYTES), scales=others * s.numel() * _SCALE_BYTES,
             bf16=others * elements * BF16_BYTES // world, elements=0)
    return dequantize_blocks(q_all, s_all, chunk).reshape(-1)[:n].view_as(flat).to(flat.dtype)


class FP8ReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter with the gradients on the wire in FP8 (:func:`fp8_reduce_scatter`); FSDP2 hands it
    its fp32 buffers (the policy's ``reduce_dtype``) and goes on as with its own: the HSDP all-reduce, the copy
    into the sharded gradients."""

    def __init__(self, wire: GradWire) -> None:
        self.wire = wire

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2's buffer for the reduce-scatter: a plain tensor of ``size`` (the comm hook's contract)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` over ``group`` as FP8 blocks (sum or
        average; another op is refused with ValueError)."""
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(f"reduce_dtype='fp8': FSDP2 asked for reduce op {op}; the FP8 reduce-scatter sums or "
                             "averages only (a gradient_divide_factor set on the model asks for another): leave the "
                             "factor unset, or use reduce_dtype='fp32'.")
        fp8_reduce_scatter(output_tensor, input_tensor, group, average=op == dist.ReduceOp.AVG, wire=self.wire)


class FP32ReduceScatter(FP8ReduceScatter):
    """FSDP2's own fp32 reduce-scatter, for a unit holding a layer whose gradient the FP8 blocks hurt (the probe's
    verdict), its bytes counted in the same :class:`GradWire`: the whole gradient in fp32, no scales."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        """Reduce-scatter in fp32 (the fallback modules' gradients), counting their bytes on the wire."""
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(f"reduce_dtype='fp8': FSDP2 asked for reduce op {op}; its fp32 fallback sums or averages "
                             "only: leave gradient_divide_factor unset, or use reduce_dtype='fp32'.")
        world, n = group.size(), output_tensor.numel()
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)  # gloo: no AVG
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(world)
        others = world - 1
        self.wire.add(sent=others * n * output_tensor.element_size(), scales=0,
                      bf16=others * input_tensor.numel() * BF16_BYTES // world, elements=input_tensor.numel())


def fp32_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup, wire: GradWire) -> torch.Tensor:
    """The mean over ``group`` of the 1-D ``flat`` reduced in fp32, as a new tensor of its dtype, its bytes counted
    in ``wire`` as a ring all-reduce sends them (a reduce-scatter and an all-gather of 4-byte elements)."""
    world, n = group.size(), flat.numel()
    total = flat.float().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)  # gloo: no AVG
    others = world - 1
    wire.add(sent=2 * (others * n * _SCALE_BYTES // world), scales=0, bf16=2 * (others * n * BF16_BYTES // world),
             elements=n)
    return total.div_(world).to(flat.dtype)


@dataclass(frozen=True)
class FP8HookState:
    """The state of :func:`fp8_all_reduce_hook`: the group it averages over and the wire it counts in."""

    group: dist.ProcessGroup
    wire: GradWire
    fallback: frozenset[int] = frozenset()
    """``id`` of each parameter whose gradient crosses in fp32 (a layer the numerics probe flagged): split out of
    its bucket, the rest of the bucket in FP8."""


def _joined(flat: torch.Tensor, spans: list[tuple[int, int]], block: int) -> torch.Tensor:
    """The ``(offset, numel)`` spans of ``flat`` one after another, each padded with zeros to whole ``block``s."""
    return torch.cat([nn.functional.pad(flat[o:o + n], (0, -n % block)) for o, n in spans])


def _split_into(result: torch.Tensor, joined: torch.Tensor, spans: list[tuple[int, int]], block: int) -> None:
    """Write :func:`_joined`'s layout ``joined`` back into ``result``'s spans, leaving the padding out."""
    start = 0
    for offset, n in spans:
        result[offset:offset + n] = joined[start:start + n]
        start += n + -n % block


def fp8_all_reduce_hook(state, bucket):
    """A DDP comm hook (``ddp.register_comm_hook(FP8HookState(group, wire), fp8_all_reduce_hook)``): the bucket
    (a ``dist.GradBucket``) averaged by :func:`fp8_all_reduce`, as DDP's own all-reduce averages it, the gradients
    of ``state.fallback``'s parameters by :func:`fp32_all_reduce`; returns a completed future of the result. Each
    parameter's gradient starts a block (its last block padded): a block never mixes two parameters, so what
    crosses the wire does not depend on how DDP lays its buckets out (it lays them out anew after the first step,
    and a run resumed from a checkpoint must repeat the uninterrupted run's bits). No annotations: DDP checks them
    against the real classes."""
    flat, done, block = bucket.buffer(), torch.futures.Future(), state.wire.block
    fp8: list[tuple[int, int]] = []  # (offset, numel) of each parameter's gradient in the bucket
    fp32: list[tuple[int, int]] = []
    offset = 0
    for param, grad in zip(bucket.parameters(), bucket.gradients()):  # laid out one after another, in this order
        (fp32 if id(param) in state.fallback else fp8).append((offset, grad.numel()))
        offset += grad.numel()
    if not fp32 and all(n % block == 0 for _, n in fp8):  # already whole blocks, parameter by parameter
        done.set_result(fp8_all_reduce(flat, state.group, state.wire))
        return done
    result = torch.empty_like(flat)
    if fp8:
        reduced = fp8_all_reduce(_joined(flat, fp8, block), state.group, state.wire, sum(n for _, n in fp8))
        _split_into(result, reduced, fp8, block)
    if fp32:
        _split_into(result, fp32_all_reduce(_joined(flat, fp32, 1), state.group, state.wire), fp32, 1)
    done.set_result(result)
    return done


def unit_owning(name: str, units: list[list[str]]) -> int:
    """The index in ``units`` (each the module names one FSDP2 unit shards together; "" the root) of the unit whose
    reduce-scatter carries module ``name``'s gradients: the deepest that holds it."""
    def depth(unit: list[str]) -> int:
        held = [u for u in unit if u == "" or name == u or name.startswith(u + ".")]
        return max((len(u) + 1 for u in held), default=0)

    return max(range(len(units)), key=lambda i: depth(units[i]))


def apply_fp8_reduce_scatter(model: nn.Module, wire: GradWire, fallback: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Give every FSDP2 unit of ``model`` (after ``fully_shard``) the FP8 reduce-scatter, all counting in ``wire``;
    a unit holding one of the ``fallback`` modules (the probe flagged their gradients) gets the counted fp32
    reduce-scatter instead. Returns a note per such unit."""
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    states: dict[int, list[str]] = {}  # one state per fully_shard call (several modules for a list)
    for name, module in named:
        states.setdefault(id(module._get_fsdp_state()), []).append(name)
    units = list(states.values())
    held: dict[int, list[str]] = {}
    for layer in fallback:
        held.setdefault(unit_owning(layer, units), []).append(layer)
    fp8, fp32 = FP8ReduceScatter(wire), FP32ReduceScatter(wire)
    fp32_states = {list(states)[i] for i in held}
    for _, module in named:
        module.set_custom_reduce_scatter(fp32 if id(module._get_fsdp_state()) in fp32_states else fp8)
    wire.fp32_units = tuple(f"FSDP2 unit {units[i][0] or 'root'}" for i in held)
    return tuple(f"reduce_dtype='fp8': FSDP2 unit {', '.join(units[i]) or 'root'} reduce-scatters in fp32, not FP8: it "
                 f"holds {', '.join(layers)}, whose weight gradients the FP8 blocks hurt (the numerics probe's verdict)"
                 for i, layers in held.items())


def model_grad_wire(model: nn.Module) -> GradWire | None:
    """The :class:`GradWire` of a model whose gradients reduce in FP8 (FSDP2 or DDP), else None."""
    for hook, state in getattr(model, "_comm_hooks", ()):  # DDP.register_comm_hook keeps them
        if hook is fp8_all_reduce_hook:
            return state.wire
    for module in (m for m in model.modules() if isinstance(m, FSDPModule)):
        for group in module._get_fsdp_state()._fsdp_param_groups:  # the comm FSDP2 calls
            if isinstance(group._reduce_scatter_comm, FP8ReduceScatter):
                return group._reduce_scatter_comm.wire
    return None


def fp8_wire_words(wire: GradWire) -> str:
    """How the gradients cross the wire, as the report says it."""
    fp32 = f"; in fp32: {', '.join(wire.fp32_units)} (the numerics probe's verdict)" if wire.fp32_units else ""
    return f"fp8 e4m3 blocks of {wire.block} (fp32 scales), summed in fp32{fp32}"


def _row_bytes(elements: int, block: int) -> tuple[int, int]:
    """(FP8 payload + scale bytes, scale bytes) of ``elements`` quantized in whole blocks."""
    blocks = math.ceil(elements / block)
    return blocks * block + blocks * _SCALE_BYTES, blocks * _SCALE_BYTES


def predict_reduce_scatter(unit_elements: list[int], world: int, block: int,
                           fp32: frozenset[int] = frozenset()) -> WireTally:
    """What :class:`FP8ReduceScatter` sends per step: one reduce-scatter per FSDP2 unit of ``unit_elements``
    gradient elements each (dim 0 already padded to ``world``, as FSDP2 pads it); the units at the indices in
    ``fp32`` send :class:`FP32ReduceScatter`'s fp32 instead."""
    tallies = [WireTally(*((world - 1) * b for b in ((n // world * 4, 0) if i in fp32 else
                                                     _row_bytes(n // world, block))),
                         (world - 1) * n * BF16_BYTES // world, n) for i, n in enumerate(unit_elements) if n]
    return sum(tallies, WireTally()) if world > 1 else WireTally()


def predict_all_reduce(sizes: list[int], world: int, block: int, fp32_elements: int = 0) -> WireTally:
    """What :func:`fp8_all_reduce_hook` sends per step for parameters of ``sizes`` gradient elements each in FP8
    (each padded to whole blocks, as the hook pads it) and ``fp32_elements`` split out in fp32
    (:func:`fp32_all_reduce`), as if in one bucket (each of DDP's buckets pads to ``world x block`` elements: at most
    that many more per bucket)."""
    if world < 2:
        return WireTally()
    others = world - 1
    fp32 = WireTally(2 * (others * fp32_elements * _SCALE_BYTES // world), 0,
                     2 * (others * fp32_elements * BF16_BYTES // world), fp32_elements)
    elements = sum(sizes)
    if not elements:
        return fp32
    padded = sum(math.ceil(n / block) * block for n in sizes)
    sent, scales = _row_bytes(math.ceil(padded / (world * block)) * block, block)
    return fp32 + WireTally(2 * others * sent, 2 * others * scales, 2 * others * elements * BF16_BYTES // world,
                            elements)


def describe_tally(tally: WireTally, words: str) -> str:
    """One line: the bytes of a step's gradient reduction on this rank and its ratio to a bf16 reduction's."""
    from ..config.text import byte_size

    return (f"{byte_size(tally.sent)} sent per step by this rank ({words}; {byte_size(tally.scales)} of it "
            f"scales), {tally.ratio:.3f}x a bf16 reduction's {byte_size(tally.bf16)}")


def reduce_wire_bytes(parallel) -> float:
    """Bytes per gradient element on the wire under a StrategyConfig ``parallel``: ``reduce_dtype``'s size, or for
    fp8 one byte plus its share of the block's fp32 scale."""
    from ..config.dtypes import dtype_bytes

    return 1 + _SCALE_BYTES / parallel.reduce_fp8_block if parallel.reduce_dtype == "fp8" \
        else dtype_bytes(parallel.reduce_dtype)


def replica_reduce_bytes(parallel) -> float:
    """Bytes per gradient element of HSDP's all-reduce across replicas under a StrategyConfig ``parallel``: with
    ``reduce_dtype="fp8"`` only the shard group's reduce-scatter is quantized and FSDP2 all-reduces the shards in
    its policy's fp32; else :func:`reduce_wire_bytes`."""
    from ..config.dtypes import dtype_bytes

    return dtype_bytes("fp32") if parallel.reduce_dtype == "fp8" else reduce_wire_bytes(parallel)
