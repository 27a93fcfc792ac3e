"""strategy="fsdp1": FSDP1 (``FullyShardedDataParallel``), one FlatParameter per unit."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import CustomPolicy

from ..config.axis import ALWAYS, Rule, StrategyFacts
from ..config.dtypes import dtype_bytes, dtype_name, torch_dtype
from .base import (FP16_RULE, EngineDtypes, EngineMemory, ParamLayout, Sharded, ShardingInfo, ShardJob, Strategy,
                   fill_shards, prepared, reduce_words, require_1d_mesh)
from .common import find_blocks, shard_blocks, to_empty
from .fsdp_knobs import FSDPConfig
from .local_shards import flat_params
from .state_bytes import UNSHARDED_ITEM, fsdp1_state_bytes, gathered_blocks_note

__all__ = ["FSDP1", "build_fsdp1_policy", "apply_fsdp1", "STRATEGY"]


def build_fsdp1_policy(*, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                       buffer_dtype: torch.dtype) -> MixedPrecision:
    """FSDP1 mixed precision with all three dtypes explicit (FSDP1 would otherwise cast buffers to
    ``param_dtype``, which Llama-style rotary buffers do not tolerate)."""
    return MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype)


def apply_fsdp1(model: nn.Module, blocks: list[nn.Module], *, device: torch.device,
                mixed_precision: MixedPrecision, reshard_after_forward: bool,
                param_init_fn: Callable[[nn.Module], None] | None = None,
                mesh: DeviceMesh | None = None) -> FullyShardedDataParallel:
    """Wrap each block, then the root, in ``FullyShardedDataParallel`` over the 1-D ``mesh`` (None: the default
    process group); returns the root wrapper.
    ``use_orig_params=True`` keeps the parameter names and lets FP8 backends see real tensors; ``device_id`` is set
    for CPU too, which FSDP1 needs there. ``param_init_fn`` materializes a meta module one unit at a time."""
    block_ids = {id(b) for b in blocks}
    return FullyShardedDataParallel(
        model, auto_wrap_policy=CustomPolicy(lambda module: id(module) in block_ids), mixed_precision=mixed_precision,
        sharding_strategy=ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP,
        device_id=device, use_orig_params=True, param_init_fn=param_init_fn, device_mesh=mesh)


class FSDP1(Strategy):
    """FSDP1: blocks, then the root, wrapped; a meta model is allocated unit by unit as FSDP1 shards it, then each
    rank fills its shards."""

    name = "fsdp1"
    engine_words = "wrapped in FullyShardedDataParallel (FSDP1)"
    Config = FSDPConfig  # FSDP's knobs: fsdp1 reads reshard_after_forward (its options), not FSDP2's HSDP
    accelerate = {"distributed_type": "FSDP", "fsdp_version": 1}
    bench_devices = ("cpu",)
    options = {"reshard_after_forward": ALWAYS, "block_classes": ALWAYS, "reduce_dtype": ALWAYS}
    rules = (FP16_RULE, Rule(
        ("reduce_dtype", "strategy"), lambda cfg, facts: cfg.parallel.reduce_dtype == "fp8",
        "FSDP1 reduce-scatters each unit's FlatParameter gradient in the MixedPrecision reduce_dtype (fp32, bf16 or "
        "fp16) and fp8dist has no FP8 comm hook for its flat gradients",
        "Use strategy='fsdp' (FSDP2, whose FP8 reduce-scatter fp8dist wires), or reduce_dtype='bf16' with "
        "strategy='fsdp1'."),)

    def is_engine(self, module: object) -> bool:
        """A ``FullyShardedDataParallel`` wrapper (the root or a unit)."""
        return isinstance(module, FullyShardedDataParallel)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The root wrapper's ``.module``."""
        return model.module

    def facts(self, cfg, world_size=None) -> StrategyFacts:
        """One FlatParameter per unit, sharded over every rank; FSDP1 casts gradients for their reduction."""
        return StrategyFacts(flat_params=True, casts_gradients=True, shard_degree=world_size)

    def check_mesh(self, mesh, cfg) -> None:
        """A 1-D mesh only, as fp8dist wires FSDP1 (ValueError otherwise)."""
        require_1d_mesh(mesh, self.name)

    def check_model(self, model: nn.Module, cfg) -> None:
        """A unit mixing dtypes (a frozen bf16 embedding beside fp32 layers) would fail inside FSDP1's constructor,
        which flattens it into one FlatParameter of one dtype."""
        found, _ = find_blocks(model, cfg.parallel.block_classes)
        seen: set[int] = set()
        for unit, module in (*found, ("", model)):  # innermost first, the root last: as FSDP1 wraps them
            first: dict[torch.dtype, str] = {}
            for name, param in module.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    first.setdefault(param.dtype, f"{unit}.{name}" if unit else name)
            if len(first) > 1:
                mixed = " and ".join(f"{dtype_name(d)} ({n!r})" for d, n in first.items())
                where = f"the unit {unit}" if unit else "the root unit (what the blocks leave)"
                raise ValueError(f"strategy='fsdp1' flattens each unit's parameters into one tensor of one dtype, and "
                                 f"{where} mixes {mixed}. Cast them to one dtype (model.float(): fp8dist computes in "
                                 "bf16 anyway), or use strategy='fsdp', whose per-parameter shards take mixed dtypes.")

    def shard(self, model: nn.Module, job: ShardJob) -> Sharded:
        """Wrap each block, then the root, in ``FullyShardedDataParallel`` (a meta model allocated unit by
        unit, then this rank's shards filled)."""
        p, device = job.cfg.parallel, job.env.device
        found, how, notes = shard_blocks(model, job)
        names = tuple(n for n, _ in found)
        model, built = prepared(model, job)
        init = (lambda module: to_empty(module, device, recurse=False)) if job.meta else None
        policy = build_fsdp1_policy(param_dtype=torch_dtype(p.param_dtype), reduce_dtype=torch_dtype(p.reduce_dtype),
                                    buffer_dtype=torch_dtype(p.buffer_dtype))
        wrapped = apply_fsdp1(model, [m for _, m in found], device=device, mixed_precision=policy,
                              reshard_after_forward=p.reshard_after_forward, param_init_fn=init, mesh=job.mesh)
        loaded, how_made = fill_shards(wrapped, job)
        return Sharded(wrapped, ShardingInfo(self.name, names, how, notes=notes), loaded, how_made, built)

    def no_sync(self, model: nn.Module):
        """FSDP1's own ``no_sync()`` (gradients accumulate unsharded until the last micro-batch)."""
        return model.no_sync()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """FSDP1's own ``clip_grad_norm_`` over the flat shards (the norm over every rank)."""
        return model.clip_grad_norm_(max_norm, norm_type).detach()

    def estimate_engine(self, model: nn.Module, cfg, world_size: int, blocks: list[str], *, optimizer: str,
                        on_cpu: bool) -> EngineMemory:
        """No master copy; a note when a block is gathered whole at once."""
        return EngineMemory(notes=tuple(gathered_blocks_note(model, blocks, dtype_bytes(cfg.parallel.param_dtype))))

    def rank_state_bytes(self, params, cfg, world_size: int, engine: EngineMemory, *, step: int, level_states,
                         backend_optimizer: bool) -> list[dict[str, int]]:
        """Each unit's FlatParameter padded to a multiple of the world size, split evenly."""
        return fsdp1_state_bytes(params, world_size, step, dtype_bytes(cfg.parallel.param_dtype))

    def kept_for_backward(self, model: nn.Module, cfg, blocks: list[str]) -> list[tuple[str, int]]:
        """With ``reshard_after_forward=False`` every unit stays gathered until backward."""
        if cfg.parallel.reshard_after_forward:
            return []
        return [(UNSHARDED_ITEM, sum(p.numel() for p in model.parameters()))]

    def engine_dtypes(self, model: nn.Module, autocast) -> EngineDtypes:
        """The root's ``MixedPrecision``: compute in its param_dtype, reduce in its reduce_dtype."""
        mp = model.mixed_precision
        return EngineDtypes(mp.param_dtype, reduce_words(mp.reduce_dtype or mp.param_dtype, model))

    def param_layout(self, model: nn.Module) -> ParamLayout:
        """Counted on the FlatParameters: their unpadded full size and this rank's shard."""
        flats = flat_params(model)
        return ParamLayout("FlatParameter shards", sum(f._unpadded_unsharded_size.numel() for f in flats),
                           sum(f.numel() for f in flats), len(flats),
                           sum(1 for f in flats if f.numel() < f._unpadded_unsharded_size.numel()),
                           frozenset(f.dtype for f in flats))

    def state_tensors(self, model: nn.Module, optimizer) -> dict[str, list]:
        """The FlatParameters hold the storage (and its padding) the original parameters view."""
        held, flats = super().state_tensors(model, optimizer), flat_params(model)
        return {**held, "parameters": flats + held["parameters"],
                "gradients": [f.grad for f in flats] + held["gradients"]}

    def full_shapes(self, model: nn.Module) -> dict[tuple[int, str], tuple[int, ...]]:
        """The original parameters are flat views of this rank's shard: their full shapes are in the flat
        parameters (tied ones under their shared entries)."""
        full: dict[tuple[int, str], tuple[int, ...]] = {}
        for flat in flat_params(model):
            for info, shape in zip(flat._param_infos, flat._shapes):
                full[(id(info.module), info.param_name)] = tuple(shape)
            for shared in flat._shared_param_infos or ():
                full[(id(shared.module), shared.param_name)] = full[(id(shared.prim_module), shared.prim_param_name)]
        return full

    def holds_own_params(self, module: nn.Module) -> bool:
        """An FSDP1 wrapper holds the user's parameters only through its FlatParameter."""
        return not isinstance(module, FullyShardedDataParallel)

    def group_parts(self, params: list[nn.Parameter]) -> None:
        """A unit's flat parameter holds its frozen and trained pieces in one storage (and one gradient)."""
        return None


STRATEGY = FSDP1()
"""The strategy ``strategy='fsdp1'`` selects (registered by :func:`fp8dist.strategies.register_builtins`)."""
