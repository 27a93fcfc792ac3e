"""The interface of a sharding strategy (:class:`Strategy`), one subclass per module here. ``wrap_model`` calls each
in one order: facts, rules -> check_launch, check_model -> environment -> shard. A strategy knows no FP8 backend: one
with its own entry into the engine (MS-AMP under DeepSpeed) hands it over as data (:attr:`ShardJob.engine_entry`)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import nn

from ..runtime.env import DistEnv, LaunchEnv, init_distributed
from ..runtime.packages import package_version
from ..config.axis import Rule, StrategyFacts, When
from ..config.dtypes import dtype_name, dtype_names
from .state_bytes import replicated_state_bytes

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..config.param_bytes import ParamInfo
    from ..config.resolve import Config
    from ..runtime.guard import StepGuard
    from ..runtime.load_report import LoadReport
    from ..runtime.optim import OptimizerSpec
    from .deepspeed_checkpoint import ZeROCheckpoint
    from .grad_fp8 import WireTally

__all__ = ["Strategy", "ShardJob", "Sharded", "ShardingInfo", "fill_whole", "fill_shards", "prepared", "FP16_RULE",
           "EngineMemory", "EngineDtypes", "ParamLayout", "require_1d_mesh"]


@dataclass(frozen=True)
class ShardingInfo:
    """What the strategy did: which blocks it sharded, how they were found, and the forward's autocast."""

    strategy: str
    blocks: tuple[str, ...]
    blocks_found_by: str
    autocast: torch.dtype | None = None
    """The dtype of the ``torch.autocast`` around the forward (ddp, none); None: no autocast."""
    notes: tuple[str, ...] = ()
    """What the user should know (a model sharded as one unit, FSDP2's padding of short dim-0 parameters)."""


@dataclass(frozen=True)
class ShardJob:
    """Everything a strategy needs to shard one model."""

    cfg: Config  # the resolved config
    env: DistEnv
    blocks: tuple[list[tuple[str, nn.Module]], str] | None = None
    """The blocks the block step found (and checkpointed / compiled), with how; None: the strategy finds them."""
    meta: bool = False
    """The model is on the meta device: the strategy allocates it (whole, per unit, or this rank's shards)."""
    fill: Callable[[nn.Module], LoadReport | None] | None = None
    """Fills this rank's part once the model is allocated, returning the LoadReport or None; None: nothing to fill."""
    optimizer: OptimizerSpec | None = None  # the optimizer spec, for an engine that builds the optimizer itself
    prepare: Callable[[nn.Module], tuple[nn.Module, torch.optim.Optimizer | None]] | None = None
    """An FP8 backend's step on the filled model before the engine wraps it, returning the model and the optimizer
    it built (MS-AMP's ``initialize``)."""
    engine_entry: tuple[Mapping[str, object], Callable[..., tuple[nn.Module, object]]] | None = None
    """``(extra engine config, initialize function)`` of an FP8 backend with its own entry into the engine."""
    mesh: DeviceMesh | None = None
    """The user's DeviceMesh over every rank (``wrap_model(mesh=...)``, passed by :meth:`Strategy.check_mesh`);
    None: the strategy builds its own."""
    reduce_fallback: tuple[str, ...] = ()
    """Modules whose weight gradients reduce in fp32 under ``reduce_dtype="fp8"`` (the plan's
    ``PlanEntry.reduce_fallback``)."""


@dataclass(frozen=True)
class Sharded:
    """What :meth:`Strategy.shard` returns."""

    model: nn.Module
    """The model to train: the module itself (fsdp, none) or the engine's wrapper (ddp, fsdp1, deepspeed)."""
    info: ShardingInfo
    loaded: LoadReport | None = None  # what loading ``pretrained=`` read on this rank; None: nothing loaded
    materialized: str = ""  # how a meta-device model was materialized ("" for a model with real weights)
    optimizer: torch.optim.Optimizer | None = None
    """The optimizer the engine (DeepSpeed) or the backend's :attr:`ShardJob.prepare` built, or None."""


def require_1d_mesh(mesh: DeviceMesh, strategy: str) -> None:
    """ValueError unless ``mesh`` is 1-D: DDP and FSDP1 (as fp8dist wires it) take one group."""
    if mesh.ndim != 1:
        raise ValueError(f"wrap_model: strategy={strategy!r} replicates or shards over one group, and mesh "
                         f"{tuple(mesh.shape)} has {mesh.ndim} dimensions: pass a 1-D mesh over every rank, or "
                         "strategy='fsdp' with a 2-D (replicate, shard) mesh for HSDP.")


FP16_RULE = Rule(
    ("param_dtype", "strategy"),
    lambda cfg, facts: cfg.parallel.param_dtype == "fp16",
    "fp16 compute needs loss scaling, which fp8dist does not add to your training loop, and without it small "
    "gradients underflow to zero silently",
    "Use param_dtype='bf16' (no scaling needed; every FP8 GPU has it), or strategy='deepspeed', whose fp16 mode "
    "scales the loss dynamically.")
"""Every strategy but one with its own loss scaling refuses fp16 compute."""


class Strategy(Protocol):
    """The interface of a sharding strategy; subclass it, set :attr:`name` and implement :meth:`shard` (every other
    hook has a default that suits a strategy needing no such step), then ``register_strategy(MyStrategy())``.

    ``wrap_model`` calls the hooks in this order: :meth:`facts` (step 1, the memory level's resolve), then
    :meth:`check_launch`, :meth:`check_model` and :meth:`check_mesh` (step 2, before anything changes), the plan
    reads :meth:`facts` and :attr:`rules` (step 3), :meth:`environment` (step 4), :meth:`shard` (step 8),
    :meth:`watch_steps` (step 10). A training loop calls :meth:`accumulating`, :meth:`backward`,
    :meth:`optimizer_step` and :meth:`global_grad_norm`; the tools (plan, estimate, report, checkpoint, bench) the
    others, each said at its hook."""

    name: ClassVar[str]
    Config: ClassVar[type | None] = None
    """The dataclass of this strategy's own knobs (keyword-only, frozen, each field documented by the docstring under
    it), flat keys of the config (``cfg.parallel.<knob>``, ``cfg.parallel.knobs(name)``), flags and file keys; name
    each in :attr:`options` with when it is read. None: no knobs of its own. Strategies may share one class."""
    options: ClassVar[Mapping[str, When]] = {}
    """Options only this strategy reads, each with when it reads them (one set but not read is reported)."""
    rules: ClassVar[tuple[Rule, ...]] = (FP16_RULE,)
    """What this strategy refuses to combine with (its rows of the combination table)."""
    process_group: ClassVar[bool] = True
    """The strategy needs a process group (``"none"`` does not)."""
    reduce_fallback_unit: ClassVar[str | None] = None
    """Under ``reduce_dtype="fp8"``: what reduces in fp32 around a layer the numerics probe flags (FSDP2: "FSDP2
    unit", its reduce-scatter); None: the strategy cannot reduce one layer's gradients apart (refused)."""

    def facts(self, cfg: Config | None, world_size: int | None = None) -> StrategyFacts:
        """What the strategy does to parameters under ``cfg`` on ``world_size`` ranks, as data every FP8 backend and
        memory level reads (never the strategy's name). ``cfg`` None: the facts that hold under any config (the
        combination table asks which strategies have a fact); ``world_size`` None: not known yet (the plan without
        ``--world-size``). Called by wrap_model's steps 1 and 3, the plan, the estimate and the combination table;
        reads the config only, never raises for a valid config."""
        return StrategyFacts()

    def check_launch(self, cfg: Config, world_size: int) -> None:
        """Refuse, before anything changes (wrap_model's step 2, with the launcher's ``world_size``), a launch this
        strategy cannot run under ``cfg`` (FSDP2: a replicate_degree that does not divide the ranks). Raises
        ValueError naming the value and the way out; returns None."""

    def check_model(self, model: nn.Module, cfg: Config) -> None:
        """Refuse, before anything changes (wrap_model's step 2, the model as given, possibly on the meta device), a
        ``model`` this strategy cannot shard as it is under ``cfg`` (FSDP1: a unit mixing dtypes). Raises ValueError
        naming the module and the way out; returns None."""

    def check_mesh(self, mesh: DeviceMesh, cfg: Config) -> None:
        """Refuse, before anything changes (wrap_model's step 2, only when the user passed ``mesh=``, already
        checked to span every rank on this device type), a DeviceMesh this strategy cannot shard over under ``cfg``;
        returns None when it can, and :meth:`shard` then finds it in :attr:`ShardJob.mesh`. Raises ValueError naming
        the mesh and the way out; the default takes no mesh at all."""
        raise ValueError(f"wrap_model: mesh= with strategy={self.name!r}, which shards over no DeviceMesh of yours "
                         "(it makes its own process groups, or none). Leave mesh out, or use a strategy that takes "
                         "one: 'fsdp' (a 1-D mesh, or 2-D for HSDP), 'fsdp1' or 'ddp' (1-D).")

    def environment(self, cfg: Config, launch: LaunchEnv, device: torch.device) -> DistEnv:
        """The process group and device this rank runs on (wrap_model's step 4, after every check and the plan;
        ``launch``: what the launcher's environment says, ``device``: the resolved ``cfg.parallel.device``).
        Default: torch's process group, initialized from the launcher's environment unless the user did already
        (RuntimeError from torch where it cannot be); ``"none"`` returns a world of one without any."""
        return init_distributed(device=cfg.parallel.device)  # the process group, initialized if needed

    def shard(self, model: nn.Module, job: ShardJob) -> Sharded:
        """Shard or replicate ``model`` and return it as the user trains it (:class:`Sharded`).

        Precondition (wrap_model's step 8): the process group of :meth:`environment` is up (``job.env``), the FP8
        backend has converted the planned layers (torchao swaps its modules in before sharding, so that FSDP shards
        the FP8 modules' weights) and the block step has wrapped the blocks for checkpointing and compile
        (``job.blocks``); the model is not sharded yet. A meta model (``job.meta``) is allocated here (whole, per unit
        or this rank's shards) and filled by ``job.fill``; an engine that builds the optimizer (DeepSpeed) builds it
        from ``job.optimizer``. Raises ValueError for a model or setting the engine refuses, naming the way out."""
        raise NotImplementedError

    def watch_steps(self, model: nn.Module, guard: StepGuard) -> None:
        """Put ``guard`` before every optimizer step on the wrapped ``model`` (wrap_model's step 10, when
        ``nonfinite_step`` is not "off"): it checks the gradients and skips a non-finite step on every rank alike.
        Default: a pre-hook on every torch optimizer stepping ``model``'s parameters; an engine that steps itself
        (DeepSpeed) wraps its own step and reports each verdict to the guard. Returns None."""
        from ..runtime.optim import STEP_HOOKS

        STEP_HOOKS.add(model, pre=guard.before_step)

    accelerate: ClassVar[Mapping[str, object]] = {}
    """The ``accelerate config`` settings that select this strategy: ``distributed_type`` (a value or a tuple) and,
    where strategies share one, ``fsdp_config.fsdp_version``; empty: none (a file names it with ``strategy:``)."""

    # bench: what ``fp8dist bench`` asks of a strategy
    package: ClassVar[str | None] = None
    """The engine's library beside torch (None: torch's): the bench records its version, ``fp8dist env`` checks it."""
    bench_devices: ClassVar[tuple[str, ...]] = ()
    """Device types on which ``fp8dist bench`` runs this strategy without ``--strategies``; (): only when asked."""
    shard_by_hand: ClassVar[Callable[..., nn.Module] | None] = None
    """``shard_by_hand(model, units, device)``: the engine wired with its own API alone, each unit ``(modules,
    reshard_after_forward)``, then the root: the bench's reference for fp8dist's overhead. None: no such cell."""

    def missing_reason(self) -> str | None:
        """Why the engine cannot run here (:attr:`package` not installed), with how to install it; None if it can.
        Read by ``fp8dist bench`` (a cell skipped with this reason) and ``fp8dist env``; imports nothing."""
        if self.package is not None and package_version(self.package) is None:
            return f"{self.package} is not installed (pip install {self.package})"
        return None

    # checkpoint and gradients: what save_checkpoint / load_checkpoint, no_sync and clip_grad_norm_ ask
    checkpoint: ClassVar[ZeROCheckpoint | None] = None
    """The engine's own checkpoint format (the members of :class:`~fp8dist.strategies.deepspeed_checkpoint.
    ZeROCheckpoint`); None: torch.distributed.checkpoint of ``get_state_dict``, which loads into any torch engine
    on any world size."""

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward passes of the wrapped ``model`` skip the gradient reduction (they accumulate
        locally), for ``fp8dist.no_sync`` and :meth:`accumulating`: FSDP2's ``set_requires_gradient_sync(False)``,
        DDP's and FSDP1's ``no_sync()``. Default: a null context (every backward reduces: more communication, the
        same result). Raises ValueError where the engine accumulates itself (DeepSpeed), naming its way."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip the gradients of the wrapped ``model`` to a global ``norm_type`` norm of ``max_norm`` in place
        (``fp8dist.clip_grad_norm_``, after the last backward, before the optimizer step); returns the norm before
        clipping, a plain tensor, the same on every rank. Default: torch's over this rank's gradients, exact when
        they are whole or DTensor shards. Raises ValueError where the engine clips itself (DeepSpeed)."""
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm,
                                                   norm_type)
        if hasattr(norm, "full_tensor"):  # a DTensor norm: the same full value on every rank
            norm = norm.full_tensor()
        return norm.detach()

    # the step: what fp8dist train and bench call for each micro-batch and each optimizer step
    def accumulating(self, model: nn.Module, *, last: bool) -> contextlib.AbstractContextManager:
        """The context one micro-batch's forward and :meth:`backward` run in when an optimizer step accumulates over
        several: ``last`` (the micro-batch that completes the step) reduces the gradients. Default: :meth:`no_sync`
        unless ``last``; an engine that accumulates itself (DeepSpeed) returns a null context."""
        return contextlib.nullcontext() if last else self.no_sync(model)

    def backward(self, model: nn.Module, loss: torch.Tensor, *, micro_batches: int = 1, last: bool = True) -> None:
        """Backpropagate ``loss``, the scalar loss of one micro-batch of ``micro_batches`` per optimizer step (``last``:
        the one that completes the step), through the wrapped ``model``; call inside :meth:`accumulating`, then
        :meth:`optimizer_step` after the last. Default: ``(loss / micro_batches).backward()``."""
        (loss / micro_batches if micro_batches > 1 else loss).backward()

    def optimizer_step(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                       while_held: Callable[[], object] | None = None) -> None:
        """Update the weights from the gradients :meth:`backward` left (clipped before by the caller, or by the engine
        where it clips itself), then zero the gradients. ``while_held`` is called once while the step's gradients and
        the optimizer states are both held (the moment a memory report measures). Default: ``optimizer.step()``,
        ``while_held()``, ``optimizer.zero_grad(set_to_none=True)``; the guard wrap_model put on the step
        (:meth:`watch_steps`) runs inside. Raises ValueError without an optimizer, which a torch engine needs."""
        if optimizer is None:
            raise ValueError(f"strategy={self.name!r} steps the torch optimizer you built or wrap_model returned "
                             "(wrap_model(optimizer={...})); optimizer_step got None.")
        optimizer.step()
        if while_held is not None:
            while_held()
        optimizer.zero_grad(set_to_none=True)

    def global_grad_norm(self, model: nn.Module) -> torch.Tensor | float | None:
        """The global gradient norm before clipping of the last :meth:`optimizer_step`, where the engine clips inside
        it (``StrategyFacts.engine_builds_optimizer``); call after the step. Default None: a torch engine's norm is
        what ``fp8dist.clip_grad_norm_`` returned before the step."""
        return None

    # introspection: how this engine shows in a model (wrap_model refuses a model already wrapped; unwrap_model)
    engine_words: ClassVar[str] = ""
    """How a module :meth:`is_engine` finds is described after "already": "wrapped in DistributedDataParallel
    (DDP)"."""

    def is_engine(self, module: object) -> bool:
        """Whether ``module`` is this strategy's engine's own object (its wrapper, or a module it sharded in place),
        read without importing an engine that is not imported yet. wrap_model refuses such a model (a second engine
        over the same parameters); :func:`~fp8dist.strategies.unwrap_model` unwraps it. Default: False (an engine
        that leaves no trace of its own, like torch's composable ``replicate``)."""
        return False

    def holds_param(self, param: nn.Parameter) -> str | None:
        """Where this engine holds ``param`` without its wrapper being in the model (``zero.Init`` by hand), in words
        after "already" ("held by DeepSpeed (...)"); None: not one of its. wrap_model refuses such a model."""
        return None

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's model inside ``model``, which :meth:`is_engine` recognizes: the wrapper's ``.module``; by
        default ``model`` itself (an engine that shards in place)."""
        return model

    # pipeline, cli, train
    rank_imports: ClassVar[tuple[str, ...]] = ()
    """Modules a training rank imports anyway (its engine's), for a parent to import before its ranks fork."""

    def layout_notes(self, model: nn.Module, cfg: Config, world_size: int) -> tuple[str, ...]:
        """What ``fp8dist plan`` tells of how ``model`` (unwrapped, meta works) will lie on ``world_size`` ranks
        under ``cfg``, one note each (FSDP2's dim-0 padding); reads shapes only. Raises ValueError for a world size
        the strategy cannot split (the plan's ``--world-size``). Default: no notes."""
        return ()

    # accounting: what the memory estimate and the precision report ask (defaults: a replicated engine, like DDP)
    fit_way_out: ClassVar[tuple[str, Mapping[str, object]] | None] = None
    """``(what, options)``: a way out the estimate tries when a rank does not fit its GPU; None: none."""

    def estimate_engine(self, model: nn.Module, cfg: Config, world_size: int, blocks: list[str], *, optimizer: str,
                        on_cpu: bool) -> EngineMemory:
        """What the engine holds beside the model's parameters, for the memory estimate (``blocks``: the units found;
        ``optimizer``: the estimate's optimizer name; ``on_cpu``: the run is on a CPU). Default: the model's dtypes, no
        master copy, nothing on the host, no notes."""
        return EngineMemory()

    def rank_state_bytes(self, params: list[ParamInfo], cfg: Config, world_size: int, engine: EngineMemory, *,
                         step: int, level_states: Callable[[int], int],
                         backend_optimizer: bool) -> list[dict[str, int]]:
        """Bytes of each model-state category on each rank (``params``: :mod:`~fp8dist.strategies.state_bytes`;
        ``step``: the optimizer's step bytes per tensor; ``level_states``: a memory level's own state bytes for n
        elements; ``backend_optimizer``: the FP8 backend builds the optimizer). Default: every rank holds everything."""
        return replicated_state_bytes(params, world_size, step, level_states)

    def kept_for_backward(self, model: nn.Module, cfg: Config, blocks: list[str]) -> list[tuple[str, int]]:
        """``(item, elements)`` of weights kept gathered from forward to backward beyond what the engine holds, for
        the estimate's activations (``model`` unwrapped, ``blocks`` the units found; FSDP with
        ``reshard_after_forward=False``). Default: none."""
        return []

    def grad_wire(self, model: nn.Module, cfg: Config, world_size: int, blocks: list[str],
                  fallback: tuple[str, ...] = ()) -> WireTally | None:
        """The gradient bytes one rank sends per optimizer step (a
        :class:`~fp8dist.strategies.grad_fp8.WireTally`) predicted for ``model`` (unwrapped, meta works) with
        ``blocks`` as the block step finds them, where the strategy reduces in fp8 (``fallback``: the modules whose
        gradients reduce in fp32, :attr:`reduce_fallback_unit`); None elsewhere."""
        return None

    def engine_dtypes(self, model: nn.Module, autocast: torch.dtype | None) -> EngineDtypes:
        """What the wrapped ``model``'s engine computes, gathers and reduces in, read from its own objects after
        wrap_model (``autocast``: the forward's autocast dtype, :attr:`ShardingInfo.autocast`), for ``fp8dist.report``.
        Default: the autocast or stored dtype, reduced in the parameters' dtypes, nothing gathered."""
        return EngineDtypes(autocast, reduce_words(None, model), "none (replicated)")

    def param_layout(self, model: nn.Module) -> ParamLayout:
        """How this rank holds the parameters of the wrapped ``model`` (its layout, full and local elements, how
        many tensors are sharded, their storage dtypes), for ``fp8dist.report`` and ``fp8dist train``'s header.
        Default: every parameter replicated whole."""
        params = list(model.parameters())
        total = sum(p.numel() for p in params)
        return ParamLayout("replicated", total, total, len(params), 0, frozenset(p.dtype for p in params))

    def state_tensors(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, list[object]]:
        """The tensors (or containers of them) the engine holds on this rank per model-state category: parameters,
        master_weights, gradients, optimizer_states (``optimizer`` None: no optimizer), for ``fp8dist.report``'s bytes,
        measured while the step's gradients are held. Default: the parameters, their ``.grad`` and the optimizer's
        ``state``; no master copy."""
        params = list(model.parameters())
        return {"parameters": params, "master_weights": [], "gradients": [p.grad for p in params],
                "optimizer_states": [getattr(optimizer, "state", {})]}

    def stored_parts(self, params: list[nn.Parameter]) -> list[torch.Tensor] | None:
        """The tensors holding this rank's part of ``params`` when not the parameters themselves (ZeRO-3's
        ``ds_tensor`` partitions), for the report's bytes; None (the default): the parameters hold it."""
        return None

    noisy_loggers: ClassVar[tuple[str, ...]] = ()
    """The engine's loggers whose INFO lines would drown a command's output; the CLI shows them from WARNING up."""

    # report: which parameters each module holds, as the precision report groups them
    def full_shapes(self, model: nn.Module) -> Mapping[tuple[int, str], tuple[int, ...]]:
        """Full shapes of the parameters of the wrapped ``model`` whose tensor on this rank does not show it (ZeRO-3
        empties them), by ``(id(module), name)``, for the report's rows. Default: none (each tensor shows it)."""
        return {}

    def holds_own_params(self, module: nn.Module) -> bool:
        """False for an engine wrapper ``module`` holding none of the user's parameters itself (FSDP1's units): the
        precision report looks inside it for the user's module. Default: True."""
        return True

    # report groups: how the report measures the frozen parameters (a LoRA base) apart from the trained
    def group_parts(self, params: list[nn.Parameter]) -> list[object] | None:
        """The tensors holding this rank's share of the frozen ``params``, each storage theirs alone; None where
        the engine shares storage with other parameters (the report then says the split is not measured)."""
        return self.stored_parts(params) or list(params)


def _materialized(job: ShardJob, *, whole: bool) -> str:
    """How a meta model became real, as ``WrapInfo.materialized`` says it ("" for a real model)."""
    if not job.meta:
        return ""
    pretrained = job.cfg.parallel.pretrained
    return (f"materialized on {job.env.device}: "
            + ("the whole model on every rank" if whole else "this rank's shards only")
            + (f", filled from {pretrained}" if pretrained else ", by its own initialization"))


def fill_whole(model: nn.Module, job: ShardJob, strategy: str, *, warn: bool = True) -> tuple[LoadReport | None, str]:
    """For a strategy that holds the whole model on every rank: a meta model is allocated whole (refused when it
    cannot fit), then filled. Returns (load report, how it was materialized)."""
    from .common import check_fits, to_empty

    if job.meta:
        check_fits(model, job.env.device, strategy)
        to_empty(model, job.env.device)
    loaded = job.fill(model) if job.fill is not None else None
    if job.meta and warn:  # a meta model is usually built because it is large, and this strategy holds it per rank
        warnings.warn(f"strategy={strategy!r} keeps the whole model on every rank, so the meta-device model was "
                      "materialized whole on each. strategy='fsdp' (or deepspeed zero_stage=3) allocates "
                      "1/world_size of it per rank.", UserWarning, stacklevel=4)
    return loaded, _materialized(job, whole=True)


def fill_shards(model: nn.Module, job: ShardJob) -> tuple[LoadReport | None, str]:
    """For a strategy that allocated this rank's shards only: fill them. Returns (load report, how materialized)."""
    return job.fill(model) if job.fill is not None else None, _materialized(job, whole=False)


def prepared(model: nn.Module, job: ShardJob) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """The backend's step before the engine wraps the model (:attr:`ShardJob.prepare`), if any."""
    return job.prepare(model) if job.prepare is not None else (model, None)


# accounting: what a strategy tells the memory estimate and the report, as data


@dataclass(frozen=True)
class EngineMemory:
    """What an engine holds beside the model's own parameters (:meth:`Strategy.estimate_engine`)."""

    dtype: str | None = None
    """The dtype the engine casts the module to (DeepSpeed's bf16/fp16 block); None: the model's own."""
    master: str | None = None
    """The dtype of the engine's master weights and optimizer states (DeepSpeed: fp32); None: no master copy."""
    stage: int | None = None  # the engine's ZeRO stage; None: it has none
    offloaded: tuple[str, ...] = ()  # model-state categories kept in host memory (DeepSpeed's offload)
    notes: tuple[str, ...] = ()  # what the estimate should say (transient buffers not counted, HSDP's replicas)
    layout: Mapping[str, int] = field(default_factory=dict)
    """The engine's own figures its :meth:`Strategy.rank_state_bytes` reads (ZeRO's persistence threshold)."""


@dataclass(frozen=True)
class EngineDtypes:
    """What a wrapped model's engine computes, gathers and reduces in (:meth:`Strategy.engine_dtypes`)."""

    compute: torch.dtype | None
    """What high-precision GEMMs compute in (the cast or autocast dtype); None: the stored dtype."""
    reduce: str | None  # what gradients are reduced in, in words; None: nothing is reduced (one process)
    gather: str | None = None
    """What weights are all-gathered in, in words; None: the compute dtype (or FP8, where the weights say so)."""
    holder: nn.Module | None = None
    """The engine object holding the optimizer, master partitions and gradients itself (DeepSpeed's engine)."""


@dataclass(frozen=True)
class ParamLayout:
    """How one rank holds a wrapped model's parameters (:meth:`Strategy.param_layout`)."""

    layout: str  # "DTensor Shard(0)", "FlatParameter shards", "replicated", "not distributed", ...
    total_numel: int
    local_numel: int
    tensors: int
    sharded_tensors: int
    storage: frozenset[torch.dtype]
    replicas: int = 1  # whole copies of the model over the ranks (HSDP's replicate degree)


def reduce_words(dtype: torch.dtype | None, model: nn.Module) -> str:
    """What gradients are reduced in: ``dtype``, or (None) the parameters' own dtypes."""
    return dtype_name(dtype) if dtype is not None else dtype_names({p.dtype for p in model.parameters()})
