"""Tied parameters and FSDP units: a block that shares a parameter with a module outside it (BERT's word embeddings
and decoder) is no block but stays in the enclosing unit, as FSDP2 refuses a parameter another unit manages and FSDP1
leaves the other module computing with the unsharded original. Decided on names only (a meta model works)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["TiedBlock", "untie_blocks"]


@dataclass(frozen=True)
class TiedBlock:
    """A block left out of block-wise sharding because one of its parameters is tied to a module outside it."""

    block: str
    parameter: str  # its name inside the block
    tied_to: str  # its name outside the block

    @property
    def note(self) -> str:
        """The note wrap_model says for this tie: the block is sharded with its enclosing unit, and why."""
        return (f"{self.block} is not sharded as a block of its own: {self.parameter} is tied to {self.tied_to} "
                "outside it, and a tied parameter must live in one FSDP unit; it is sharded with the enclosing unit")


def _holders(model: nn.Module) -> list[list[str]]:
    """The names of each tied parameter, one list per parameter."""
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
