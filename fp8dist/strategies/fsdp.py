"""strategy="fsdp": FSDP2 (``fully_shard``), per-parameter DTensor shards; HSDP on a 2-D mesh."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..config.axis import ALWAYS, StrategyFacts, When
from ..config.dtypes import dtype_bytes, torch_dtype
from ..config.text import plural
from .base import (EngineDtypes, EngineMemory, ParamLayout, Sharded, ShardingInfo, ShardJob, Strategy, fill_shards,
                   prepared, reduce_words)
from .common import cast_buffers, shard_blocks, to_empty
from .fsdp_knobs import FSDPConfig
from .grad_fp8 import (GradWire, apply_fp8_reduce_scatter, fp8_wire_words, model_grad_wire, predict_reduce_scatter,
                       unit_owning)
from .padding import padding_note, shard_padding
from .state_bytes import ROOT_WEIGHTS_ITEM, UNSHARDED_ITEM, fsdp2_state_bytes, gathered_blocks_note
from .ties import untie_blocks

__all__ = ["FSDP2", "build_fsdp_policy", "apply_fsdp", "fsdp_padding_notes", "fsdp_mesh", "check_replicate_degree",
           "root_units", "RootUnit", "STRATEGY"]


def reduce_buffer_dtype(parallel) -> torch.dtype:
    """The dtype FSDP2's reduction buffers hold: ``reduce_dtype``'s, fp32 for fp8 (the FP8 reduce-scatter's
    input and its fp32 sum)."""
    return torch.float32 if parallel.reduce_dtype == "fp8" else torch_dtype(parallel.reduce_dtype)


def build_fsdp_policy(*, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2 mixed precision: parameters gathered in ``param_dtype``, gradients reduce-scattered in
    ``reduce_dtype``; buffers are left alone (fp8dist casts them)."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def fsdp_mesh(device: torch.device, world_size: int, replicate_degree: int = 1) -> DeviceMesh:
    """FSDP2's mesh: 1-D over every rank, or 2-D ``(replicate, shard)`` for HSDP (rank ``r`` is in shard group
    ``r // shard_degree``)."""
    check_replicate_degree(replicate_degree, world_size)
    if replicate_degree == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device.type, (replicate_degree, world_size // replicate_degree),
                            mesh_dim_names=("dp_replicate", "dp_shard"))


def check_replicate_degree(replicate_degree: int, world_size: int) -> None:
    """ValueError unless ``replicate_degree`` splits ``world_size`` ranks into equal shard groups."""
    if replicate_degree < 1 or world_size % replicate_degree:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"replicate_degree={replicate_degree} does not split world size {world_size} into equal "
                         f"shard groups: choose one of {divisors} (the number of nodes shards within a node), or 1 "
                         "to shard over every rank.")


@dataclass(frozen=True)
class RootUnit:
    """Modules outside the blocks that FSDP2 shards together as one unit, before the root."""

    names: tuple[str, ...]
    reshard_after_forward: bool  # False for the unit the backward needs first (torchtitan's choice)


def root_units(model: nn.Module, block_names: list[str] | tuple[str, ...],
               reshard_after_forward: bool = True) -> tuple[RootUnit, ...]:
    """How FSDP2 shards what the blocks leave, as torchtitan does: the input embedding as a unit of its own, the
    rest (final norm, output layer) as one unit kept gathered from its forward to its backward; a tied embedding and
    output layer stay one unit. Empty without blocks. Reads names and shapes only: a meta model works."""
    if not block_names:
        return ()
    inside = tuple(f"{b}." for b in block_names)
    held = [(name, module) for name, module in model.named_modules()
            if name and not name.startswith(inside) and name not in block_names
            and any(True for _ in module.parameters(recurse=False))]
    if not held:
        return ()
    embedding = _input_embedding(model, held)
    if embedding is None:
        return (RootUnit(tuple(n for n, _ in held), False),)
    rest = [(n, m) for n, m in held if n != embedding]
    mine = {id(p) for p in dict(held)[embedding].parameters()}
    if not rest or any(id(p) in mine for _, m in rest for p in m.parameters(recurse=False)):  # tied, or alone
        return (RootUnit(tuple(n for n, _ in held), not rest and reshard_after_forward),)
    return (RootUnit((embedding,), reshard_after_forward), RootUnit(tuple(n for n, _ in rest), False))


def _input_embedding(model: nn.Module, held: list[tuple[str, nn.Module]]) -> str | None:
    """Hugging Face's get_input_embeddings() among ``held``, else the first nn.Embedding."""
    getter, found = getattr(model, "get_input_embeddings", None), None
    with contextlib.suppress(NotImplementedError, AttributeError):
        found = getter() if callable(getter) else None
    for name, module in held:
        if module is found or found is None and isinstance(module, nn.Embedding):
            return name
    return None


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], *, mesh: DeviceMesh | None, device: torch.device,
               mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool,
               block_names: tuple[str, ...] = ()) -> nn.Module:
    """Shard each block with ``fully_shard``, then what the blocks leave (:func:`root_units`, when ``block_names``
    names them), then the root, in place; returns ``model``. ``mesh`` None shards over every rank; a 2-D one is HSDP.
    Call after FP8 conversion and before building the optimizer. ValueError: a block holds a parameter tied to a
    module outside it (FSDP2 would refuse it mid-way)."""
    _check_untied(model, blocks)
    if mesh is None:
        mesh = fsdp_mesh(device, torch.distributed.get_world_size())
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    modules = dict(model.named_modules())
    for unit in root_units(model, block_names, reshard_after_forward):
        group = [modules[n] for n in unit.names]
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=unit.reshard_after_forward)
    # the root holds what backward needs first: freeing it after forward would gather it again at once
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    return model


def _check_untied(model: nn.Module, blocks: list[nn.Module]) -> None:
    names = {id(m): n for n, m in model.named_modules()}
    _, ties = untie_blocks(model, [(names.get(id(b), ""), b) for b in blocks])
    if ties:
        t = ties[0]
        raise ValueError(f"block {t.block!r} holds {t.parameter}, tied to {t.tied_to} outside it, and FSDP2 shards a "
                         f"tied parameter in one unit only. Leave {t.block!r} out of the blocks (find_blocks does), "
                         "or untie the parameters.")


def fsdp_padding_notes(model: nn.Module, world_size: int) -> tuple[str, ...]:
    """:func:`~fp8dist.strategies.padding.padding_note` of ``model`` on ``world_size`` ranks, if any."""
    note = padding_note(shard_padding({n: tuple(p.shape) for n, p in model.named_parameters()}, world_size))
    return (note,) if note else ()


class FSDP2(Strategy):
    """FSDP2: the blocks, torchtitan's units outside them, then the root, sharded in place; a meta model is
    materialized after sharding, each rank allocating and filling only its shards."""

    name = "fsdp"
    engine_words = "sharded by fully_shard (FSDP2)"
    Config = FSDPConfig
    reduce_fallback_unit = "FSDP2 unit"
    accelerate = {"distributed_type": "FSDP", "fsdp_version": 2}
    bench_devices = ("cpu", "cuda")
    options = {"reshard_after_forward": ALWAYS, "replicate_degree": ALWAYS, "block_classes": ALWAYS,
               "reduce_dtype": ALWAYS, "reduce_fp8_block": When({"reduce_dtype": ("fp8",)})}

    def is_engine(self, module: object) -> bool:
        """A module ``fully_shard`` sharded in place (an ``FSDPModule``)."""
        return isinstance(module, FSDPModule)

    def facts(self, cfg, world_size=None) -> StrategyFacts:
        """Per-parameter DTensor shards over ``world_size / replicate_degree`` ranks (HSDP replicates
        across the groups); FSDP2 casts gradients for the reduce-scatter."""
        shards = None if world_size is None else world_size // max(1, cfg.parallel.replicate_degree)
        return StrategyFacts(dtensor_shards=True, casts_gradients=True, shard_degree=shards)

    def check_launch(self, cfg, world_size: int) -> None:
        """ValueError unless ``replicate_degree`` splits the ranks into equal shard groups."""
        check_replicate_degree(cfg.parallel.replicate_degree, world_size)

    def check_mesh(self, mesh, cfg) -> None:
        """A 1-D mesh shards over its ranks; a 2-D one is HSDP, ``(replicate, shard)``, whose replica count must be
        the ``replicate_degree`` the plan and the memory figures read."""
        replicas = mesh.shape[0] if mesh.ndim == 2 else 1
        if mesh.ndim not in (1, 2):
            raise ValueError(f"wrap_model: strategy={self.name!r} shards over a 1-D mesh, or a 2-D (replicate, "
                             f"shard) one for HSDP; mesh {tuple(mesh.shape)} has {mesh.ndim} dimensions.")
        if replicas != cfg.parallel.replicate_degree:
            what = f"a 2-D mesh {tuple(mesh.shape)}: {replicas} replicas" if mesh.ndim == 2 else "a 1-D mesh: 1 replica"
            raise ValueError(f"wrap_model: mesh is {what}, but replicate_degree={cfg.parallel.replicate_degree}: "
                             f"pass replicate_degree={replicas} with this mesh (the plan and the memory figures read "
                             "it), or a mesh of that many replicas.")

    def shard(self, model: nn.Module, job: ShardJob) -> Sharded:
        """``fully_shard`` each block, torchtitan's units outside them, then the root, in place, over the
        user's mesh or a 1-D / HSDP 2-D one; the FP8 reduce-scatter wired for ``reduce_dtype='fp8'``; a meta model
        allocates this rank's shards only."""
        p, env = job.cfg.parallel, job.env
        found, how, notes = shard_blocks(model, job)
        names = tuple(n for n, _ in found)
        model, built = prepared(model, job)
        cast_buffers(model, torch_dtype(p.buffer_dtype))
        policy = build_fsdp_policy(param_dtype=torch_dtype(p.param_dtype), reduce_dtype=reduce_buffer_dtype(p))
        mesh = job.mesh if job.mesh is not None else fsdp_mesh(env.device, env.world_size, p.replicate_degree)
        apply_fsdp(model, [m for _, m in found], mesh=mesh,
                   device=env.device, mp_policy=policy, reshard_after_forward=p.reshard_after_forward,
                   block_names=names)
        notes += fsdp_padding_notes(model, env.world_size // p.replicate_degree)
        if p.reduce_dtype == "fp8":
            notes += apply_fp8_reduce_scatter(model, GradWire(p.reduce_fp8_block), job.reduce_fallback)
            if p.replicate_degree > 1:
                notes += ("reduce_dtype='fp8': the reduce-scatter within each shard group sends FP8, the all-reduce "
                          "across replicas stays fp32",)
        if job.meta:
            to_empty(model, env.device)  # this rank's shards only
        loaded, how_made = fill_shards(model, job)
        return Sharded(model, ShardingInfo(self.name, names, how, notes=notes), loaded, how_made, built)

    def shard_by_hand(self, model: nn.Module, units: list[tuple[list[nn.Module], bool]],
                      device: torch.device) -> nn.Module:
        """FSDP2 as its documentation wires it: each unit then the root, bf16 parameters, fp32 reduction."""
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        for modules, reshard in units:
            fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, mp_policy=policy,
                        reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """``set_requires_gradient_sync(False)`` on the root for the block, restored after it."""
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def layout_notes(self, model: nn.Module, cfg, world_size: int) -> tuple[str, ...]:
        """FSDP2's dim-0 padding where it is large on a shard group of ``world_size / replicate_degree``
        ranks."""
        return fsdp_padding_notes(model, self.facts(cfg, world_size).shard_degree)

    def estimate_engine(self, model: nn.Module, cfg, world_size: int, blocks: list[str], *, optimizer: str,
                        on_cpu: bool) -> EngineMemory:
        """No master copy; notes on gathered blocks, dim-0 padding and HSDP's replicas."""
        replicas = cfg.parallel.replicate_degree
        notes = [*gathered_blocks_note(model, blocks, dtype_bytes(cfg.parallel.param_dtype)),
                 *fsdp_padding_notes(model, world_size // replicas)]
        if replicas > 1:
            notes.append(f"HSDP: {replicas} replicas, each sharded over {plural(world_size // replicas, 'rank')}")
        return EngineMemory(notes=tuple(notes))

    def rank_state_bytes(self, params, cfg, world_size: int, engine: EngineMemory, *, step: int, level_states,
                         backend_optimizer: bool) -> list[dict[str, int]]:
        """FSDP2's padded dim-0 shards within a shard group, the same on each replica."""
        replicas = cfg.parallel.replicate_degree
        group = fsdp2_state_bytes(params, world_size // replicas, step, level_states)
        return [dict(d) for _ in range(replicas) for d in group]

    def kept_for_backward(self, model: nn.Module, cfg, blocks: list[str]) -> list[tuple[str, int]]:
        """Without resharding every weight stays gathered; with it, the root units FSDP2 keeps (the
        final norm and output layer)."""
        if not cfg.parallel.reshard_after_forward:
            return [(UNSHARDED_ITEM, sum(p.numel() for p in model.parameters()))]
        if not blocks:
            return []
        freed = tuple(f"{name}." for name in blocks) + tuple(
            f"{name}." for unit in root_units(model, blocks) if unit.reshard_after_forward for name in unit.names)
        root = {id(p): p.numel() for n, p in model.named_parameters() if not n.startswith(freed)}
        return [(ROOT_WEIGHTS_ITEM, sum(root.values()))]

    def grad_wire(self, model: nn.Module, cfg, world_size: int, blocks: list[str], fallback: tuple[str, ...] = ()):
        """One FP8 reduce-scatter per unit (the blocks, :func:`root_units`, the root), of its trained parameters
        with dim 0 padded to the shard group as FSDP2 pads it; in fp32 for a unit holding one of ``fallback``."""
        p = cfg.parallel
        if p.reduce_dtype != "fp8":
            return None
        shard = world_size // p.replicate_degree
        units = [[b] for b in blocks] + [list(u.names) for u in root_units(model, blocks)] + [[""]]
        seen: set[int] = set()
        sizes = []
        for names in units:
            params = [q for name in names for q in model.get_submodule(name).parameters()]
            fresh = [q for q in dict.fromkeys(params) if id(q) not in seen]  # a tied parameter counts once
            seen.update(id(q) for q in fresh)
            sizes.append(sum(math.ceil(q.shape[0] / shard) * shard * (q.numel() // q.shape[0]) if q.dim() else 1
                             for q in fresh if q.requires_grad))
        fp32 = frozenset(unit_owning(name, units) for name in fallback)
        return predict_reduce_scatter(sizes, shard, p.reduce_fp8_block, fp32)

    def engine_dtypes(self, model: nn.Module, autocast) -> EngineDtypes:
        """The root's ``MixedPrecisionPolicy``; the FP8 wire where the reduce-scatter sends FP8."""
        policy, wire = model._get_fsdp_state()._mp_policy, model_grad_wire(model)
        reduce = fp8_wire_words(wire) if wire else reduce_words(policy.reduce_dtype or policy.param_dtype, model)
        return EngineDtypes(policy.param_dtype, reduce)

    def param_layout(self, model: nn.Module) -> ParamLayout:
        """Counted on the DTensors: full and local elements, their placements, HSDP's replicas."""
        params = list(model.parameters())
        dtensors = [p for p in params if isinstance(p, DTensor)]
        placements = sorted({repr(pl) for p in dtensors for pl in p.placements})
        return ParamLayout(f"DTensor {'/'.join(placements)}", sum(p.numel() for p in params),
                           sum(p.to_local().numel() for p in dtensors), len(params),
                           sum(1 for p in dtensors if any(pl.is_shard() for pl in p.placements)),
                           frozenset(p.dtype for p in params), max((_replicas(p) for p in dtensors), default=1))


STRATEGY = FSDP2()
"""The strategy ``strategy='fsdp'`` (FSDP2) selects (registered by
:func:`fp8dist.strategies.register_builtins`)."""


def _replicas(p: DTensor) -> int:
    """How many ranks hold the same piece of ``p``."""
    return math.prod(size for size, pl in zip(p.device_mesh.shape, p.placements) if pl.is_replicate())
