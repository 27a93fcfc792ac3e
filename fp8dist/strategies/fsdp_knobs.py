"""FSDP's knobs (:class:`FSDPConfig`, the ``Config`` of strategies fsdp and fsdp1): how long a unit keeps its gathered
parameters and, FSDP2 alone, how many whole replicas HSDP keeps. Known without importing torch (the CLI's flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FSDPConfig"]


@dataclass(kw_only=True, frozen=True)
class FSDPConfig:
    """FSDP's own knobs (flat keys of the config): fsdp (FSDP2) reads both, fsdp1 ``reshard_after_forward`` alone
    (each strategy's ``options`` says when it reads them; one set but not read is reported)."""

    reshard_after_forward: bool = True
    """FSDP: free each block's gathered parameters after forward (ZeRO-3 style); false keeps them for backward
    (ZeRO-2 style: more memory, less communication). FSDP2's final norm and output unit always keeps them."""

    replicate_degree: int = field(default=1, metadata={"min": 1})
    """FSDP2 HSDP: split the ranks into this many groups that each hold a whole copy of the model, sharded within
    the group (world size / replicate_degree ranks; torchtitan's data_parallel_replicate_degree); gradients are
    reduce-scattered within a group and all-reduced across groups. Set it to the number of nodes to shard within
    a node and replicate across nodes; 1: shard over every rank."""
