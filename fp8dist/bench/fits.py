"""Will each cell of ``fp8dist bench`` fit on its GPU? fp8dist's own memory estimate (:func:`fp8dist.estimate_memory`,
on a meta-device model: nothing is allocated) of every cell against the GPU's memory, before any process starts.

A cell that the estimate says will not fit is refused with the way out (activation checkpointing, a smaller batch,
memory="lean", more GPUs, ``--no-raw``), rather than run into an out-of-memory error minutes later.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config.rules import refusal_of
from ..accounting.fit import MEMORY_FRACTION, budget, device_bytes
from ..memory_levels import LEVELS, STANDARD
from .cell import Cell, cell_options, cell_world

__all__ = ["MEMORY_FRACTION", "cell_bytes", "check_memory", "gpu_budget"]

_GIB = 2**30


def gpu_budget(nproc: int) -> int:
    """Bytes a cell may plan on per rank: :data:`MEMORY_FRACTION` of the smallest GPU's memory among the first
    ``nproc`` (one process per GPU)."""
    import torch

    total = min(torch.cuda.get_device_properties(i).total_memory for i in range(max(1, nproc)))
    return budget(total)


def cell_bytes(cell: Cell, nproc: int, model: Any) -> tuple[int, str]:
    """The GPU bytes per rank that fp8dist's estimate predicts for ``cell`` (the meta-device ``model`` of its
    size), and how they add up. A vs-raw cell holds two models in one process: both models' states, but the
    gradients of one only (each run frees its gradients after its step) and the activations of one at a time."""
    from ..accounting import estimate_memory

    est = estimate_memory(model, strategy=cell.strategy, fp8=cell.fp8, compile=cell.compile,
                          activation_checkpointing=cell.activation_checkpointing, memory=cell.memory,
                          world_size=cell_world(cell, nproc), micro_batch_size=cell.batch_size, seq_len=cell.seq_len,
                          **cell_options(cell))
    acts = est.activation_bytes if est.activations_modelled else 0
    states = device_bytes(est) - acts  # offloaded states are in host memory
    tokens = f"{cell.batch_size} x {cell.seq_len} tokens"
    if cell.wiring == "vs-raw":
        second = states - est.bytes["gradients"]
        parts = (f"{states / _GIB:.1f} GiB model states + {second / _GIB:.1f} GiB of the hand-wired twin's (no "
                 f"gradients held) + {acts / _GIB:.1f} GiB activations of {tokens}")
        return states + second + acts, parts
    parts = f"{states / _GIB:.1f} GiB model states + " + (f"{acts / _GIB:.1f} GiB activations of {tokens}"
                                                          if est.activations_modelled else
                                                          f"activations not estimated for AC "
                                                          f"{cell.activation_checkpointing!r}")
    return states + acts, parts


def check_memory(cells: list[Cell], nproc: int, budget: int) -> None:
    """Every cell's estimate within ``budget`` bytes per rank (see :func:`gpu_budget`); ValueError naming the first
    cell that is not, its estimate, and the way out."""
    import torch

    from ..train.models import build_llama

    models: dict[str, Any] = {}
    for cell in cells:
        if cell.size not in models:
            with torch.device("meta"):
                models[cell.size] = build_llama(cell.size, max_seq_len=cell.seq_len)
        need, parts = cell_bytes(cell, nproc, models[cell.size])
        if need > budget:
            raise ValueError(f"cell {cell.name} will not fit: fp8dist's estimate is {need / _GIB:.1f} GiB per rank "
                             f"({parts}) and a cell may plan on {budget / _GIB:.1f} GiB of this GPU "
                             f"({MEMORY_FRACTION:.0%} of its memory). {_way_out(cell, nproc, budget, models)}")


def _estimate_command(cell: Cell, nproc: int) -> str:
    """The ``fp8dist estimate`` command that prints the breakdown of a (plain) cell."""
    return " ".join([f"fp8dist estimate --model-size {cell.size} --strategy {cell.strategy}",
                     *(f"--{k.replace('_', '-')} {v}" for k, v in cell_options(cell).items()),
                     f"--world-size {cell_world(cell, nproc)} --seq-len {cell.seq_len} --micro-batch-size "
                     f"{cell.batch_size} --fp8 {cell.fp8 or 'none'} --activation-checkpointing "
                     f"{cell.activation_checkpointing} --memory {cell.memory}",
                     *(["--compile true"] if cell.compile else [])])


def _way_out(cell: Cell, nproc: int, budget: int, models: dict[str, Any]) -> str:
    """What to change, each alternative estimated in turn: the first one that fits is named with its figure."""
    if cell.wiring == "vs-raw":
        return ("It trains fp8dist's model and the hand-wired one side by side in one process: pass --no-raw, or run "
                "on more GPUs (--nproc), over which FSDP2 shards both.")
    tries = []
    if cell.activation_checkpointing != "full":
        tries.append(("--activation-checkpointing full", replace(cell, activation_checkpointing="full")))
    tries += [(f"--batch-size {n}", replace(cell, batch_size=n)) for n in (cell.batch_size // 2, 1)
              if 1 <= n < cell.batch_size]
    if cell.memory == STANDARD.name:  # from fp32 masters, each other level the table allows here
        tries += [(f"--memory {name}", replace(cell, memory=name)) for name in LEVELS
                  if name != cell.memory and refusal_of(strategy=cell.strategy, memory=name) is None]
    fitting = next(((flag, need) for flag, other in tries
                    if (need := cell_bytes(other, nproc, models[cell.size])[0]) <= budget), None)
    more = "run on more GPUs with --strategies fsdp (it shards the model states over --nproc)"
    tried = ["--activation-checkpointing full", "--batch-size 1", *(f for f, _ in tries if f.startswith("--memory"))]
    way = (f"Pass {fitting[0]} (estimated {fitting[1] / _GIB:.1f} GiB), or {more}" if fitting else
           f"Not even {', '.join(tried[:-1])} or {tried[-1]} fits: {more}, or leave {cell.size} out of --sizes")
    return f"{way}. The breakdown: {_estimate_command(cell, nproc)}"
