"""fp8dist: FP8 training on sharded data parallelism in one call.

    model = fp8dist.wrap_model(model, strategy="fsdp")
    optimizer = torch.optim.AdamW(model.parameters())
"""

from ._version import __version__
from .api import WrapInfo, get_plan, get_wrap_info, wrap_model
from .checkpoint import CheckpointError, CheckpointState, latest_checkpoint, load_checkpoint, save_checkpoint
from .checkpoint.hf import save_pretrained
from .config import Config, FP8Config, StrategyConfig, load_config_file, resolve_config
from .env import DistEnv, init_distributed, shutdown
from .grads import clip_grad_norm_, no_sync
from .plan import PlanEntry, PrecisionPlan, plan_precision
from .memory import MemoryEstimate, PrecisionReport, estimate_memory, report
from .metrics import MetricsWriter, TrainingFigures
from .numerics import NumericsReport, measure_fp8_numerics
from .sharding import sharding_summary
from .speed import predict_fp8_speedup
from .strategies import unwrap_model


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
    "__version__",
]
