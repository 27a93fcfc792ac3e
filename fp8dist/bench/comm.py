"""Count the collectives a step issues and their bytes, by type: every engine's collectives reach the dispatcher as
``c10d`` or ``_c10d_functional`` ops, so one ``TorchDispatchMode`` sees them all (unlike ``CommDebugMode``, it counts
bytes: each collective's full buffer, nccl-tests' message size)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CommCounts", "CommCounter"]

# op name (without namespace and overload) -> collective type; c10d's in-place ops end in "_"
_KINDS = {
    "all_gather": ("_allgather_base_", "allgather_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
                   "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out"),
    "reduce_scatter": ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_",
                       "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
    "all_reduce": ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_coalesced"),
    "broadcast": ("broadcast_", "broadcast"),
    "all_to_all": ("alltoall_", "alltoall_base_", "all_to_all_single"),
    "reduce": ("reduce_",),
    "gather": ("gather_",),
    "scatter": ("scatter_",),
    "send_recv": ("send", "recv_", "recv_any_source_"),
}
SHOWN_TYPES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")  # the rest are summed as "other"
_KIND_OF = {name: kind for kind, names in _KINDS.items() for name in names}
_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


@dataclass
class CommCounts:
    """Collectives seen, by type: calls and full-buffer bytes."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dtypes: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # FSDP2 moves FP8/bf16 as uint8

    def add(self, kind: str, nbytes: int, dtypes: set[str]) -> None:
        """Count one collective of ``kind`` sending ``nbytes``, with the dtypes it carried."""
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        self.dtypes[kind] |= dtypes

    def to_dict(self) -> dict[str, dict]:
        """``{type: {"calls": n, "bytes": b, "dtypes": [...]}}``, types sorted."""
        return {k: {"calls": self.calls[k], "bytes": self.bytes[k], "dtypes": sorted(self.dtypes[k])}
                for k in sorted(self.calls)}


class CommCounter(TorchDispatchMode):
    """Count the collectives issued on this rank while active (``with CommCounter() as comm``, then
    ``comm.counts``). Every op passes through Python while it is active: count one step, time the others."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = CommCounts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run and issue its collectives, which come back here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # None for ops that are not collectives, or move no payload (wait_tensor, barrier)
        kind = _KIND_OF.get(func._opname) if getattr(func, "namespace", None) in _NAMESPACES else None
        if kind is not None:
            # the full buffer is the largest of the op's tensor arguments (outputs, inputs) and its result
            parts = [*args[:2], out] if kind != "send_recv" else [args[0]]
            dtypes = {str(t.dtype).removeprefix("torch.") for t in tree_leaves(parts[0])
                      if isinstance(t, torch.Tensor)}
            self.counts.add(kind, max(_nbytes(p) for p in parts), dtypes)
        return out
