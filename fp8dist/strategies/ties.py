"""Tied parameters and FSDP units: one Parameter held by two modules (BERT's word embeddings and its masked-LM
decoder) must be sharded by one unit. FSDP2 refuses a parameter that another unit already manages ("shared with a
parameter already managed by another FSDP group"); FSDP1 flattens it into the first unit and leaves the other
module computing with the unsharded original (a dtype mismatch at step 1, or silently stale weights).

So a block (a unit of its own) that shares a parameter with a module outside it is no block: it stays in the
enclosing unit (another block that holds every holder of the parameter, or what the root shards), where the tie is
one parameter of one unit. Decided on names and identities only, before anything is sharded (a meta model works).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["TiedBlock", "untie_blocks"]


@dataclass(frozen=True)
class TiedBlock:
    """A block left out of block-wise sharding because one of its parameters is tied to a module outside it."""

    block: str
    """The block's name (it is sharded with the enclosing unit instead)."""
    parameter: str
    """The tied parameter, by its name inside the block's holder."""
    tied_to: str
    """The same parameter's name outside the block."""

    @property
    def note(self) -> str:
        return (f"{self.block} is not sharded as a block of its own: {self.parameter} is tied to {self.tied_to} "
                "outside it, and a tied parameter must live in one FSDP unit; it is sharded with the enclosing unit")


def _holders(model: nn.Module) -> list[list[str]]:
    """The names of every parameter held under more than one name (tied), one list per parameter."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def untie_blocks(model: nn.Module, blocks: list[tuple[str, nn.Module]]) \
        -> tuple[list[tuple[str, nn.Module]], tuple[TiedBlock, ...]]:
    """``blocks`` without those that share a parameter with a module outside them, and why each was left out.
    Repeated until none is left: a block that takes the parameters of one left out may itself be tied outward."""
    kept, left_out = list(blocks), []
    groups = _holders(model)
    changed = True
    while changed:
        changed = False
        for group in groups:
            for block, _ in kept:
                mine = [n for n in group if n.startswith(block + ".")]
                other = [n for n in group if not n.startswith(block + ".")]
                if mine and other:
                    left_out.append(TiedBlock(block, mine[0], other[0]))
                    kept = [(n, m) for n, m in kept if n != block]
                    changed = True
                    break
    return kept, tuple(left_out)
