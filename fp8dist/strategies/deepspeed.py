"""strategy="deepspeed": DeepSpeed ZeRO 1-3. A complete config built from the model (no "auto" left),
``deepspeed.initialize``, and the :class:`DeepSpeed` strategy.

Bucket sizes follow Hugging Face's "auto" rules from the hidden size h: reduce_bucket_size = h^2,
stage3_prefetch_bucket_size = 0.9 h^2, stage3_param_persistence_threshold = 10 h.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config.axis import ALWAYS, Rule, StrategyFacts, When
from ..config.files import read_config_text
from ..pipeline.optim import check_optimizer_spec
from ..config.dtypes import dtype_bytes, dtype_name, torch_dtype
from ..pipeline.env import DistEnv
from ..config.options import StrategyConfig
from ..config.text import byte_size
from .base import (EngineDtypes, EngineMemory, ParamLayout, Sharded, ShardingInfo, ShardJob, Strategy, fill_whole,
                   materialized_how)
from .common import cast_buffers
from .deepspeed_checkpoint import ZeROCheckpoint
from .state_bytes import zero_state_bytes

__all__ = ["DeepSpeed", "zero_config", "build_deepspeed_config", "merge_user_config", "validate_with_deepspeed",
           "apply_deepspeed", "model_hidden_size", "is_deepspeed_engine", "partition_meta_zero3", "STRATEGY"]

_STAGES = (1, 2, 3)


def model_hidden_size(model: nn.Module) -> int | None:
    """The hidden size from a Hugging Face config (``hidden_size``, or the largest of ``hidden_sizes``)."""
    config = getattr(model, "config", None)
    if getattr(config, "hidden_size", None):
        return int(config.hidden_size)
    sizes = getattr(config, "hidden_sizes", None)
    return int(max(sizes)) if sizes else None


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")


def zero_config(stage: int = 2, *, model: nn.Module | None = None, hidden_size: int | None = None,
                micro_batch_size: int = 1, grad_accum: int = 1, world_size: int | None = None,
                param_dtype: str = "bf16", reduce_dtype: str = "fp32", gradient_clipping: float = 1.0,
                optimizer: Mapping[str, Any] | None = None, scheduler: Mapping[str, Any] | None = None,
                offload_optimizer: bool = False, offload_param: bool = False, check_grad_overflow: bool = True,
                validate: bool = True) -> dict:
    """A complete DeepSpeed ZeRO config as a plain dict: every value concrete, checked by DeepSpeed's parser.

    Args:
        stage: ZeRO stage 1, 2 or 3.
        model / hidden_size: where bucket sizes come from (``model.config.hidden_size``); neither keeps
            DeepSpeed's fixed defaults, written out.
        micro_batch_size, grad_accum: per-GPU micro batch and accumulation steps.
        world_size: data-parallel ranks; given, ``train_batch_size`` = micro x accum x world is written; None
            leaves it out and DeepSpeed derives it from the world it is launched on.
        param_dtype: "bf16" (default; fp32 master weights in the optimizer), "fp16" (dynamic loss scaling) or
            "fp32".
        reduce_dtype: dtype of the gradient communication (``communication_data_type``).
        optimizer, scheduler: DeepSpeed blocks (``{"type": "AdamW", "params": {...}}``); None leaves them out
            (pass a torch optimizer to ``deepspeed.initialize`` instead).
        offload_optimizer: optimizer states on CPU (stages 1-3); offload_param: parameters on CPU (stage 3).
        check_grad_overflow: bf16: the engine skips a step with non-finite gradients (DeepSpeed's default; fp16's
            loss scaler always does).
        validate: run DeepSpeed's own config parser on the result.

    Returns:
        The config dict, ready for ``json.dump`` and ``deepspeed --deepspeed_config``.
    """
    if stage not in _STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; choose one of 1, 2, 3 (stage 0 is plain data "
                         "parallelism: use strategy='ddp').")
    _check_positive("micro_batch_size", micro_batch_size)
    _check_positive("grad_accum", grad_accum)
    if world_size is not None:
        _check_positive("world_size", world_size)
    if param_dtype not in ("bf16", "fp16", "fp32") or reduce_dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"param_dtype={param_dtype!r} / reduce_dtype={reduce_dtype!r}: choose 'bf16', 'fp16' or "
                         "'fp32'.")
    if offload_param and stage != 3:
        raise ValueError(f"offload_param=True needs stage 3 (ZeRO-{stage} does not partition parameters).")
    h = hidden_size if hidden_size is not None else model_hidden_size(model)
    if h is not None:
        _check_positive("hidden_size", h)
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": h * h if h else 500_000_000,
        "allgather_bucket_size": 500_000_000,
    }
    if stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": int(0.9 * h * h) if h else 50_000_000,
            "stage3_param_persistence_threshold": 10 * h if h else 100_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "stage3_gather_16bit_weights_on_model_save": True,
        })
        del zero["allgather_bucket_size"]
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": gradient_clipping,
        "bf16": {"enabled": param_dtype == "bf16", "check_grad_overflow": check_grad_overflow},
        "fp16": {"enabled": param_dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "communication_data_type": reduce_dtype,
        "zero_optimization": zero,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    if world_size is not None:
        config["train_batch_size"] = micro_batch_size * grad_accum * world_size
    if optimizer is not None:
        config["optimizer"] = dict(optimizer)
    if scheduler is not None:
        config["scheduler"] = dict(scheduler)
    if validate:
        validate_with_deepspeed(config, world_size=world_size)
    return config


def build_deepspeed_config(model: nn.Module, cfg: StrategyConfig, *, world_size: int, optimizer: Any = None,
                           validate: bool = True) -> dict:
    """The DeepSpeed config of a job: :func:`zero_config` from the model and ``cfg``, merged under the user's json
    (``cfg.ds_config``) when given. ``wrap_model`` uses it, and so does the memory estimate (one builder, so the two
    cannot disagree). A mapping ``optimizer`` spec becomes the config's optimizer block.

    Args:
        validate: check the result (fp8dist's rules, then DeepSpeed's own parser, which needs DeepSpeed installed).
    """
    spec = dict(optimizer) if isinstance(optimizer, Mapping) else None
    block = {"type": spec.pop("type", None), "params": spec} if spec is not None else None
    built = zero_config(cfg.zero_stage, model=model, micro_batch_size=cfg.micro_batch_size,
                        grad_accum=cfg.grad_accum, world_size=world_size, param_dtype=cfg.param_dtype,
                        reduce_dtype=cfg.reduce_dtype, gradient_clipping=cfg.gradient_clipping, optimizer=block,
                        offload_optimizer=cfg.offload_optimizer, offload_param=cfg.offload_param,
                        check_grad_overflow=cfg.nonfinite_step != "off", validate=validate and cfg.ds_config is None)
    if cfg.ds_config is None:
        return built
    merged = merge_user_config(cfg.ds_config, built)
    if validate:
        validate_with_deepspeed(merged, world_size=world_size)
    return merged


def validate_with_deepspeed(config: Mapping[str, Any], *, world_size: int | None = None) -> None:
    """Check ``config`` with fp8dist's rules (batch equation, one of fp16/bf16, a real stage) and then with
    DeepSpeed's own parser (``DeepSpeedConfig``); raise ValueError saying what is wrong."""
    if "auto" in json.dumps(config):
        raise ValueError("the DeepSpeed config still holds an \"auto\" value: fp8dist writes concrete values only.")
    if config.get("bf16", {}).get("enabled") and config.get("fp16", {}).get("enabled"):
        raise ValueError("the DeepSpeed config enables both fp16 and bf16: keep one (fp8dist's default is bf16).")
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, *_STAGES):
        raise ValueError(f"zero_optimization.stage={stage!r} does not exist; choose 1, 2 or 3.")
    micro, total = config.get("train_micro_batch_size_per_gpu"), config.get("train_batch_size")
    accum = config.get("gradient_accumulation_steps", 1)
    if world_size is not None and None not in (micro, total) and (product := micro * accum * world_size) != total:
        raise ValueError(f"train_batch_size={total} but train_micro_batch_size_per_gpu={micro} x "
                         f"gradient_accumulation_steps={accum} x world size {world_size} = {product}: fix one of them, "
                         "or drop train_batch_size and let DeepSpeed derive it.")
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = copy.deepcopy(dict(config))
    probe.pop("train_batch_size", None)  # without a process group DeepSpeed assumes world size 1
    try:
        DeepSpeedConfig(probe)
    except Exception as err:  # DeepSpeed raises AssertionError / ValueError / pydantic errors
        raise ValueError(f"DeepSpeed rejects the config: {err}") from err


def torch_adam_on_cpu(config: Mapping[str, Any]) -> dict:
    """``config`` with DeepSpeed's ``torch_adam`` set in an Adam/AdamW block that does not say: on a CPU, DeepSpeed's
    Adam is ``FusedAdam``, a C++ op compiled on first use (a minute or more per machine and environment), so an
    fp8dist job on a CPU asks for torch's AdamW instead. A block that names ``torch_adam`` keeps its choice, and
    an offloaded optimizer keeps DeepSpeed's CPU Adam (the engine refuses any other there)."""
    block = config.get("optimizer")
    offloaded = (config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none") != "none"
    if not isinstance(block, Mapping) or offloaded or str(block.get("type", "")).lower() not in ("adam", "adamw"):
        return dict(config)
    return {**config, "optimizer": {**block, "params": {"torch_adam": True, **(block.get("params") or {})}}}


def read_user_config(path: str | Path) -> dict:
    """The user's DeepSpeed json (``ds_config``), read strictly (a key given twice is an error naming it)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {str(path)!r} does not exist.")
    user = read_config_text(path, what="DeepSpeed config")
    if not isinstance(user, dict):
        raise ValueError(f"DeepSpeed config {str(path)!r} must hold a JSON object, got {type(user).__name__}.")
    return user


def merge_user_config(user: Mapping[str, Any] | str | Path, built: Mapping[str, Any]) -> dict:
    """The user's DeepSpeed config, with only the keys it lacks filled from ``built`` (nested blocks merged
    key by key). The user's values always win; contradictions are reported by :func:`validate_with_deepspeed`."""
    if isinstance(user, (str, Path)):
        user = read_user_config(user)
    merged = copy.deepcopy(dict(user))
    for key, value in built.items():
        if key not in merged:
            merged[key] = copy.deepcopy(value)
        elif isinstance(value, Mapping) and isinstance(merged[key], Mapping):
            merged[key] = {**value, **merged[key]}
    if "train_batch_size" in merged and "train_batch_size" not in user:
        del merged["train_batch_size"]  # derived by DeepSpeed from the user's own micro/accum and the world
    return merged


def apply_deepspeed(model: nn.Module, config: dict, *, optimizer: Any = None, local_rank: int = 0,
                    initialize: Any = None):
    """``deepspeed.initialize`` (or ``initialize``, e.g. MS-AMP's DeepSpeed entry point) with ``config``; returns
    ``(engine, optimizer)``. Call after FP8 conversion. DeepSpeed insists on LOCAL_RANK in the environment (its
    launcher and torchrun set it); a process group created otherwise gets it set here from the rank fp8dist found
    (as ``wrap_model`` sets it before)."""
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
    """ZeRO-3 partitions a meta-device model through DeepSpeed's own ``zero.Init(module=...)``, one module at a
    time (children first): the module's own parameters are allocated at full size in ``dtype`` (what
    ``deepspeed.initialize`` would cast them to) for a moment, then each rank keeps its partition. The values are
    not set here: the caller writes them into the partitions (``ds_tensor``) before ``deepspeed.initialize``."""
    import deepspeed

    from .common import to_empty

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


def _zero3(cfg: Any) -> bool:
    return cfg.parallel.zero_stage == 3


def _deepspeed_comm(env: DistEnv) -> None:
    """DeepSpeed's communication layer over torch's process group, and the LOCAL_RANK it insists on: ``zero.Init``
    (ZeRO-3 meta init) reads both before ``deepspeed.initialize`` would set them up (it then saw a world of 1 and
    refused the batch size); a process group created without a launcher gets LOCAL_RANK from the rank fp8dist
    found. On a CPU without DeepSpeed's shared-memory op (:func:`_skip_shm_comm_op`)."""
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
    if env.device.type == "cpu":
        _skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False, verbose=False)


def _skip_shm_comm_op() -> None:
    """DeepSpeed's comm, at its first initialization on a CPU, JIT-compiles its shared-memory all-reduce op (40-55 s
    and a C++ compiler on a fresh machine; again whenever another ``ninja`` finds the build foreign) and maps a
    66 MB ``/dev/shm`` file per rank that it never removes. Only ``inference_all_reduce`` uses it, which DeepSpeed's
    tensor-parallel inference layers call; training's collectives go through torch's process group. So fp8dist
    marks the op incompatible in DeepSpeed's table of compatible ops (kept in ``deepspeed.ops``, edits persist) and
    DeepSpeed skips it. A script that initialized DeepSpeed's comm itself before ``wrap_model`` has it already."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # ShareMemCommBuilder's name there


class DeepSpeed(Strategy):
    """DeepSpeed ZeRO: the engine builds the optimizer from the spec (or the config's block), accumulates, clips and
    casts itself. A meta model is partitioned module by module through ``zero.Init`` under ZeRO-3 (each rank
    allocates its partitions only), allocated whole under ZeRO-1/2; then filled, then handed to
    ``deepspeed.initialize`` (or an FP8 backend's own entry into it)."""

    name = "deepspeed"
    accelerate = {"distributed_type": "DEEPSPEED"}
    package = "deepspeed"
    bench_devices = ("cpu",)
    checkpoint = ZeROCheckpoint()
    rank_imports = ("deepspeed",)
    fit_way_out = ("ZeRO-3 with optimizer and parameter offload",
                   {"strategy": name, "zero_stage": 3, "offload_optimizer": True, "offload_param": True})
    options = {**dict.fromkeys(("zero_stage", "micro_batch_size", "grad_accum", "gradient_clipping",
                                "offload_optimizer", "ds_config", "reduce_dtype"), ALWAYS),
               "offload_param": When({"zero_stage": (3,)})}
    optimizer_keys = {"torch_adam": bool, "adam_w_mode": bool}
    """Keys DeepSpeed's Adam/AdamW block takes beside torch's (its own types, Lamb and the rest, are its own)."""
    rules = (
        Rule(("offload_param", "zero_stage"), lambda cfg, facts: cfg.parallel.offload_param and not _zero3(cfg),
             "only ZeRO-3 partitions parameters", "Use zero_stage=3 or offload_optimizer=True."),
        Rule(("compile", "strategy"), lambda cfg, facts: cfg.parallel.compile is True,
             "DeepSpeed runs its own hooks around every module, so fp8dist does not compile blocks under it; "
             "compile the engine wrap_model returns with engine.compile()",
             "Use compile=False (or None: auto decides)."),
        Rule(("nonfinite_step", "strategy"), lambda cfg, facts: cfg.parallel.nonfinite_step == "error",
             "DeepSpeed's engine checks the gradients inside its own step (bf16 check_grad_overflow, fp16 loss "
             "scaling) and skips a non-finite step rather than raising", "Use nonfinite_step='skip' (the engine's "
             "check, counted and stopped after max_skipped_steps by fp8dist) or 'off'."),
    )

    def check_launch(self, cfg, world_size: int) -> None:
        """The user's json read before anything changes, its optimizer block checked as any optimizer spec."""
        if cfg.parallel.ds_config is None:
            return
        block = read_user_config(cfg.parallel.ds_config).get("optimizer")
        if isinstance(block, Mapping):
            check_optimizer_spec({"type": block.get("type"), **(block.get("params") or {})},
                                 who=f"DeepSpeed config {cfg.parallel.ds_config!r}: ", engine_keys=self.optimizer_keys)

    def facts(self, cfg, world_size=None) -> StrategyFacts:
        partitions = None if world_size is None else (world_size if _zero3(cfg) else 1)
        return StrategyFacts(engine_owns_params=True, engine_builds_optimizer=True, casts_gradients=True,
                             broadcasts_weights=True, shard_degree=partitions)

    def shard(self, model: nn.Module, job: ShardJob) -> Sharded:
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
        if job.meta and _zero3(job.cfg):  # each rank allocates its partitions only
            partition_meta_zero3(model, config, device=env.device, dtype=torch_dtype(p.param_dtype))
            loaded = job.fill(model) if job.fill is not None else None
            how = materialized_how(env.device, whole=False, pretrained=p.pretrained)
        else:
            loaded, how = fill_whole(model, job, self.name)
        cast_buffers(model, torch_dtype(p.buffer_dtype))
        engine, _ = apply_deepspeed(model, config, optimizer=job.optimizer if callable(job.optimizer) else None,
                                    local_rank=env.local_rank, initialize=initialize)
        info = ShardingInfo(self.name, (), f"DeepSpeed ZeRO-{config['zero_optimization']['stage']}")
        return Sharded(engine, info, loaded, how, engine.optimizer)

    def watch_steps(self, model: nn.Module, guard: Any) -> None:
        """The engine checks and skips inside ``engine.step()`` (its ``skipped_steps``); the guard reads its
        verdict at each optimizer step (a gradient-accumulation boundary: ``global_steps`` moves)."""
        step = model.step

        def step_and_count(*args: Any, **kwargs: Any) -> Any:
            steps, skipped = model.global_steps, model.skipped_steps
            out = step(*args, **kwargs)
            if model.global_steps != steps:
                guard.after_engine_step(model.skipped_steps != skipped)
            return out

        model.step = step_and_count

    def missing_reason(self) -> str | None:
        return super().missing_reason() and "DeepSpeed is not installed (pip install 'fp8dist[deepspeed]')"

    def no_sync(self, model: nn.Module):
        raise ValueError(_OWN_STEP.format(self.name, "accumulates gradients over grad_accum micro-batches",
                                          "pass grad_accum=N to wrap_model and call engine.backward(loss) and "
                                          "engine.step() for every micro-batch, without no_sync"))

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float):
        raise ValueError(_OWN_STEP.format(self.name, "clips gradients in engine.step()",
                                          "pass gradient_clipping=X to wrap_model; engine.get_global_grad_norm() "
                                          "gives the norm of the last step"))

    def estimate_engine(self, model: nn.Module, cfg: Any, world_size: int, blocks: list[str], *, optimizer: str,
                        on_cpu: bool) -> EngineMemory:
        """From the config wrap_model builds, validated as wrap_model validates it when DeepSpeed is installed
        here (its parser needs it; the estimate does not); on a CPU the engine's Adam is torch's."""
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
        """ZeRO keeps bf16 weights in the module (stage 3: ``ds_tensor`` partitions), fp32 master partitions and
        gradient partitions in its optimizer, and the optimizer states in the inner torch optimizer."""
        zero, params = model.optimizer, list(model.module.parameters())
        stage3 = all(hasattr(p, "ds_tensor") for p in params)
        return {  # ZeRO-3 keeps small parameters (ds_persist) whole in p.data besides their partition
            "parameters": [[p.ds_tensor, p.data if getattr(p, "ds_persist", False) else None] if stage3 else p
                           for p in params],
            "master_weights": [getattr(zero, name, None) for name in _MASTER_PARTITIONS],
            "gradients": [p.grad for p in params] + [getattr(zero, name) for name in _GRADIENT_PARTITIONS
                                                     if getattr(zero, name, None) is not None],
            "optimizer_states": [getattr(getattr(zero, "optimizer", zero), "state", {})]}

    def stored_parts(self, params: list[nn.Parameter]) -> list[torch.Tensor] | None:
        return [p.ds_tensor for p in params] if all(hasattr(p, "ds_tensor") for p in params) else None


_OWN_STEP = "strategy={!r}: the DeepSpeed engine {} itself; {}"
"""What no_sync and clip_grad_norm_ say of an engine that accumulates and clips inside its own step."""


STRATEGY = DeepSpeed()

_MASTER_PARTITIONS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
"""Where ZeRO's optimizer keeps this rank's fp32 master partitions (stage 1/2, stage 3)."""
_GRADIENT_PARTITIONS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer",
                        "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition")
"""Where ZeRO keeps this rank's reduced gradients between backward and step (stage 1/2, stage 3; freed by its
step)."""
