"""``wrap_model``: the one pipeline. Each step is one call into its own module."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, overload

import torch
from torch import nn

from ..runtime.agree import check_ranks_agree
from .blocks import BlockWiring, wrap_blocks
from ..config.resolve import Config, resolve_config
from ..runtime.env import DistEnv, current_launch, resolve_device
from ..config.text import plural
from ..config.dtypes import dtype_name
from ..fp8 import BACKENDS, NO_FP8, FP8Backend, FP8Wiring, converted_by_hand, get_backend
from ..runtime.guard import StepGuard
from .handover import mark_distributed
from ..memory_levels import MemoryLevel, get_level
from ..runtime.optim import OptimizerSpec, check_optimizer_spec, watch_replaced_parameters
from ..plan.adapter_rules import check_peft_adapters
from ..runtime.adapters import is_peft_model, unsupported_peft
from ..plan.precision import FP8Filter, PrecisionPlan, plan_precision
from .fp8_base import held_note, release_unplanned
from .meta_init import is_meta_model
from .mesh import check_mesh
from .planned_tree import refuse_later_parameters
from ..runtime.load_report import LoadReport
from .pretrained import materialize
from ..strategies import Sharded, ShardingInfo, ShardJob, find_blocks, get_strategy, unwrap_model
from ..strategies.introspect import find_wrapping, mark_wrapped

__all__ = ["wrap_model", "WrapInfo", "get_wrap_info", "get_plan"]

_INFO_ATTR = "_fp8dist_info"
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class WrapInfo:
    """What ``wrap_model`` did, attached to the model it returns (see :func:`get_wrap_info`)."""

    config: Config
    """The resolved config the model was wrapped with (every option, defaults included)."""
    env: DistEnv
    """This rank's place in the job: rank, world size, device, process-group backend."""
    plan: PrecisionPlan
    """Each module's precision and why (:func:`get_plan`)."""
    sharding: ShardingInfo
    """What the strategy did: its name, the blocks it sharded (and how they were found), the forward's autocast."""
    fp8: FP8Wiring = FP8Wiring()
    """What the FP8 backend wired after sharding (TE's autocast recipe, torchao's scale precompute)."""
    blocks: BlockWiring = BlockWiring("none", False, "")
    """Activation checkpointing and compile of the blocks, and why compile is on or off."""
    pretrained: LoadReport | None = None
    """What loading ``pretrained=`` read on this rank; None: not loaded."""
    materialized: str = ""
    """How a meta-device model was materialized ("" for a model with real weights)."""
    guard: StepGuard | None = None
    """The guard of non-finite steps (``nonfinite_step``); None: off."""

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far because their gradients were non-finite (the same on every rank)."""
        return self.guard.skipped_steps if self.guard is not None else 0


def get_wrap_info(model: nn.Module) -> WrapInfo:
    """The :class:`WrapInfo` (config, plan, environment, sharding, wiring) ``wrap_model`` attached to ``model``, the
    object it returned (DeepSpeed: the engine). Callable any time after ``wrap_model``, on any rank.

    Raises:
        ValueError: ``model`` was not returned by :func:`wrap_model` (e.g. the model passed in, not the one returned).
    """
    info = getattr(model, _INFO_ATTR, None)
    if info is None:
        raise ValueError(f"{type(model).__name__} was not returned by fp8dist.wrap_model.")
    return info


def get_plan(model: nn.Module) -> PrecisionPlan:
    """The per-module :class:`~fp8dist.plan.precision.PrecisionPlan` (each module's precision and why) of a model
    returned by :func:`wrap_model`; ``print`` it for a table. ValueError as :func:`get_wrap_info`."""
    return get_wrap_info(model).plan


def _check_model(model: Any) -> None:
    """Refuse a model already wrapped, sharded or FP8-converted anywhere in its tree, or with nothing to train."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model expects a torch.nn.Module, got {type(model).__name__}.")
    found = find_wrapping(model)
    if found is not None and found.engine == "fp8dist":
        raise ValueError(f"wrap_model: {found.describe(model)}. Train that model as wrap_model returned it "
                         "(fp8dist.get_wrap_info(model) says what was done); to wrap it otherwise, wrap the original "
                         "model once, built afresh.")
    if found is not None:
        raise ValueError(f"wrap_model: {found.describe(model)}; fp8dist applies the strategy itself, and a second "
                         "engine over the same parameters trains wrong or fails inside torch. Pass the model as "
                         "built, before any engine wraps or shards it; a model you wired by hand trains as it is, "
                         "without wrap_model.")
    converted = converted_by_hand(model)
    if converted is not None:
        name, backend, cls = converted
        where = f"{name} of {type(model).__name__}" if name else "the model given"
        raise ValueError(f"wrap_model: {where} is already a {cls} from {get_backend(backend).package} (converted "
                         "by hand): fp8dist converts the layers itself and its plan, which records each layer's "
                         "precision, cannot account for one converted before it. Pass the model before conversion, "
                         f"with fp8={backend!r} (fp8_exclude / fp8_filter keep layers out of FP8).")
    peft = unsupported_peft(model)
    if peft:
        raise ValueError(f"wrap_model: {peft}.")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to shard or train. Check that "
                         "its layers are registered as submodules (nn.ModuleList, not a Python list).")
    if not any(p.requires_grad for p in params):
        raise ValueError(f"{type(model).__name__}: all {len(params)} parameters have requires_grad=False, so there is "
                         "nothing to train. Unfreeze the ones to train (p.requires_grad_(True)) before wrap_model.")
    check_peft_adapters(model)  # the rule fp8dist train's --lora-rank and --lora-targets follow


def _check_master_weights(model: nn.Module, cfg: Config, backend: FP8Backend, facts: Any,
                          memory: MemoryLevel) -> None:
    """Refuse trainable bf16/fp16 parameters where no fp32 master copy is kept: small updates would be lost."""
    if facts.engine_builds_optimizer or backend.owns_optimizer or memory.builds_optimizer:
        return  # DeepSpeed keeps fp32 masters, MS-AMP its own; memory="lean" stores bf16 weights on purpose
    half = [(n, p.dtype) for n, p in model.named_parameters() if p.requires_grad and p.dtype in _HALF]
    if not half:
        return
    (name, dtype), short = half[0], dtype_name(half[0][1])
    peft = (" A PEFT model: leave get_peft_model's autocast_adapter_dtype=True (its default), which keeps the "
            "adapters in fp32 over a frozen bf16 base.") if is_peft_model(model) else ""
    raise ValueError(
        f"wrap_model: {type(model).__name__} has {plural(len(half), f'trainable {short} parameter')} "
        f"(e.g. {name!r}) and "
        f"strategy={cfg.parallel.strategy!r} with memory={cfg.parallel.memory!r} keeps no fp32 master weights: the "
        f"optimizer steps them in {short}, where an update smaller than about {torch.finfo(dtype).eps / 2:.0e} of "
        "a weight is lost. Call model.float() before wrap_model, or build it in fp32 (e.g. from_config(config, "
        "dtype=torch.float32)): fp8dist computes in bf16 anyway (param_dtype). Or memory='lean' (bf16 weights on "
        f"purpose, stochastic rounding), or strategy='deepspeed' (fp32 master weights in its optimizer).{peft}")


def _check_meta(model: nn.Module, cfg: Config) -> bool:
    meta = is_meta_model(model)
    real = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if not t.is_meta]
    if meta and real:
        raise ValueError(f"{type(model).__name__} is partly on the meta device and partly not (e.g. {real[0]!r} is "
                         "not): build the whole model under `with torch.device('meta'):`, or none of it.")
    refusal = get_backend(cfg.precision.fp8).meta_model_refusal
    if meta and refusal:
        raise ValueError(f"fp8={cfg.precision.fp8!r} with a meta-device model: {refusal}.")
    return meta


def _check_optimizer(optimizer: Any, backend: FP8Backend, plan: PrecisionPlan, memory: MemoryLevel,
                     engine: Any) -> None:
    memory.check_optimizer(optimizer)
    if optimizer is not None:  # an engine that builds it may take keys of its own (DeepSpeed's torch_adam)
        check_optimizer_spec(optimizer, engine_keys=getattr(engine, "optimizer_keys", {})
                             if plan.facts.engine_builds_optimizer else None)
    if backend.owns_optimizer and optimizer is None and not plan.facts.engine_builds_optimizer:
        raise ValueError(f"fp8={backend.name!r} owns the optimizer: pass optimizer={{'type': 'AdamW', 'lr': ...}} "
                         "(or a callable params -> torch.optim.AdamW) and take model, optimizer = wrap_model(...).")


@overload
def wrap_model(model: nn.Module, strategy: str | None = None, fp8: str | None = None, *,
               config: Config | Mapping[str, Any] | str | Path | None = None, fp8_filter: FP8Filter | None = None,
               fp8_group: Any = None, optimizer: None = None, numerics: Any = None, mesh: Any = None,
               **options: Any) -> nn.Module: ...


@overload
def wrap_model(model: nn.Module, strategy: str | None = None, fp8: str | None = None, *,
               config: Config | Mapping[str, Any] | str | Path | None = None, fp8_filter: FP8Filter | None = None,
               fp8_group: Any = None, optimizer: OptimizerSpec, numerics: Any = None, mesh: Any = None,
               **options: Any) -> tuple[nn.Module, torch.optim.Optimizer]: ...


def wrap_model(model: nn.Module, strategy: str | None = None, fp8: str | None = None, *,
               config: Config | Mapping[str, Any] | str | Path | None = None, fp8_filter: FP8Filter | None = None,
               fp8_group: Any = None, optimizer: OptimizerSpec | None = None, numerics: Any = None,
               mesh: Any = None, **options: Any) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
    """Shard or replicate ``model`` for training with bf16 mixed precision (FP8 layered on top).

    Build the optimizer *after* this call, from the returned model's parameters: sharding replaces them.

    Args:
        model: the model, identical on every rank, on any device or on the meta device (materialized after
            sharding, each rank allocating only what it holds under fsdp/fsdp1, and filled from ``pretrained=`` or
            by the model's own initialization). Refused: a model (or part) already wrapped, sharded or
            FP8-converted, and trainable bf16/fp16 parameters where nothing keeps fp32 masters of them (every
            strategy but "deepspeed", unless ``memory="lean"`` or fp8="msamp"): build it in fp32. A PEFT model
            is wrapped after ``get_peft_model`` (its type one of :data:`fp8dist.runtime.adapters.SUPPORTED_PEFT_TYPES`,
            else refused); parameters added to the returned model make its first forward raise
            :class:`~fp8dist.pipeline.planned_tree.UnplannedParametersError`.
        strategy: "fsdp" (FSDP2, default), "fsdp1", "ddp", "none" or "deepspeed"; None takes it from ``config``.
        fp8: "te", "torchao", "msamp" or None/"none"; None takes it from ``config``.
        config: a :class:`Config`, a flat dict or a YAML/JSON path; keyword options override it.
        fp8_filter: ``(module, fqn) -> bool``; False keeps that module in the strategy's precision (Python only;
            files and the CLI use the ``fp8_exclude`` patterns).
        fp8_group: process group for FP8 amax reduction (TE); default the world group.
        numerics: a :class:`fp8dist.NumericsReport` of this model (``fp8dist.measure_fp8_numerics``): a layer it
            flags stays out of FP8, and each row of the plan says whether the probe found it safe.
        optimizer: an optimizer spec (:func:`fp8dist.runtime.optim.build_optimizer`), required where something
            else than you builds the optimizer: fp8="msamp", strategy="deepspeed" (unless its json has an
            optimizer block) and ``memory="lean"`` (an AdamW mapping).
        mesh: a ``DeviceMesh`` over every rank of the job (or a ``ProcessGroup``, taken as a 1-D mesh) to shard
            over instead of fp8dist's own, e.g. one your trainer (Ray Train) or your other code already uses: 1-D
            for fsdp, fsdp1 and ddp, or 2-D ``(replicate, shard)`` for fsdp's HSDP with ``replicate_degree`` its
            first size. Refused: a mesh over some ranks only, of another device type, or with a strategy that
            takes none ("none", "deepspeed"). None: fp8dist builds the mesh over every rank.
        **options: any config key, e.g. ``param_dtype="bf16"``, ``block_classes=[...]``, ``pretrained="hf_dir"``
            (each rank loads its part of the safetensors there).

    Returns:
        The model to train, an ``nn.Module`` for every strategy: the module itself (fsdp, none) or the engine's
        wrapper (ddp, fsdp1, the DeepSpeed engine); with ``optimizer=``, the pair ``(model, optimizer)``, the
        optimizer built after sharding by whoever builds it (the engine, the FP8 backend, the memory level or
        your spec).

    Example::

        model = wrap_model(LlamaForCausalLM(cfg), strategy="fsdp")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    """
    explicit = {k: v for k, v in (("strategy", strategy), ("fp8", fp8)) if v is not None}
    cfg = resolve_config(config, **explicit, **options)                                   # 1. resolve
    launch = current_launch()
    engine = get_strategy(cfg.parallel.strategy)
    memory = get_level(cfg.parallel.memory)
    cfg = memory.resolve(cfg, engine.facts(cfg, launch.world_size))
    _check_model(model)                                                                   # 2. check
    meta = _check_meta(model, cfg)
    device = resolve_device(cfg.parallel.device, launch.local_rank)
    engine.check_launch(cfg, launch.world_size)
    engine.check_model(model, cfg)
    mesh = check_mesh(mesh, engine, cfg, launch, device)
    plan = plan_precision(model, cfg, device=device, world_size=launch.world_size,        # 3. plan
                          fp8_filter=fp8_filter, numerics=numerics)
    backend = get_backend(cfg.precision.fp8) if plan.converted else NO_FP8
    backend.check_plan(plan)
    plan.notes += tuple(filter(None, [held_note(model, release_unplanned(model, plan))]))  # a LoRA base held in FP8
    _check_optimizer(optimizer, backend, plan, memory, engine)
    _check_master_weights(model, cfg, backend, plan.facts, memory)
    _announce(cfg, plan, fp8_filter, fp8_group, launch.rank)
    env = engine.environment(cfg, launch, device)                                         # 4. environment
    check_ranks_agree(model, cfg, plan, env)
    before = list(model.parameters())  # an optimizer built over these before now would train nothing
    memory.before_convert(model)                                                          # 5. memory.before
    backend.convert(model, plan, cfg)                                                     # 6. convert
    memory.after_convert(model)
    blocks, block_wiring = _wrap_blocks(model, cfg, plan)                                 # 7. blocks
    hooks = backend.engine_hooks(optimizer, cfg, plan.facts)
    sharded = engine.shard(model, ShardJob(cfg, env, blocks, meta, _filler(cfg, env, meta, plan),   # 8. shard
                                           optimizer, hooks.prepare, hooks.entry, mesh,
                                           tuple(e.name for e in plan if e.reduce_fallback)))
    for note in (*block_wiring.notes, *sharded.info.notes) if launch.rank == 0 else ():  # as _announce: once
        warnings.warn(note, UserWarning, stacklevel=2)
    wiring = backend.after_shard(sharded.model, unwrap_model(sharded.model), plan, cfg, fp8_group)  # 9. FP8 wiring
    guard = _guard(engine, sharded.model, cfg, env)                                       # 10. guard, record
    setattr(sharded.model, _INFO_ATTR, WrapInfo(cfg, env, plan, sharded.info, wiring, block_wiring,
                                                sharded.loaded, sharded.materialized, guard))
    mark_wrapped(sharded.model, cfg.parallel.strategy)
    mark_distributed(sharded.model, cfg.parallel.strategy, plan.facts)  # Accelerate and Trainer: pass it through
    watch_replaced_parameters(before, sharded.model.parameters(), sharded.model)
    refuse_later_parameters(sharded.model)  # PEFT after wrap_model: said in the first forward
    return _result(sharded, optimizer, memory, env)                                      # and the optimizer


def _result(sharded: Sharded, optimizer: Any, memory: MemoryLevel, env: DistEnv) -> Any:
    if optimizer is None:
        return sharded.model
    if sharded.optimizer is not None:
        return sharded.model, sharded.optimizer
    trainable = [p for p in sharded.model.parameters() if p.requires_grad]  # a frozen base (LoRA) is never stepped
    return sharded.model, memory.build_optimizer(optimizer, trainable, env.device)


def _guard(engine: Any, model: nn.Module, cfg: Config, env: DistEnv) -> StepGuard | None:
    if cfg.parallel.nonfinite_step == "off":
        return None
    guard = StepGuard.for_model(unwrap_model(model), cfg, env.device)  # the user's names
    engine.watch_steps(model, guard)
    return guard


def _filler(cfg: Config, env: DistEnv, meta: bool, plan: PrecisionPlan) -> Any:
    """What fills the model once the strategy has allocated it; None when there is nothing to fill."""
    if not meta and cfg.parallel.pretrained is None:
        return None
    master = plan.facts.engine_builds_optimizer  # DeepSpeed's optimizer keeps fp32 masters of bf16 parameters
    return lambda model: materialize(model, env.device, cfg.parallel.pretrained, meta=meta, fp32_master=master)


def _wrap_blocks(model: nn.Module, cfg: Config, plan: PrecisionPlan) -> tuple[Any, BlockWiring]:
    """The blocks to shard (None: the strategy finds them), checkpointed and compiled as the plan decided."""
    compiled, why = plan.compile, plan.compile_reason
    if cfg.parallel.activation_checkpointing == "none" and not compiled:
        return None, BlockWiring("none", False, why)
    found, how = find_blocks(model, cfg.parallel.block_classes)
    if not found:
        raise ValueError(f"activation checkpointing and compile work per block, and {type(model).__name__} has none "
                         f"({how}): pass block_classes=[...] naming its repeated block class.")
    wrapped, wiring = wrap_blocks(model, found, cfg.parallel.activation_checkpointing, compiled, why)
    return (wrapped, how), wiring


def _announce(cfg: Config, plan: PrecisionPlan, fp8_filter: Any, fp8_group: Any, rank: int) -> None:
    """One warning for each thing asked for that will not happen as asked (an option the backend does not read),
    said by rank 0 only: each rank decides the same from the same settings (step 4 checks that they agree), and a
    job of N processes printed each note N times."""
    if rank != 0:
        return
    notes, backend = cfg.unread_notes(), get_backend(cfg.precision.fp8)
    if fp8_filter is not None and backend is NO_FP8:
        notes.append(f"fp8_filter has no effect: no FP8 backend is chosen (pass fp8= one of {', '.join(BACKENDS)}).")
    if fp8_group is not None and not backend.takes_amax_group:
        takers = [name for name in BACKENDS if get_backend(name).takes_amax_group]
        notes.append(f"fp8_group has no effect with fp8={cfg.precision.fp8!r}: it takes no amax group (fp8="
                     f"{' or '.join(takers)} reduces its amax over a process group you choose).")
    notes += plan.notes
    if plan.unavailable:
        notes.append(f"fp8={cfg.precision.fp8!r}: fallback: {plan.unavailable}; every layer trains in the "
                     f"strategy's {cfg.parallel.param_dtype} mixed precision.")
    notes += [plan.low_coverage_warning()]
    for note in filter(None, notes):
        warnings.warn(note, UserWarning, stacklevel=3)
