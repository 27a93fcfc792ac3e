"""``wrap_model``: the one pipeline. Each step is one call into its own module."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .blocks import BlockWiring, block_refusals, check_block_options, wrap_blocks
from .config import Config, resolve_config, torch_dtype
from .env import DistEnv, LaunchEnv, current_launch, init_distributed, resolve_device
from .fp8 import NO_FP8, FP8Backend, FP8Wiring, get_backend
from .lean import build_lean_optimizer, cast_params_bf16, lean_config, lean_optimizer_kwargs
from .optim import OptimizerSpec, build_optimizer, watch_replaced_parameters
from .plan import FP8Filter, PrecisionPlan, plan_precision
from .meta_init import check_fits, is_meta_model, to_empty
from .pretrained import LoadReport, materialize
from .strategies import ShardingInfo, apply_strategy, deepspeed_config_for, find_blocks, unwrap_model
from .strategies.deepspeed import partition_meta_zero3
from .strategies.fsdp import check_replicate_degree

__all__ = ["wrap_model", "WrapInfo", "get_wrap_info", "get_plan"]

_INFO_ATTR = "_fp8dist_info"


@dataclass(frozen=True)
class WrapInfo:
    """What ``wrap_model`` did, attached to the model it returns (see :func:`get_wrap_info`)."""

    config: Config
    env: DistEnv
    plan: PrecisionPlan
    sharding: ShardingInfo
    fp8: FP8Wiring = FP8Wiring()
    """What the FP8 backend wired after sharding (TE's autocast recipe, torchao's scale precompute)."""
    blocks: BlockWiring = BlockWiring("none", False, "")
    """Activation checkpointing and compile of the blocks, and why compile is on or off."""
    pretrained: LoadReport | None = None
    """What loading ``pretrained=`` read on this rank (bytes read of the checkpoint's bytes); None: not loaded."""
    materialized: str = ""
    """How a meta-device model was materialized ("" for a model with real weights)."""




def get_wrap_info(model: nn.Module) -> WrapInfo:
    """The :class:`WrapInfo` of a model returned by :func:`wrap_model`."""
    info = getattr(model, _INFO_ATTR, None)
    if info is None:
        raise ValueError(f"{type(model).__name__} was not returned by fp8dist.wrap_model.")
    return info


def get_plan(model: nn.Module) -> PrecisionPlan:
    """The per-module precision plan of a model returned by :func:`wrap_model`; ``print`` it for a table."""
    return get_wrap_info(model).plan


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model expects a torch.nn.Module, got {type(model).__name__}.")
    if getattr(model, _INFO_ATTR, None) is not None:
        raise ValueError("this model was already wrapped by fp8dist.wrap_model; wrap the original model once.")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to shard or train. Check that "
                         "its layers are registered as submodules (nn.ModuleList, not a Python list).")
    if not any(p.requires_grad for p in params):
        raise ValueError(f"{type(model).__name__}: all {len(params)} parameters have requires_grad=False, so there is "
                         "nothing to train. Unfreeze the ones to train (p.requires_grad_(True)) before wrap_model.")


def _check_meta(model: nn.Module, cfg: Config) -> bool:
    """Whether ``model`` is on the meta device, and refused where it cannot be materialized."""
    meta = is_meta_model(model)
    real = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_meta]
    if meta and real:
        raise ValueError(f"{type(model).__name__} is partly on the meta device and partly not (e.g. {real[0]!r} is "
                         "not): build the whole model under `with torch.device('meta'):`, or none of it.")
    if meta and cfg.precision.fp8 == "msamp":
        raise ValueError("fp8='msamp' with a meta-device model: MS-AMP converts real weights. Build the model on the "
                         "CPU (with pretrained=, wrap_model loads it there), or use fp8='torchao' / 'te'.")
    return meta


def _ignored_arguments(cfg: Config, fp8_filter: Any, fp8_group: Any) -> list[str]:
    """Arguments the configured backend does not read: said once each, never silently dropped."""
    notes = []
    if fp8_filter is not None and cfg.precision.fp8 is None:
        notes.append("fp8_filter has no effect: no FP8 backend is chosen (pass fp8='torchao' or 'te').")
    if fp8_group is not None and cfg.precision.fp8 != "te":
        notes.append(f"fp8_group has no effect with fp8={cfg.precision.fp8!r}: only Transformer Engine reduces its "
                     "amax over a process group you choose (torchao and MS-AMP take no group).")
    return notes


def wrap_model(model: nn.Module, strategy: str | None = None, fp8: str | None = None, *,
               config: Config | Mapping[str, Any] | str | Path | None = None, fp8_filter: FP8Filter | None = None,
               fp8_group: Any = None, optimizer: OptimizerSpec | None = None, **options: Any) -> Any:
    """Shard or replicate ``model`` for training with bf16 mixed precision (FP8 layered on top).

    Build the optimizer *after* this call, from the returned model's parameters: sharding replaces them.

    Args:
        model: the model, identical on every rank: on the CPU (or any device), or built on the meta device
            (``with torch.device("meta"):``), which is materialized after sharding: each rank allocates only
            what it holds (fsdp, fsdp1; the others allocate the whole model) and fills it from ``pretrained=``
            or with the model's own initialization.
        strategy: "fsdp" (FSDP2, default), "fsdp1", "ddp", "none" or "deepspeed" (returns the DeepSpeed engine);
            None takes it from ``config``.
        fp8: "te", "torchao", "msamp" or None/"none"; None takes it from ``config``.
        config: a :class:`Config`, a flat dict or a YAML/JSON path; keyword options override it.
        fp8_filter: ``(module, fqn) -> bool``; False keeps that module in the strategy's precision (Python only;
            files and the CLI use the ``fp8_exclude`` patterns).
        fp8_group: process group for FP8 amax reduction (TE); default the world group.
        optimizer: an optimizer spec (see :func:`fp8dist.optim.build_optimizer`); required for fp8="msamp",
            which owns the optimizer, and for ``memory="lean"`` (an AdamW mapping, see :mod:`fp8dist.lean`). When
            given, ``(model, optimizer)`` is returned, built after sharding.
        **options: any config key, e.g. ``param_dtype="bf16"``, ``torchao_recipe="rowwise"``,
            ``block_classes=[...]``, ``pretrained="hf_dir"`` (each rank loads its part of the safetensors there).

    Returns:
        The model to train: the same module sharded in place (fsdp), or its DDP / FSDP1 wrapper; with
        ``optimizer=``, the pair ``(model, optimizer)``.

    Example::

        model = wrap_model(LlamaForCausalLM(cfg), strategy="fsdp")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    """
    explicit = {k: v for k, v in (("strategy", strategy), ("fp8", fp8)) if v is not None}
    cfg = lean_config(resolve_config(config, **explicit, **options))      # 1. resolve config
    lean = cfg.parallel.memory == "lean"
    if lean:
        lean_optimizer_kwargs(optimizer)  # the level builds the optimizer: its spec is checked before anything
    _check_model(model)
    meta = _check_meta(model, cfg)
    before = list(model.parameters())  # an optimizer built over these before now would train nothing
    launch = current_launch()                                              # 2. check environment
    device = resolve_device(cfg.parallel.device, launch.local_rank)
    check_replicate_degree(cfg.parallel.replicate_degree, launch.world_size)
    plan = plan_precision(model, cfg, device=device, fp8_filter=fp8_filter)  # 3. plan (FP8 gate first)
    _announce(cfg, plan, fp8_filter, fp8_group)
    backend = get_backend(cfg.precision.fp8) if plan.converted else NO_FP8
    backend.check_plan(plan)
    if backend.owns_optimizer and optimizer is None and cfg.parallel.strategy != "deepspeed":
        raise ValueError(f"fp8={backend.name!r} owns the optimizer: pass optimizer={{'type': 'AdamW', 'lr': ...}} "
                         "(or a callable params -> torch.optim.AdamW) and take model, optimizer = wrap_model(...).")
    _check_blocks(cfg, backend)
    env = _environment(cfg, launch, device)                                # process group, once all checks passed
    if lean:
        cast_params_bf16(model)                                            # bf16 weights, no fp32 master
    backend.convert(model, plan, cfg)                                      # 4. convert, before sharding
    if lean:
        cast_params_bf16(model)                                            # and the backend's new modules
    blocks, block_wiring = _wrap_blocks(model, cfg, plan.compile, plan.compile_reason)  # 5. checkpoint, compile
    sharded = cfg.parallel.strategy in ("fsdp", "fsdp1")  # the others hold the whole model until they shard it
    loaded, how = (None, "") if sharded else _materialize(model, cfg, env, meta, optimizer)  # 5b. whole / ZeRO-3
    entry = backend.deepspeed_entry(cfg) if cfg.parallel.strategy == "deepspeed" else None
    model, built = backend.before_shard(model, optimizer, cfg) if entry is None else (model, None)  # MS-AMP: loaded
    wrapped, sharding = apply_strategy(model, cfg.parallel, env, optimizer=optimizer,  # 6. shard
                                       ds_entry=entry, blocks=blocks, param_init_fn=_fsdp1_init(cfg, env, meta))
    if sharded:
        loaded, how = _materialize(wrapped, cfg, env, meta)                # 5b. this rank's shards
    for note in (*block_wiring.notes, *sharding.notes):
        warnings.warn(note, UserWarning, stacklevel=2)
    wiring = backend.after_shard(wrapped, unwrap_model(wrapped), plan, cfg, fp8_group)  # 7. FP8 autocast, hooks
    setattr(wrapped, _INFO_ATTR, WrapInfo(cfg, env, plan, sharding, wiring, block_wiring, loaded, how))
    watch_replaced_parameters(before, wrapped.parameters())
    if optimizer is None:
        return wrapped
    if cfg.parallel.strategy == "deepspeed":
        return wrapped, wrapped.optimizer
    if lean:
        return wrapped, build_lean_optimizer(optimizer, wrapped.parameters(), env.device)
    return wrapped, built if built is not None else build_optimizer(optimizer, wrapped.parameters())


def _fsdp1_init(cfg: Config, env: DistEnv, meta: bool) -> Any:
    """FSDP1 materializes a meta model unit by unit, each just before it is sharded (no init: 5b fills it)."""
    if not meta or cfg.parallel.strategy != "fsdp1":
        return None
    return lambda module: to_empty(module, env.device, recurse=False)


def _materialize(model: nn.Module, cfg: Config, env: DistEnv, meta: bool, optimizer: Any = None) -> tuple[Any, str]:
    """Step 5b: allocate a meta model (FSDP2: this rank's shards; FSDP1: done unit by unit while sharding; ZeRO-3:
    partitioned module by module through DeepSpeed's zero.Init; the others: the whole model, refused when it cannot
    fit), then fill what this rank holds from ``pretrained`` or with the model's own init."""
    p, device = cfg.parallel, env.device
    path = p.pretrained
    if not meta and path is None:
        return None, ""
    how = ""
    if meta:
        zero3 = p.strategy == "deepspeed" and p.zero_stage == 3
        if zero3:
            partition_meta_zero3(model, deepspeed_config_for(model, p, env, optimizer), device=device,
                                 dtype=torch_dtype(p.param_dtype))
        elif p.strategy != "fsdp1":
            if p.strategy != "fsdp":
                check_fits(model, device, p.strategy)
            to_empty(model, device)
        whole = not (p.strategy in ("fsdp", "fsdp1") or zero3)
        how = (f"materialized on {device}: " + ("the whole model on every rank" if whole else "this rank's shards only")
               + (f", filled from {path}" if path else ", by its own initialization"))
        if whole and p.strategy != "none":  # said once: a meta model is usually built because it is large
            warnings.warn(f"strategy={p.strategy!r} keeps the whole model on every rank, so the meta-device model "
                          f"was materialized whole on each. strategy='fsdp' (or deepspeed zero_stage=3) allocates "
                          "1/world_size of it per rank.", UserWarning, stacklevel=3)
    return materialize(model, device, path, meta=meta), how


def _check_blocks(cfg: Config, backend: FP8Backend) -> None:
    """Compile or activation checkpointing that cannot run here is an error, before anything changes."""
    check_block_options(cfg, *block_refusals(cfg, backend))


def _wrap_blocks(model: nn.Module, cfg: Config, compiled: bool, why: str) -> tuple[Any, BlockWiring]:
    """Checkpoint and compile the blocks FSDP will shard; returns the blocks to shard (None: let the strategy
    find them) and what was done."""
    if cfg.parallel.activation_checkpointing == "none" and not compiled:
        return None, BlockWiring("none", False, why)
    found, how = find_blocks(model, cfg.parallel.block_classes)
    if not found:
        raise ValueError(f"activation checkpointing and compile work per block, and {type(model).__name__} has none "
                         f"({how}): pass block_classes=[...] naming its repeated block class.")
    wrapped, wiring = wrap_blocks(model, found, cfg.parallel.activation_checkpointing, compiled, why)
    return (wrapped, how), wiring


def _announce(cfg: Config, plan: PrecisionPlan, fp8_filter: Any, fp8_group: Any) -> None:
    """One warning for each thing the user asked for that will not happen as asked."""
    notes = cfg.unused_options() + _ignored_arguments(cfg, fp8_filter, fp8_group) + list(plan.notes)
    if plan.unavailable:
        notes.append(f"fp8={cfg.precision.fp8!r}: fallback: {plan.unavailable}; every layer trains in the "
                     f"strategy's {cfg.parallel.param_dtype} mixed precision.")
    low = plan.low_coverage_warning()
    if low:
        notes.append(low)
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=3)


def _environment(cfg: Config, launch: LaunchEnv, device: torch.device) -> DistEnv:
    """The process group (initialized if needed); "none" needs no process group."""
    if cfg.parallel.strategy == "none":
        if launch.world_size > 1:
            warnings.warn(f"strategy='none' in a {launch.world_size}-process launch: every rank trains its own "
                          "copy with no gradient sync. Use strategy='ddp' or 'fsdp'.", UserWarning, stacklevel=3)
        return DistEnv(launch.rank, launch.world_size, launch.local_rank, device, None, launch.launcher)
    return init_distributed(device=cfg.parallel.device)
