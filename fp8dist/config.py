"""The one config schema: every default of fp8dist's wrapping is defined here, once.

Python keyword options (``wrap_model(m, strategy="fsdp", reduce_dtype="bf16")``), a YAML/JSON file and the
``fp8dist`` CLI flags all land in these dataclasses. Every key is a field name; a bad value raises ValueError
naming the field, the value and the choices.

Example::

    cfg = resolve_config("fp8dist.yaml", strategy="fsdp1")     # file, then keyword overrides
    cfg.parallel.param_dtype                                    # 'bf16'
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Mapping

import torch

from ._schema import check_fields, route_keys

__all__ = [
    "StrategyConfig",
    "FP8Config",
    "Config",
    "resolve_config",
    "load_config_file",
    "torch_dtype",
    "STRATEGIES",
    "FP8_BACKENDS",
]

Strategy = Literal["none", "ddp", "fsdp", "fsdp1", "deepspeed"]
DtypeName = Literal["fp32", "bf16", "fp16"]
FP8Backend = Literal["te", "torchao", "msamp"]
Device = Literal["auto", "cpu", "cuda"]

STRATEGIES: tuple[str, ...] = Strategy.__args__  # type: ignore[attr-defined]
FP8_BACKENDS: tuple[str, ...] = FP8Backend.__args__  # type: ignore[attr-defined]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a validated dtype name ("fp32", "bf16", "fp16")."""
    return _DTYPES[name]


def _dtype_name(value: Any) -> Any:
    """Accept torch dtypes and common spellings ("bfloat16", torch.bfloat16) for the short names."""
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value.lower(), value.lower())
    return value


@dataclass(kw_only=True, frozen=True)
class StrategyConfig:
    """How the model is replicated or sharded, and the mixed precision of the strategy."""

    strategy: Strategy = "fsdp"
    """How the model is spread over ranks: none (one process), ddp, fsdp (FSDP2 fully_shard), fsdp1
    (FullyShardedDataParallel) or deepspeed (ZeRO)."""

    param_dtype: DtypeName = "bf16"
    """Dtype of forward/backward compute. FSDP casts the gathered parameters to it; ddp and none keep fp32
    parameters and run the forward under autocast to it."""

    reduce_dtype: DtypeName = "fp32"
    """Dtype in which gradients are reduced across ranks. Under ddp, bf16/fp16 use DDP's compression hooks,
    which need NCCL (CUDA)."""

    buffer_dtype: DtypeName = "fp32"
    """Dtype of floating-point buffers (e.g. rotary inv_freq); fp32 keeps Llama-style models accurate."""

    block_classes: tuple[str, ...] = ()
    """Class names of the blocks FSDP shards one by one before the root. Empty: Hugging Face
    _no_split_modules, else the children of the largest nn.ModuleList."""

    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (ZeRO-3 style). False keeps them until backward
    (ZeRO-2 style: more memory, less communication)."""

    device: Device = "auto"
    """Where the model runs: auto picks cuda:LOCAL_RANK when CUDA is available, else cpu."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            object.__setattr__(self, name, _dtype_name(getattr(self, name)))
        if isinstance(self.strategy, str):
            object.__setattr__(self, "strategy", self.strategy.lower())
        if isinstance(self.block_classes, (list, set, frozenset)) or isinstance(self.block_classes, type):
            blocks = [self.block_classes] if isinstance(self.block_classes, type) else list(self.block_classes)
            object.__setattr__(self, "block_classes", tuple(blocks))
        if isinstance(self.block_classes, tuple):
            names = tuple(b.__name__ if isinstance(b, type) else b for b in self.block_classes)
            object.__setattr__(self, "block_classes", names)
        check_fields(self)


@dataclass(kw_only=True, frozen=True)
class FP8Config:
    """Which FP8 backend is layered on top of the strategy."""

    fp8: FP8Backend | None = None
    """FP8 backend: te (Transformer Engine), torchao (float8 training) or msamp (MS-AMP); none keeps the
    strategy's mixed precision everywhere."""

    def __post_init__(self) -> None:
        if isinstance(self.fp8, str):
            value = self.fp8.lower()
            object.__setattr__(self, "fp8", None if value == "none" else value)
        check_fields(self)


_SECTIONS = {"parallel": StrategyConfig, "precision": FP8Config}


@dataclass(kw_only=True, frozen=True)
class Config:
    """Everything ``wrap_model`` needs, by concern. Keys are flat: each is a field of one section."""

    parallel: StrategyConfig = field(default_factory=StrategyConfig)
    """Strategy and its mixed precision."""

    precision: FP8Config = field(default_factory=FP8Config)
    """FP8 backend and its knobs."""

    def to_dict(self) -> dict[str, Any]:
        """Flat ``{key: value}`` dict, the same keys a YAML file and ``wrap_model`` take."""
        flat: dict[str, Any] = {}
        for name in _SECTIONS:
            flat.update(asdict(getattr(self, name)))
        flat["block_classes"] = list(flat["block_classes"])
        return flat

    @classmethod
    def from_dict(cls, flat: Mapping[str, Any], *, source: str = "config") -> "Config":
        """Build from flat keys; unknown keys and bad values raise ValueError."""
        routed = route_keys(flat, _SECTIONS.values(), source=source)
        return cls(**{name: section(**routed[section]) for name, section in _SECTIONS.items()})


def config_keys() -> list[str]:
    """Every key ``wrap_model``, a config file and the CLI accept."""
    return [f.name for section in _SECTIONS.values() for f in fields(section)]


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file into a flat dict (not validated yet)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist.")
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import yaml

        data = yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of keys to values, got {type(data).__name__}.")
    return data


def resolve_config(config: "Config | Mapping[str, Any] | str | Path | None" = None, **overrides: Any) -> Config:
    """Merge a base config (Config, flat dict, or YAML/JSON path) with keyword overrides and validate.

    Args:
        config: the base; None means all defaults.
        **overrides: flat keys (``strategy="fsdp1"``, ``param_dtype="bf16"``); they win over ``config``.

    Returns:
        A validated :class:`Config`.
    """
    source = "wrap_model options"
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, Config):
        base = config.to_dict()
    elif isinstance(config, (str, Path)):
        base = load_config_file(config)
        source = str(config)
    elif isinstance(config, Mapping):
        base = dict(config)
    else:
        raise TypeError(f"config must be a Config, a dict or a path to a YAML/JSON file, got {type(config).__name__}.")
    base_cfg = Config.from_dict(base, source=source)
    merged = {**base_cfg.to_dict(), **overrides}
    return Config.from_dict(merged, source="wrap_model options")
