"""A complete DeepSpeed config from the model and the strategy's options (no "auto" left, bucket sizes by Hugging
Face's "auto" rules from the hidden size), the user's own json merged under it, checked by DeepSpeed's parser."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from ..config.files import read_config_text
from ..config.options import StrategyConfig

__all__ = ["zero_config", "build_deepspeed_config", "merge_user_config", "validate_with_deepspeed",
           "model_hidden_size", "torch_adam_on_cpu", "read_user_config"]

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
    """A complete DeepSpeed ZeRO config as a plain dict, every value concrete, ready for ``json.dump``.

    Args:
        model / hidden_size: where bucket sizes come from (reduce h^2, prefetch 0.9 h^2, persistence 10 h);
            neither: DeepSpeed's fixed defaults, written out.
        world_size: given, ``train_batch_size`` = micro x accum x world is written; None: DeepSpeed derives it.
        param_dtype: "bf16" (fp32 masters in the optimizer), "fp16" (dynamic loss scaling) or "fp32".
        reduce_dtype: dtype of the gradient communication (``communication_data_type``).
        offload_optimizer: optimizer states on CPU (stages 1-3); offload_param: parameters on CPU (stage 3 only).
        optimizer, scheduler: DeepSpeed blocks (``{"type": "AdamW", "params": {...}}``); None leaves them out.
        check_grad_overflow: bf16: the engine skips a step with non-finite gradients (fp16's scaler always does).
        validate: run DeepSpeed's own config parser on the result.
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
    """The DeepSpeed config of a job, for ``wrap_model`` and the memory estimate alike: :func:`zero_config` merged
    under the user's ``cfg.ds_config``; a mapping ``optimizer`` spec becomes its optimizer block. ``validate``: check
    it with :func:`validate_with_deepspeed` (which needs DeepSpeed)."""
    spec = dict(optimizer) if isinstance(optimizer, Mapping) else None
    block = {"type": spec.pop("type", None), "params": spec} if spec is not None else None
    built = zero_config(cfg.zero_stage, model=model, micro_batch_size=cfg.micro_batch_size,
                        grad_accum=cfg.grad_accum, world_size=world_size, param_dtype=cfg.param_dtype,
                        reduce_dtype=cfg.reduce_dtype, gradient_clipping=cfg.gradient_clipping, optimizer=block,
                        offload_optimizer=cfg.offload_optimizer, offload_param=cfg.offload_param,
                        check_grad_overflow=cfg.nonfinite_step != "off", validate=False)
    config = built if cfg.ds_config is None else merge_user_config(cfg.ds_config, built)
    if validate:
        validate_with_deepspeed(config, world_size=world_size)
    return config


def validate_with_deepspeed(config: Mapping[str, Any], *, world_size: int | None = None) -> None:
    """ValueError saying what is wrong with ``config`` by fp8dist's rules (batch equation, one of fp16/bf16, a real
    stage), then by DeepSpeed's own parser."""
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
    """``config`` with ``torch_adam`` set in an Adam/AdamW block that does not say, for a CPU: DeepSpeed's
    ``FusedAdam`` is a C++ op compiled on first use (a minute or more). An offloaded optimizer keeps DeepSpeed's
    CPU Adam (the engine refuses any other there)."""
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
    """The user's DeepSpeed config, the keys it lacks filled from ``built`` (nested blocks key by key): the user's
    values always win."""
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
