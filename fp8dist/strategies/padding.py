"""What FSDP2 allocates per rank, parameter by parameter, and when its padding deserves a note: FSDP2 cuts each
parameter along dim 0 with ``torch.chunk`` and every rank allocates the first chunk, so a dim 0 shorter than the world
(Mixtral's 8 fused experts on 64 ranks: 8x) is held as whole rows. Pure functions of shapes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PaddedParam", "shard_padding", "padding_note", "NOTE_ABOVE"]

NOTE_ABOVE = 1.10
"""The padding note appears when the padded total is at least this many times an even split."""


@dataclass(frozen=True)
class PaddedParam:
    """One parameter as FSDP2 shards it on dim 0 over ``world_size`` ranks."""

    name: str
    shape: tuple[int, ...]
    world_size: int

    @property
    def numel(self) -> int:
        """Elements of the parameter (the product of its shape)."""
        return math.prod(self.shape)

    @property
    def dim0(self) -> int:
        """Rows FSDP2 shards along (dim 0; a 0-d parameter counts as one row)."""
        return self.shape[0] if self.shape else 1  # a 0-d parameter counts as one row

    @property
    def row_numel(self) -> int:
        """Elements of one row (dim 0 slice); 0 for a parameter with no rows."""
        return self.numel // self.dim0 if self.dim0 else 0

    @property
    def rows_per_rank(self) -> int:
        """Rows every rank allocates: the first chunk's, ``ceil(dim0 / world_size)``."""
        return -(-self.dim0 // self.world_size)

    @property
    def padded_numel(self) -> int:
        """Elements every rank allocates for this parameter, padding included."""
        return self.rows_per_rank * self.row_numel

    @property
    def factor(self) -> float:
        """Allocated over an even split (1.0: no padding)."""
        return self.padded_numel * self.world_size / self.numel if self.numel else 1.0

    def rows_on(self, rank: int) -> int:
        """Real (unpadded) rows ``rank`` holds."""
        return max(0, min(self.rows_per_rank, self.dim0 - rank * self.rows_per_rank))

    def better_dim(self) -> int | None:
        """The first other dim the world size divides (FSDP2 shards dims but 0 only evenly); None: none."""
        return next((dim for dim, size in enumerate(self.shape[1:], start=1) if size % self.world_size == 0), None)


def shard_padding(shapes: Mapping[str, Sequence[int]], world_size: int) -> list[PaddedParam]:
    """Each parameter's per-rank allocation under FSDP2's dim-0 sharding, from its full shape by name."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer (the ranks FSDP2 shards over).")
    return [PaddedParam(name, tuple(int(s) for s in shape), world_size) for name, shape in shapes.items()]


def padding_note(padded: Sequence[PaddedParam]) -> str | None:
    """One line on FSDP2's padding when it costs at least ``NOTE_ABOVE`` times an even split, naming the parameters
    held as whole rows and the way out (shard them on another dim, or expert parallelism); None otherwise."""
    if not padded:
        return None
    world = padded[0].world_size
    allocated = sum(p.padded_numel for p in padded)
    even = sum(p.numel for p in padded) / world
    if allocated < NOTE_ABOVE * even:
        return None
    head = (f"FSDP2 pads each rank's shard to the first of {world} chunks along dim 0: every rank allocates "
            f"{allocated:,} elements where an even split is {even:,.0f} ({allocated / even:.2f}x)")
    whole = [p for p in padded if p.dim0 < world]
    if not whole:
        return head + "; fewer ranks, or dim-0 sizes the world size divides, shrink it"
    groups: dict[tuple[int, ...], list[PaddedParam]] = {}
    for p in sorted(whole, key=lambda p: -p.padded_numel):
        groups.setdefault(p.shape, []).append(p)
    named = "; ".join(f"{len(g)} x {shape} like {g[0].name} ({g[0].factor:.1f}x)" for shape, g in groups.items())
    if {p.better_dim() for p in whole} == {1}:
        where = (f"shard them on dim 1, which {world} divides: torch's fully_shard(module, shard_placement_fn="
                 f"lambda p: Shard(1) if p.dim() > 1 and p.shape[0] < {world} else None)")
    else:
        where = (f"shard each on a dim {world} divides (FSDP2 shards dims other than 0 only evenly) with torch's "
                 "fully_shard(module, shard_placement_fn=lambda p: Shard(dim) or None)")
    return (f"{head}; {len(whole)} parameters have dim 0 < {world} ranks and are held as whole rows: {named}. "
            f"The way out: {where} (fp8dist's strategy='fsdp' shards on dim 0), or expert parallelism (each rank "
            "holds whole experts) with FSDP over the remaining ranks")
