"""fp8dist: FP8 training on sharded data parallelism in one call.

    model = fp8dist.wrap_model(model, strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters())

The public names load with their engines (torch, transformers) when first read, not by ``import fp8dist``: the
``fp8dist`` command answers a bad flag or ``--help`` without importing torch (5-11 s on a loaded CPU).
"""

from __future__ import annotations

from typing import Any

from .config.lazy import lazy_names
from .runtime.packages import __version__

__all__ = [
    "wrap_model",
    "get_wrap_info",
    "get_plan",
    "plan_precision",
    "predict_fp8_speedup",
    "PrecisionPlan",
    "PlanEntry",
    "WrapInfo",
    "Config",
    "StrategyConfig",
    "FP8Config",
    "resolve_config",
    "load_config_file",
    "init_distributed",
    "shutdown",
    "DistEnv",
    "sharding_summary",
    "unwrap_model",
    "no_sync",
    "clip_grad_norm_",
    "report",
    "PrecisionReport",
    "estimate_memory",
    "MemoryEstimate",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "CheckpointState",
    "CheckpointError",
    "save_pretrained",
    "TrainingFigures",
    "MetricsWriter",
    "measure_fp8_numerics",
    "NumericsReport",
    "Strategy",
    "FP8Backend",
    "MemoryLevel",
    "register_strategy",
    "register_backend",
    "register_level",
    "__version__",
    "predict_step",
]


def _load() -> dict[str, Any]:
    """``fp8dist.NAME``: the public names (and the sub-packages they load), imported together on the first read."""
    from .pipeline.api import WrapInfo, get_plan, get_wrap_info, wrap_model
    from .checkpoint import CheckpointError, CheckpointState, latest_checkpoint, load_checkpoint, save_checkpoint
    from .checkpoint.hf import save_pretrained
    from .config.resolve import Config, FP8Config, StrategyConfig, load_config_file, resolve_config
    from .runtime.env import DistEnv, init_distributed, shutdown
    from .pipeline.grads import clip_grad_norm_, no_sync
    from .plan.precision import PlanEntry, PrecisionPlan, plan_precision
    from .accounting import MemoryEstimate, PrecisionReport, estimate_memory, report
    from .train.metrics import MetricsWriter, TrainingFigures
    from .numerics import NumericsReport, measure_fp8_numerics
    from .accounting.sharding import sharding_summary
    from .plan.speed import predict_fp8_speedup
    from .plan.speed.step_time import predict_step
    from .strategies import Strategy, register_strategy, unwrap_model
    from .fp8 import FP8Backend, register_backend
    from .memory_levels import MemoryLevel, register_level

    return locals()


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__getattr__ = lazy_names(globals(), _load)
