"""A training step's collectives over its topology: FSDP's all-gathers and reduce-scatters (HSDP's all-reduce
across replicas), DDP's all-reduce, each a ring at NVLink bandwidth inside one NVLink domain and at the network's
across domains, and what of them the compute does not hide. :mod:`.step_time` adds them to the step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...runtime.gpus import GpuSpec

if TYPE_CHECKING:
    from .constants import StepConstants

__all__ = ["check_topology", "topology", "collectives", "exposed_collectives"]


def check_topology(nvlink_domain: Any, network_gbps: Any) -> None:
    """ValueError naming the value and its meaning for an ``nvlink_domain`` that is not a positive integer or a
    ``network_gbps`` that is not a positive number (None: the GPU record's, always valid)."""
    if nvlink_domain is not None and (isinstance(nvlink_domain, bool) or not isinstance(nvlink_domain, int)
                                      or nvlink_domain < 1):
        raise ValueError(f"nvlink_domain={nvlink_domain!r}: a positive integer, the GPUs one NVLink domain joins "
                         "(8 for an HGX / DGX node, 72 for an NVL72 rack); None: the GPU record's.")
    if network_gbps is not None and (isinstance(network_gbps, bool) or not isinstance(network_gbps, (int, float))
                                     or not network_gbps > 0):
        raise ValueError(f"network_gbps={network_gbps!r}: a positive number, GB/s per GPU between NVLink domains "
                         "(gigabytes: a 400 Gb/s NIC is 50); None: the GPU record's.")


def topology(spec: GpuSpec, nvlink_domain: int | None, network_gbps: float | None) -> tuple[int, float, str]:
    """(NVLink domain, network GB/s, their source): the GPU record's unless given."""
    domain = spec.nvlink_domain if nvlink_domain is None else nvlink_domain
    network = spec.network_gbps if network_gbps is None else float(network_gbps)
    given = [f"{name}={value!r}" for name, value in (("nvlink_domain", nvlink_domain), ("network_gbps", network_gbps))
             if value is not None]
    record = f"{spec.key} record: {spec.nvlink_domain}-GPU NVLink domain; network {spec.network_source}"
    return domain, network, (f"given: {', '.join(given)}; otherwise the {record}" if given else f"the {record}")


def _ring_s(moved: float, ranks: int, within_domain: bool, spec: GpuSpec, network_gbps: float,
            c: StepConstants) -> float:
    """Seconds of a ring collective over ``ranks`` ranks of ``moved`` bytes per rank (each rank sends (n-1)/n of
    them): at the GPU's NVLink (or PCIe) bandwidth inside one NVLink domain, at the slower of that and the network's
    across domains."""
    if ranks <= 1:
        return 0.0
    link = spec.interconnect_gbps / 2 if within_domain else min(spec.interconnect_gbps / 2, network_gbps)
    return moved * (ranks - 1) / ranks / (link * 1e9 * c.collective_fraction)


def collectives(spec: GpuSpec, facts: Any, world_size: int, params: tuple[int, int], fp8_params: int,
                 reduce_bytes: tuple[float, float], domain: int, network_gbps: float, c: StepConstants) -> float:
    """Seconds of a step's collectives: of ``params`` (all, trainable), FSDP gathers all twice within its shard
    group and reduce-scatters the trainable ones' gradients there; HSDP (a shard group smaller than the world, its
    ranks contiguous) then all-reduces each rank's gradient shard across the replicas (twice the bytes of one pass,
    over the network once the world spans NVLink domains). A replicating strategy all-reduces the gradients over
    every rank. ``spec``: the GPU; ``facts``: the strategy's (``shards_params``, ``shard_degree``); ``world_size``:
    ranks; ``fp8_params``: elements gathered in FP8 (one byte each, bf16 two); ``reduce_bytes``: per gradient
    element, (in the shard group or the replicating all-reduce, in HSDP's all-reduce across replicas); ``domain`` and
    ``network_gbps``: the topology (:func:`topology`); ``c``: the step model's constants.

    Raises:
        ValueError: ``world_size`` > 1 on a GPU whose record gives no GPU-to-GPU bandwidth.
    """
    if world_size == 1:
        return 0.0
    if spec.interconnect_gbps is None:
        raise ValueError(f"{spec.label}: the GPU table gives no GPU-to-GPU bandwidth, so collectives cannot be "
                         "predicted: predict world_size=1 or a GPU whose record has it.")
    params, trainable = params
    reduce_bytes, replica_bytes = reduce_bytes
    one_domain = world_size <= domain
    if not facts.shards_params:
        return _ring_s(2 * reduce_bytes * trainable, world_size, one_domain, spec, network_gbps, c)
    shard = facts.shard_degree or world_size
    gathered = 2 * (params - fp8_params) + fp8_params  # bf16 weights 2 bytes, FP8-gathered ones 1
    inside = _ring_s(2 * gathered + reduce_bytes * trainable, shard, shard <= domain, spec, network_gbps, c)
    return inside + _ring_s(2 * replica_bytes * trainable / shard, world_size // shard, one_domain, spec, network_gbps,
                            c)


def exposed_collectives(collective_s: float, compute_s: float, optimizer_s: float, blocks: int,
                        shards: bool) -> float:
    """What of ``collective_s`` a step's compute does not hide: one block's worth, and whatever exceeds the compute
    it overlaps (FSDP: all of it; a replicating strategy's all-reduce: the backward, two thirds of the rest).
    The fits (``benchmarks/step_model/``) call it on parts they recombine with trial constants."""
    hiding = compute_s if shards else (compute_s - optimizer_s) * 2 / 3
    return collective_s / blocks + max(0.0, collective_s - hiding)
