"""The interface of a sharding strategy, symmetric to :class:`fp8dist.fp8.FP8Backend`: each strategy is a class in
its own module under ``strategies/`` that subclasses :class:`Strategy`, and ``wrap_model`` calls it in one fixed
order, the same for every strategy:

    facts, rules (the combination table)  ->  check_launch, check_model  ->  environment  ->  shard (materializing
    a meta model where the strategy says)  ->  the model to train, what was done, and the optimizer the engine built
    (if any)

A strategy knows no FP8 backend: a backend that needs its own entry into the engine (MS-AMP under DeepSpeed) hands
it over as data (:attr:`ShardJob.engine_entry`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from ..pipeline.env import DistEnv, LaunchEnv, init_distributed, package_version
from ..config.axis import Rule, StrategyFacts, When
from ..config.dtypes import dtype_name, dtype_names
from .state_bytes import replicated_state_bytes

__all__ = ["Strategy", "ShardJob", "Sharded", "ShardingInfo", "materialized_how", "fill_whole", "prepared",
           "FP16_RULE", "EngineMemory", "EngineDtypes", "ParamLayout"]


@dataclass(frozen=True)
class ShardingInfo:
    """What the strategy did: which blocks were sharded and how they were found, and the autocast it put around
    the forward (ddp, none)."""

    strategy: str
    blocks: tuple[str, ...]
    blocks_found_by: str
    autocast: torch.dtype | None = None
    """The dtype the forward runs under ``torch.autocast`` in (ddp, none); None: no autocast."""
    notes: tuple[str, ...] = ()
    """What the user should know (a model sharded as one unit, FSDP2's padding of short dim-0 parameters)."""


Fill = Callable[[nn.Module], Any]
"""Fills what this rank holds of a materialized model (its part of ``pretrained=``, or the model's own init) and
returns the load report (None when nothing was loaded)."""


@dataclass(frozen=True)
class ShardJob:
    """Everything a strategy needs to shard one model."""

    cfg: Any
    """The resolved :class:`~fp8dist.config.resolve.Config` (a strategy reads its ``parallel`` section)."""
    env: DistEnv
    blocks: tuple[list[tuple[str, nn.Module]], str] | None = None
    """The blocks found (and checkpointed / compiled) by the block step, with how they were found; None: the
    strategy finds them itself."""
    meta: bool = False
    """The model is on the meta device: the strategy allocates it (whole, per unit, or this rank's shards only)."""
    fill: Fill | None = None
    """Called once the model is allocated (None: nothing to fill, a real model without ``pretrained=``)."""
    optimizer: Any = None
    """The optimizer spec, for an engine that builds the optimizer itself."""
    prepare: Callable[[nn.Module], tuple[nn.Module, Any]] | None = None
    """An FP8 backend's step on the filled, unwrapped model before the engine wraps it, returning the model and
    the optimizer it built (MS-AMP's ``initialize``); None: no such step."""
    engine_entry: tuple[Mapping[str, Any], Callable[..., Any]] | None = None
    """``(extra engine config, initialize function)`` of an FP8 backend with its own entry into the engine."""


@dataclass(frozen=True)
class Sharded:
    """What :meth:`Strategy.shard` returns."""

    model: nn.Module
    """The model to train: the module itself (fsdp, none) or the engine's wrapper (ddp, fsdp1, deepspeed)."""
    info: ShardingInfo
    loaded: Any = None
    """What loading ``pretrained=`` read on this rank (a LoadReport); None: nothing loaded."""
    materialized: str = ""
    """How a meta-device model was materialized ("" for a model with real weights)."""
    optimizer: torch.optim.Optimizer | None = None
    """The optimizer the engine (DeepSpeed) or the backend's :attr:`ShardJob.prepare` built, or None."""


def materialized_how(device: torch.device, *, whole: bool, pretrained: str | None) -> str:
    """The record of how a meta model became real, as ``WrapInfo.materialized`` says it."""
    return (f"materialized on {device}: " + ("the whole model on every rank" if whole else "this rank's shards only")
            + (f", filled from {pretrained}" if pretrained else ", by its own initialization"))


FP16_RULE = Rule(
    ("param_dtype", "strategy"),
    lambda cfg, facts: cfg.parallel.param_dtype == "fp16",
    "fp16 compute needs loss scaling, which fp8dist does not add to your training loop, and without it small "
    "gradients underflow to zero silently",
    "Use param_dtype='bf16' (no scaling needed; every FP8 GPU has it), or strategy='deepspeed', whose fp16 mode "
    "scales the loss dynamically.")
"""Every strategy but one with its own loss scaling refuses fp16 compute."""


class Strategy(Protocol):
    """The interface of a sharding strategy. Subclass it: the defaults are those of a strategy that needs no such
    step."""

    name: ClassVar[str]
    options: ClassVar[Mapping[str, When]] = {}
    """Options only this strategy reads, each with the condition under which it is read: an option set but not read
    is reported (:func:`fp8dist.config.rules.unused_options`)."""
    rules: ClassVar[tuple[Rule, ...]] = (FP16_RULE,)
    """What this strategy refuses to combine with (its rows of the combination table)."""
    process_group: ClassVar[bool] = True
    """The strategy needs a process group (``"none"`` does not)."""

    def facts(self, cfg: Any, world_size: int | None = None) -> StrategyFacts:
        """What the strategy does to parameters under ``cfg`` on ``world_size`` ranks (None: not known yet)."""
        return StrategyFacts()

    def check_launch(self, cfg: Any, world_size: int) -> None:
        """Refuse, before anything changes, a launch this strategy cannot run (HSDP groups that do not divide the
        world, say)."""

    def check_model(self, model: nn.Module, cfg: Any) -> None:
        """Refuse, before anything changes, a model this strategy cannot shard as it is (FSDP1: a unit whose
        parameters mix dtypes)."""

    def environment(self, cfg: Any, launch: LaunchEnv, device: torch.device) -> DistEnv:
        return init_distributed(device=cfg.parallel.device)  # the process group, initialized if needed

    def shard(self, model: nn.Module, job: ShardJob) -> Sharded:
        """Shard or replicate ``model`` (converted, blocks wrapped), materializing a meta model where the strategy
        allocates it; returns the model to train and what was done."""
        raise NotImplementedError

    def watch_steps(self, model: nn.Module, guard: Any) -> None:
        """Put ``guard`` (a :class:`fp8dist.pipeline.guard.StepGuard`) before every step of an optimizer holding the
        sharded ``model``'s parameters (torch optimizers: the process-wide step hooks)."""
        from ..pipeline.optim import STEP_HOOKS

        STEP_HOOKS.add(model, pre=guard.before_step)

    # accelerate: how a file written by ``accelerate config`` selects this strategy (fp8dist.config.accelerate)
    accelerate: ClassVar[Mapping[str, Any]] = {}
    """Accelerate's settings that select this strategy: ``distributed_type`` (a value or a tuple of them) and,
    where strategies share one, ``fsdp_config.fsdp_version``. Empty: no Accelerate setting selects it (a file
    names it with fp8dist's own key, ``strategy:``)."""

    # bench: what ``fp8dist bench`` asks of a strategy
    package: ClassVar[str | None] = None
    """The library the engine comes from beside torch (None: torch's own): bench results record its version,
    ``fp8dist env`` checks it."""
    bench_devices: ClassVar[tuple[str, ...]] = ()
    """Device types ("cpu", "cuda") on which ``fp8dist bench`` runs this strategy without ``--strategies`` (where
    :meth:`missing_reason` allows); (): only when asked for."""
    shard_by_hand: ClassVar[Callable[..., nn.Module] | None] = None
    """``shard_by_hand(model, units, device)``: the engine wired with its own API alone, no fp8dist step, each unit
    ``(modules, reshard_after_forward)`` as the model's author would choose, then the root: the bench's reference
    for fp8dist's overhead. None: the strategy has none (the bench runs no hand-wired cell for it)."""

    def missing_reason(self) -> str | None:
        """Why the engine cannot run on this machine (:attr:`package` not installed), with how to install it; None
        when it can."""
        if self.package is not None and package_version(self.package) is None:
            return f"{self.package} is not installed (pip install {self.package})"
        return None

    # checkpoint and gradients: what save_checkpoint / load_checkpoint, no_sync and clip_grad_norm_ ask
    checkpoint: ClassVar[Any] = None
    """The engine's own checkpoint format (an object with the members of
    :class:`~fp8dist.strategies.deepspeed_checkpoint.ZeROCheckpoint`); None: torch.distributed.checkpoint of
    ``get_state_dict(model, optimizer)``, which every torch engine's state dict goes through, so that a checkpoint
    of one such strategy loads into any other, on any world size."""

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Backward passes inside skip the gradient reduction, gradients accumulating locally. By default nothing
        is skipped: each micro-batch is reduced, which costs communication, never correctness."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Scale the gradients to a global norm of at most ``max_norm``; returns the norm before clipping, the same
        on every rank. By default torch's over the gradients this rank holds: exact where they are whole
        (replicated) or DTensor shards, whose norm torch reduces over their mesh."""
        norm: Any = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm,
                                                   norm_type)
        if hasattr(norm, "full_tensor"):  # a DTensor norm: the same full value on every rank
            norm = norm.full_tensor()
        return norm.detach()

    # pipeline, cli, train: what the commands and the reference job ask of a strategy
    rank_imports: ClassVar[tuple[str, ...]] = ()
    """Modules a training rank imports anyway under this strategy (its engine's library), for a parent to import
    once before its ranks fork (:func:`fp8dist.pipeline.env.rank_imports`); none by default."""

    def layout_notes(self, model: nn.Module, cfg: Any, world_size: int) -> tuple[str, ...]:
        """What ``fp8dist plan`` tells of how ``model`` will lie on ``world_size`` ranks (FSDP2's dim-0 padding when
        large); reads shapes only, so a meta model works. None by default."""
        return ()

    # accounting: what the memory estimate and the precision report ask (defaults: a replicated engine, like DDP)
    fit_way_out: ClassVar[tuple[str, Mapping[str, Any]] | None] = None
    """``(what, options)``: switching to this strategy is a way out the estimate tries when a rank does not fit its
    GPU (DeepSpeed: ZeRO-3 with offload); None: it is none."""

    def estimate_engine(self, model: nn.Module, cfg: Any, world_size: int, blocks: list[str], *, optimizer: str,
                        on_cpu: bool) -> EngineMemory:
        """What the engine holds beside the model's own parameters, for the memory estimate on ``world_size``
        ranks (``blocks``: the units found; ``optimizer``: the estimate's optimizer name; ``on_cpu``: the run is
        on a CPU). Default: the model's dtypes, no master copy, nothing on the host, no notes."""
        return EngineMemory()

    def rank_state_bytes(self, params: list[Any], cfg: Any, world_size: int, engine: EngineMemory, *, step: int,
                         level_states: Callable[[int], int], backend_optimizer: bool) -> list[dict[str, int]]:
        """Bytes of each model-state category on each of ``world_size`` ranks (:mod:`fp8dist.strategies.
        state_bytes` says what ``params``, ``step`` and ``level_states`` are); ``backend_optimizer``: the FP8
        backend builds the optimizer. Default: every rank holds everything."""
        return replicated_state_bytes(params, world_size, step, level_states)

    def kept_for_backward(self, model: nn.Module, cfg: Any, blocks: list[str]) -> list[tuple[str, int]]:
        """``(item, elements)`` of weights the engine keeps gathered from forward to backward beyond what it holds
        anyway. Default: none (a replicated engine holds every weight)."""
        return []

    def engine_dtypes(self, model: nn.Module, autocast: torch.dtype | None) -> EngineDtypes:
        """What the engine of ``model`` (as ``wrap_model`` returned it) computes, gathers and reduces in, read from
        its own objects; ``autocast``: the forward's autocast dtype. Default: nothing gathered, gradients reduced in
        their own dtype."""
        return EngineDtypes(autocast, reduce_words(None, model), "none (replicated)")

    def param_layout(self, model: nn.Module) -> ParamLayout:
        """How this rank holds the parameters of ``model`` (as ``wrap_model`` returned it). Default: each whole."""
        params = list(model.parameters())
        total = sum(p.numel() for p in params)
        return ParamLayout("replicated", total, total, len(params), 0, frozenset(p.dtype for p in params))

    def state_tensors(self, model: nn.Module, optimizer: Any) -> dict[str, list[Any]]:
        """The tensors (or containers of them) the engine of ``model`` holds on this rank in each model-state
        category: parameters, master_weights, gradients, optimizer_states. Default: the parameters, their
        gradients, the ``optimizer``'s state (None: no optimizer), no master copy."""
        params = list(model.parameters())
        return {"parameters": params, "master_weights": [], "gradients": [p.grad for p in params],
                "optimizer_states": [getattr(optimizer, "state", {})]}

    def stored_parts(self, params: list[nn.Parameter]) -> list[torch.Tensor] | None:
        """The tensors holding this rank's part of ``params`` where the engine keeps them apart from the parameters
        (ZeRO-3's partitions); None (the default): the parameters themselves hold it."""
        return None

    # cli:
    noisy_loggers: ClassVar[tuple[str, ...]] = ()
    """Loggers of the engine whose INFO lines would drown a command's progress output; the CLI shows them from
    WARNING up."""

    # report: which parameters each module holds, as the precision report groups them (defaults: a torch engine
    # that leaves every parameter on its module, whole or as a DTensor of its full shape)
    def full_shapes(self, model: nn.Module) -> Mapping[tuple[int, str], tuple[int, ...]]:
        """The full shape, all ranks together, of each parameter of ``model`` (as ``wrap_model`` returned it) whose
        tensor on this rank does not show it, keyed by ``(id(module), name)`` of the module holding it. Default:
        none (each tensor's shape is the full one; a DTensor's is the global one)."""
        return {}

    def holds_own_params(self, module: nn.Module) -> bool:
        """False for a wrapper of the engine whose own parameters are none of the user's (FSDP1's, which holds its
        flat parameter): the report counts its inner modules instead. Default: True."""
        return True

    # report groups: (issue 43) how the report measures the frozen parameters (a LoRA base) apart from the trained
    def group_parts(self, params: list[nn.Parameter]) -> list[Any] | None:
        """The tensors holding this rank's share of ``params`` (the frozen ones), each storage theirs alone; None
        where the engine keeps them in tensors shared with other parameters (FSDP1's flat parameter): the report
        then says its frozen / trained split is not measured. Default: the engine's own parts, else ``params``."""
        return self.stored_parts(params) or list(params)


def fill_whole(model: nn.Module, job: ShardJob, strategy: str, *, warn: bool = True) -> tuple[Any, str]:
    """A strategy that holds the whole model on every rank (ddp, none, ZeRO-1/2): a meta model is allocated whole
    (refused when it cannot fit, a warning when the world has several ranks), then what it holds is filled.
    Returns (load report, how it was materialized)."""
    from .common import check_fits, to_empty

    device = job.env.device
    if job.meta:
        check_fits(model, device, strategy)
        to_empty(model, device)
    loaded = job.fill(model) if job.fill is not None else None
    if not job.meta:
        return loaded, ""
    if warn:  # a meta model is usually built because it is large, and this strategy holds all of it per rank
        warnings.warn(f"strategy={strategy!r} keeps the whole model on every rank, so the meta-device model was "
                      "materialized whole on each. strategy='fsdp' (or deepspeed zero_stage=3) allocates "
                      "1/world_size of it per rank.", UserWarning, stacklevel=4)
    return loaded, materialized_how(device, whole=True, pretrained=job.cfg.parallel.pretrained)


def prepared(model: nn.Module, job: ShardJob) -> tuple[nn.Module, Any]:
    """The backend's step before the engine wraps the model (:attr:`ShardJob.prepare`), if any."""
    return job.prepare(model) if job.prepare is not None else (model, None)


# accounting: what a strategy tells the memory estimate and the report, as data


@dataclass(frozen=True)
class EngineMemory:
    """What an engine holds beside the model's own parameters (:meth:`Strategy.estimate_engine`)."""

    dtype: str | None = None
    """The dtype the engine casts the module to (DeepSpeed's bf16/fp16 block); None: the model's own dtypes."""
    master: str | None = None
    """The dtype of the engine's master weights and optimizer states (DeepSpeed: fp32); None: no master copy, the
    states in the weights' dtype."""
    stage: int | None = None
    """The engine's ZeRO stage; None: it has none."""
    offloaded: tuple[str, ...] = ()
    """Model-state categories kept in host memory (DeepSpeed's offload)."""
    notes: tuple[str, ...] = ()
    """What the estimate should say (transient buffers not counted, HSDP's replicas)."""
    layout: Mapping[str, Any] = field(default_factory=dict)
    """The engine's own figures its :meth:`Strategy.rank_state_bytes` reads (ZeRO's persistence threshold)."""


@dataclass(frozen=True)
class EngineDtypes:
    """What a wrapped model's engine computes, gathers and reduces in (:meth:`Strategy.engine_dtypes`)."""

    compute: torch.dtype | None
    """What high-precision GEMMs compute in (the cast or autocast dtype); None: the stored dtype."""
    reduce: str | None
    """What gradients travel in when reduced, in words ("bf16", "set by the comm hook ..."); None: nothing is
    reduced (one process)."""
    gather: str | None = None
    """What weights are all-gathered in, in words; None: the compute dtype (or FP8, where the weights say so)."""
    holder: Any = None
    """The engine object that holds the optimizer, the master partitions and the gradients itself (DeepSpeed's
    engine); None: the optimizer given and the parameters hold them."""


@dataclass(frozen=True)
class ParamLayout:
    """How one rank holds a wrapped model's parameters (:meth:`Strategy.param_layout`)."""

    layout: str
    """"DTensor Shard(0)", "FlatParameter shards", "replicated", "not distributed", ..."""
    total_numel: int
    local_numel: int
    tensors: int
    sharded_tensors: int
    storage: frozenset[torch.dtype]
    replicas: int = 1
    """Whole copies of the model over the ranks (HSDP's replicate degree)."""


def reduce_words(dtype: torch.dtype | None, model: nn.Module) -> str:
    """What gradients are reduced in: ``dtype``, or (None) the parameters' own dtypes."""
    return dtype_name(dtype) if dtype is not None else dtype_names({p.dtype for p in model.parameters()})
