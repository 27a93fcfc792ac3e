"""Will each cell of ``fp8dist bench`` fit on its GPU? fp8dist's memory estimate of every cell (on a meta-device
model) against the GPU's memory, before any process starts; a cell that will not fit is refused with the bench flag
that makes it fit, rather than run out of memory minutes later."""

from __future__ import annotations

from typing import Any

from ..accounting import estimate_memory
from ..accounting.fit import MEMORY_FRACTION, budget, device_bytes, ways_out
from ..config.schema import cli_flag
from ..config.text import byte_size
from .cell import Cell, cell_options, cell_world

__all__ = ["MEMORY_FRACTION", "cell_bytes", "check_cells_fit", "gpu_budget"]

# the bench's flag for each option a way out changes (the bench has none for the others, e.g. the strategy)
_FLAGS = {"world_size": "--nproc", "activation_checkpointing": "--activation-checkpointing",
          "micro_batch_size": "--batch-size", "memory": "--memory"}


def gpu_budget(nproc: int) -> int:
    """Bytes a cell may plan on per rank: :data:`MEMORY_FRACTION` of the smallest of the first ``nproc`` GPUs."""
    import torch

    return budget(min(torch.cuda.get_device_properties(i).total_memory for i in range(max(1, nproc))))


def _options(cell: Cell, world: int) -> dict[str, Any]:
    """:func:`fp8dist.estimate_memory`'s keywords (and ``fp8dist estimate``'s flags) for ``cell`` on ``world`` ranks."""
    return dict(strategy=cell.strategy, **cell_options(cell), world_size=world, seq_len=cell.seq_len,
                micro_batch_size=cell.batch_size, fp8=cell.fp8, activation_checkpointing=cell.activation_checkpointing,
                memory=cell.memory, compile=cell.compile)


def _estimate(cell: Cell, world: int, model: Any, **change: Any) -> Any:
    return estimate_memory(model, **{**_options(cell, world), **change})


def cell_bytes(cell: Cell, nproc: int, model: Any) -> tuple[int, str]:
    """The estimated GPU bytes per rank of ``cell`` (``model``: its size on the meta device), and how they add up.
    A vs-raw cell holds both models' states but one's gradients (each run frees them after its step) and one's
    activations at a time."""
    est = _estimate(cell, cell_world(cell, nproc), model)
    acts = est.activation_bytes if est.activations_modelled else 0
    states = device_bytes(est) - acts  # offloaded states are in host memory
    twin = states - est.bytes["gradients"] if cell.wiring == "vs-raw" else 0
    activations = (f"{byte_size(acts)} activations of {cell.batch_size} x {cell.seq_len} tokens"
                   if est.activations_modelled else
                   f"activations not estimated for AC {cell.activation_checkpointing!r}")
    held = f" + {byte_size(twin)} of the hand-wired twin's (no gradients held)" if twin else ""
    return states + twin + acts, f"{byte_size(states)} model states{held} + {activations}"


def check_cells_fit(cells: list[Cell], nproc: int, budget: int) -> None:
    """ValueError naming the first cell whose estimate exceeds ``budget`` bytes per rank, and the way out."""
    import torch

    from ..train.models import build_llama

    models: dict[str, Any] = {}
    for cell in cells:
        if cell.size not in models:
            with torch.device("meta"):
                models[cell.size] = build_llama(cell.size, max_seq_len=cell.seq_len)
        need, parts = cell_bytes(cell, nproc, models[cell.size])
        if need > budget:
            raise ValueError(f"cell {cell.name} will not fit: fp8dist's estimate is {byte_size(need)} per rank "
                             f"({parts}) and a cell may plan on {byte_size(budget)} of this GPU "
                             f"({MEMORY_FRACTION:.0%} of its memory). {_way_out(cell, nproc, budget, models)}")


def _estimate_command(cell: Cell, nproc: int) -> str:
    flags = [f"{cli_flag(k)} {'none' if v is None else 'true' if v is True else v}"
             for k, v in _options(cell, cell_world(cell, nproc)).items() if v is not False]
    return " ".join([f"fp8dist estimate --model-size {cell.size}", *flags])


def _way_out(cell: Cell, nproc: int, budget: int, models: dict[str, Any]) -> str:
    """The first way out of the estimate's search (and a smaller batch) that fits and that a bench flag makes."""
    if cell.wiring == "vs-raw":
        return ("It trains fp8dist's model and the hand-wired one side by side in one process: pass --no-raw, or run "
                "on more GPUs (--nproc), over which FSDP2 shards both.")
    model = models[cell.size]
    smaller = tuple(("a smaller batch", {"micro_batch_size": n}) for n in dict.fromkeys((cell.batch_size // 2, 1))
                    if 1 <= n < cell.batch_size)
    ways, _ = ways_out(_estimate(cell, cell_world(cell, nproc), model), budget,
                       lambda world, **change: _estimate(cell, world, model, **change), extra=smaller)
    ours = [(" ".join(f"{_FLAGS[k]} {v}" for k, v in w.change.items()), w) for w in ways
            if set(w.change) <= set(_FLAGS)]
    fitting = next(((flags, w) for flags, w in ours if w.fits), None)
    more = "run on more GPUs with --strategies fsdp (it shards the model states over --nproc)"
    if fitting:
        flags, way = fitting
        way = f"Pass {flags} (estimated {byte_size(way.device_bytes)})" + \
            ("" if "world_size" in way.change else f", or {more}")
    else:
        tried = [flags for flags, w in ours if len(w.change) == 1]  # and each with checkpointing: none fits
        none = f"Not even {', '.join(tried[:-1])}{' or ' if tried[1:] else ''}{tried[-1]} fits" if tried else \
            "No flag of the bench makes it fit"
        way = f"{none}: {more}, or leave {cell.size} out of --sizes"
    return f"{way}. The breakdown: {_estimate_command(cell, nproc)}"
