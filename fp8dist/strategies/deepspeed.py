"""strategy="deepspeed": DeepSpeed ZeRO 1-3, ``deepspeed.initialize`` on the config of
:mod:`~fp8dist.strategies.deepspeed_config`."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..config.axis import ALWAYS, Rule, StrategyFacts, When
from ..runtime.optim import check_optimizer_spec
from ..config.dtypes import dtype_bytes, dtype_name, torch_dtype
from ..runtime.env import DistEnv
from ..config.text import byte_size
from .base import (EngineDtypes, EngineMemory, ParamLayout, Sharded, ShardingInfo, ShardJob, Strategy, fill_shards,
                   fill_whole)
from .common import cast_buffers, to_empty
from .deepspeed_knobs import DeepSpeedConfig
from .deepspeed_checkpoint import ZeROCheckpoint
from .deepspeed_config import (build_deepspeed_config, merge_user_config, model_hidden_size, read_user_config,
                               torch_adam_on_cpu, validate_with_deepspeed, zero_config)
from .state_bytes import zero_state_bytes

__all__ = ["DeepSpeed", "zero_config", "build_deepspeed_config", "merge_user_config", "validate_with_deepspeed",
           "apply_deepspeed", "model_hidden_size", "is_deepspeed_engine", "partition_meta_zero3", "STRATEGY"]


def apply_deepspeed(model: nn.Module, config: dict, *, optimizer: Any = None, local_rank: int = 0,
                    initialize: Any = None):
    """``deepspeed.initialize`` (or ``initialize``: MS-AMP's entry point) with ``config``; returns ``(engine,
    optimizer)``. Call after FP8 conversion. Sets LOCAL_RANK, which DeepSpeed insists on, when no launcher did."""
    if initialize is None:
        import deepspeed

        initialize = deepspeed.initialize
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    params = [p for p in model.parameters() if p.requires_grad]
    engine, ds_optimizer, _, _ = initialize(model=model, optimizer=optimizer, model_parameters=params, config=config)
    return engine, ds_optimizer


def is_deepspeed_engine(model: Any) -> bool:
    """True for a ``DeepSpeedEngine`` (without importing DeepSpeed when nothing did)."""
    deepspeed = sys.modules.get("deepspeed")
    return deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)


def partition_meta_zero3(model: nn.Module, config: dict, *, device: Any, dtype: Any) -> None:
    """Partition a meta-device model with ``zero.Init(module=...)``, one module at a time (children first): its own
    parameters are allocated whole in ``dtype`` for a moment, then each rank keeps its partition. The caller writes
    the values into the partitions (``ds_tensor``) before ``deepspeed.initialize``."""
    import deepspeed

    def post_order(module: nn.Module):
        for child in module.children():
            yield from post_order(child)
        yield module

    for module in post_order(model):
        if not any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
            continue
        to_empty(module, device, recurse=False)
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype and not hasattr(param, "ds_id"):
                param.data = torch.empty(param.shape, dtype=dtype, device=device)
        if any(not hasattr(p, "ds_id") for p in module.parameters(recurse=False)):
            deepspeed.zero.Init(module=module, config_dict_or_path=config, dtype=dtype)


def _deepspeed_comm(env: DistEnv) -> None:
    """DeepSpeed's comm over torch's process group, and LOCAL_RANK: ``zero.Init`` reads both before
    ``deepspeed.initialize`` would set them up (it then saw a world of 1 and refused the batch size)."""
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    if env.device.type == "cpu":
        _skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False, verbose=False)


def _skip_shm_comm_op() -> None:
    """On a CPU DeepSpeed's comm JIT-compiles a shared-memory all-reduce op (40-55 s and a C++ compiler) and leaves
    a 66 MB ``/dev/shm`` file per rank, for inference only (training goes through torch's process group): marking
    it incompatible in ``deepspeed.ops`` (the edit persists) makes DeepSpeed skip it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # ShareMemCommBuilder's name there


class DeepSpeed(Strategy):
    """DeepSpeed ZeRO: the engine builds the optimizer from the spec (or the config's block), accumulates, clips and
    casts itself. A meta model is partitioned through ``zero.Init`` under ZeRO-3, allocated whole under ZeRO-1/2."""

    name = "deepspeed"
    engine_words = "a DeepSpeed engine (deepspeed.initialize)"
    Config = DeepSpeedConfig
    accelerate = {"distributed_type": "DEEPSPEED"}
    package = "deepspeed"
    bench_devices = ("cpu",)
    checkpoint = ZeROCheckpoint()
    rank_imports = ("deepspeed",)
    noisy_loggers = ("DeepSpeed",)  # its INFO lines drown a command's progress output
    fit_way_out = ("ZeRO-3 with optimizer and parameter offload",
                   {"strategy": name, "zero_stage": 3, "offload_optimizer": True, "offload_param": True})
    options = {**dict.fromkeys(("zero_stage", "micro_batch_size", "grad_accum", "gradient_clipping",
                                "offload_optimizer", "ds_config", "reduce_dtype"), ALWAYS),
               "offload_param": When({"zero_stage": (3,)})}
    optimizer_keys = {"torch_adam": bool, "adam_w_mode": bool}  # DeepSpeed's Adam/AdamW keys beside torch's
    rules = (
        Rule(("offload_param", "zero_stage"),
             lambda cfg, facts: cfg.parallel.offload_param and cfg.parallel.zero_stage != 3,
             "only ZeRO-3 partitions parameters", "Use zero_stage=3 or offload_optimizer=True."),
        Rule(("compile", "strategy"), lambda cfg, facts: cfg.parallel.compile is True,
             "DeepSpeed runs its own hooks around every module, so fp8dist does not compile blocks under it; "
             "compile the engine wrap_model returns with engine.compile()",
             "Use compile=False (or None: auto decides)."),
        Rule(("nonfinite_step", "strategy"), lambda cfg, facts: cfg.parallel.nonfinite_step == "error",
             "DeepSpeed's engine checks the gradients inside its own step (bf16 check_grad_overflow, fp16 loss "
             "scaling) and skips a non-finite step rather than raising", "Use nonfinite_step='skip' (the engine's "
             "check, counted and stopped after max_skipped_steps by fp8dist) or 'off'."),
        Rule(("reduce_dtype", "strategy"), lambda cfg, facts: cfg.parallel.reduce_dtype == "fp8",
             "DeepSpeed's only quantized gradient reduction, ZeRO++'s zero_quantized_gradients, sends int4 blocks "
             "(not FP8), under ZeRO-3 only, through a CUDA kernel (its QuantizerBuilder op); its "
             "communication_data_type takes fp32, bf16 or fp16",
             "Use strategy='fsdp' or 'ddp' for FP8 gradients on the wire, or reduce_dtype='bf16' with "
             "strategy='deepspeed' (set zero_quantized_gradients in your ds_config for ZeRO++'s int4 on a GPU)."),
    )

    def check_launch(self, cfg, world_size: int) -> None:
        """The user's json read before anything changes, its optimizer block checked as any spec."""
        if cfg.parallel.ds_config is None:
            return
        block = read_user_config(cfg.parallel.ds_config).get("optimizer")
        if isinstance(block, Mapping):
            check_optimizer_spec({"type": block.get("type"), **(block.get("params") or {})},
                                 who=f"DeepSpeed config {cfg.parallel.ds_config!r}: ", engine_keys=self.optimizer_keys)

    def facts(self, cfg, world_size=None) -> StrategyFacts:
        """The engine owns the parameters and builds, steps, accumulates and clips the optimizer; ZeRO-3
        partitions parameters over every rank, ZeRO-1/2 keep them whole."""
        partitions = None if world_size is None else (world_size if cfg.parallel.zero_stage == 3 else 1)
        return StrategyFacts(engine_owns_params=True, engine_builds_optimizer=True, casts_gradients=True,
                             broadcasts_weights=True, shard_degree=partitions)

    def shard(self, model: nn.Module, job: ShardJob) -> Sharded:
        """``deepspeed.initialize`` on the config fp8dist builds (the user's ``ds_config`` merged under it);
        a meta model partitioned through ``zero.Init`` under ZeRO-3. ValueError without an optimizer spec or block."""
        p, env = job.cfg.parallel, job.env
        extra, initialize = job.engine_entry or ({}, None)
        config = {**build_deepspeed_config(model, p, world_size=env.world_size, optimizer=job.optimizer), **extra}
        if "optimizer" not in config and not callable(job.optimizer):
            raise ValueError("strategy='deepspeed' builds the optimizer inside deepspeed.initialize: pass "
                             "optimizer={'type': 'AdamW', 'lr': ...} (or a callable params -> optimizer), or a "
                             "ds_config with an 'optimizer' block.")
        if env.device.type == "cpu":
            config = torch_adam_on_cpu(config)
        _deepspeed_comm(env)
        if job.meta and p.zero_stage == 3:  # each rank allocates its partitions only
            partition_meta_zero3(model, config, device=env.device, dtype=torch_dtype(p.param_dtype))
            loaded, how = fill_shards(model, job)
        else:
            loaded, how = fill_whole(model, job, self.name)
        cast_buffers(model, torch_dtype(p.buffer_dtype))
        engine, _ = apply_deepspeed(model, config, optimizer=job.optimizer if callable(job.optimizer) else None,
                                    local_rank=env.local_rank, initialize=initialize)
        info = ShardingInfo(self.name, (), f"DeepSpeed ZeRO-{config['zero_optimization']['stage']}")
        return Sharded(engine, info, loaded, how, engine.optimizer)

    def watch_steps(self, model: nn.Module, guard: Any) -> None:
        """The engine checks and skips inside ``engine.step()``; the guard reads its verdict (``skipped_steps``)
        when ``global_steps`` moves."""
        step = model.step

        def step_and_count(*args: Any, **kwargs: Any) -> Any:
            steps, skipped = model.global_steps, model.skipped_steps
            out = step(*args, **kwargs)
            if model.global_steps != steps:
                guard.after_engine_step(model.skipped_steps != skipped)
            return out

        model.step = step_and_count

    def missing_reason(self) -> str | None:
        """DeepSpeed not installed, with its pip extra."""
        return super().missing_reason() and "DeepSpeed is not installed (pip install 'fp8dist[deepspeed]')"

    def no_sync(self, model: nn.Module):
        """Refused (ValueError): the engine accumulates over ``grad_accum`` micro-batches itself."""
        raise ValueError(_OWN_STEP.format(self.name, "accumulates gradients over grad_accum micro-batches",
                                          "pass grad_accum=N to wrap_model and call engine.backward(loss) and "
                                          "engine.step() for every micro-batch, without no_sync"))

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float):
        """Refused (ValueError): the engine clips in its step (``gradient_clipping``)."""
        raise ValueError(_OWN_STEP.format(self.name, "clips gradients in engine.step()",
                                          "pass gradient_clipping=X to wrap_model; engine.get_global_grad_norm() "
                                          "gives the norm of the last step"))

    def is_engine(self, module: object) -> bool:
        """A ``DeepSpeedEngine`` (DeepSpeed not imported: none can exist)."""
        return is_deepspeed_engine(module)

    def holds_param(self, param: nn.Parameter) -> str | None:
        """A parameter carrying ZeRO-3's partition id or ZeRO-1/2's link to its fp32 master (DeepSpeed 0.19)."""
        if any(hasattr(param, attr) for attr in ("ds_id", "_hp_mapping")):
            return "held by DeepSpeed (deepspeed.initialize or zero.Init by hand)"
        return None

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The engine's ``.module``."""
        return model.module

    def accumulating(self, model: nn.Module, *, last: bool):
        """None needed: the engine accumulates over ``grad_accum`` micro-batches, counted by its ``step()``."""
        return contextlib.nullcontext()

    def backward(self, model: nn.Module, loss: torch.Tensor, *, micro_batches: int = 1, last: bool = True) -> None:
        """``engine.backward(loss)`` (the engine scales by its gradient_accumulation_steps); a micro-batch that is
        not the last is then counted by ``engine.step()``, which updates only at the accumulation boundary (the
        last's :meth:`optimizer_step`)."""
        model.backward(loss)
        if not last:
            model.step()

    def optimizer_step(self, model: nn.Module, optimizer: Any, *, while_held=None) -> None:
        """``engine.step()``: it clips, updates and zeroes the gradients itself (``optimizer`` is its own, unused);
        ``while_held`` runs before it, while the gradient partitions it frees are still held."""
        if while_held is not None:
            while_held()
        model.step()

    def global_grad_norm(self, model: nn.Module) -> float | None:
        """``engine.get_global_grad_norm()``: the norm the engine computed, before clipping, in its last step."""
        return model.get_global_grad_norm()

    def estimate_engine(self, model: nn.Module, cfg: Any, world_size: int, blocks: list[str], *, optimizer: str,
                        on_cpu: bool) -> EngineMemory:
        """From the config wrap_model builds, validated when DeepSpeed is installed here."""
        checked = importlib.util.find_spec("deepspeed") is not None
        spec = {"type": optimizer} if optimizer in ("adam", "adamw") else None
        ds = build_deepspeed_config(model, cfg.parallel, world_size=world_size, optimizer=spec, validate=checked)
        block = (torch_adam_on_cpu(ds) if on_cpu else ds).get("optimizer") or {}
        zero = ds.get("zero_optimization", {})
        stage = int(zero.get("stage", 0))
        dtype = next((key for key in ("bf16", "fp16") if ds.get(key, {}).get("enabled")), "fp32")
        comm, bucket = ds.get("communication_data_type") or dtype, int(zero.get("reduce_bucket_size", 5e8))
        notes = [f"DeepSpeed reduce bucket, not counted as model state: {bucket:,} elements in {comm} "
                 f"({byte_size(bucket * dtype_bytes(comm))}), "
                 + ("allocated for the whole run" if stage == 3 else "during backward")]
        if not checked:
            notes.append("DeepSpeed is not installed here: its parser did not check the config (wrap_model will)")
        offloaded = (("master_weights", "optimizer_states") if "offload_optimizer" in zero else ()) + \
            (("parameters",) if "offload_param" in zero else ())
        return EngineMemory(dtype=dtype, master="fp32", stage=stage, offloaded=offloaded, notes=tuple(notes), layout={
            "persistence": int(zero.get("stage3_param_persistence_threshold", 100_000)),
            "torch_adam": bool((block.get("params") or {}).get("torch_adam", False))})

    def rank_state_bytes(self, params, cfg: Any, world_size: int, engine: EngineMemory, *, step: int, level_states,
                         backend_optimizer: bool) -> list[dict[str, int]]:
        """ZeRO's partitions of the stage the estimate's config builds (persistent small parameters
        whole under ZeRO-3)."""
        return zero_state_bytes(params, world_size, stage=engine.stage, persistence=engine.layout["persistence"],
                                step=step if engine.layout["torch_adam"] else 0, backend_optimizer=backend_optimizer)

    def engine_dtypes(self, model: nn.Module, autocast) -> EngineDtypes:
        """ZeRO-1/2 broadcast the updated weights after the step; ZeRO-3 gathers them in the compute dtype."""
        compute = torch.bfloat16 if model.bfloat16_enabled() else torch.float16 if model.fp16_enabled() else \
            torch.float32
        gather = None if model.zero_optimization_stage() == 3 else \
            f"{dtype_name(compute)} (updated weights, after the step)"
        return EngineDtypes(compute, dtype_name(model.communication_data_type), gather, holder=model)

    def param_layout(self, model: nn.Module) -> ParamLayout:
        """ZeRO-3 partitions parameters (``ds_tensor`` holds this rank's part); ZeRO-1/2 keep them whole."""
        stage, params = model.zero_optimization_stage(), list(model.module.parameters())
        if stage != 3:
            return replace(super().param_layout(model.module), layout=f"DeepSpeed ZeRO-{stage}")
        return ParamLayout(f"DeepSpeed ZeRO-{stage}", sum(p.ds_numel for p in params),
                           sum(p.ds_tensor.numel() for p in params), len(params),
                           sum(1 for p in params if p.ds_tensor.numel() < p.ds_numel),
                           frozenset(p.ds_tensor.dtype for p in params))

    def state_tensors(self, model: nn.Module, optimizer: Any) -> dict[str, list[Any]]:
        """ZeRO keeps the weights in the module (stage 3: ``ds_tensor``), fp32 master and gradient partitions in its
        optimizer, the states in the inner torch optimizer."""
        zero, params = model.optimizer, list(model.module.parameters())
        return {
            "parameters": self.group_parts(params),
            "master_weights": [getattr(zero, name, None) for name in _MASTER_PARTITIONS],
            "gradients": [p.grad for p in params] + [getattr(zero, name) for name in _GRADIENT_PARTITIONS
                                                     if getattr(zero, name, None) is not None],
            "optimizer_states": [getattr(getattr(zero, "optimizer", zero), "state", {})]}

    def stored_parts(self, params: list[nn.Parameter]) -> list[torch.Tensor] | None:
        """ZeRO-3's ``ds_tensor`` partitions; None under ZeRO-1/2."""
        return [p.ds_tensor for p in params] if all(hasattr(p, "ds_tensor") for p in params) else None

    def group_parts(self, params: list[nn.Parameter]) -> list[Any]:
        """ZeRO-3 keeps small parameters (ds_persist) whole in p.data beside their partition; ZeRO-1/2 keep each
        whole."""
        if not all(hasattr(p, "ds_tensor") for p in params):
            return list(params)
        return [[p.ds_tensor, p.data if getattr(p, "ds_persist", False) else None] for p in params]

    def full_shapes(self, model: nn.Module) -> dict[tuple[int, str], tuple[int, ...]]:
        """ZeRO-3 empties each parameter for its partition; ``ds_shape`` keeps the full shape."""
        return {(id(m), n): tuple(p.ds_shape) for m in model.modules() for n, p in m.named_parameters(recurse=False)
                if hasattr(p, "ds_shape")}


_OWN_STEP = "strategy={!r}: the DeepSpeed engine {} itself; {}"  # no_sync's and clip_grad_norm_'s refusal


STRATEGY = DeepSpeed()
"""The strategy ``strategy='deepspeed'`` selects (registered by
:func:`fp8dist.strategies.register_builtins`)."""

# where ZeRO's optimizer keeps this rank's fp32 master partitions and its reduced gradients (stage 1/2, stage 3)
_MASTER_PARTITIONS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
_GRADIENT_PARTITIONS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer",
                        "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition")
