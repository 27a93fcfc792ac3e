"""The one config: the sections of :mod:`fp8dist.options` (where every default is written, once) combined, checked
together, and read from Python keywords, files and flags.

Python keyword options (``wrap_model(m, strategy="fsdp", reduce_dtype="bf16")``), a YAML/JSON file and the
``fp8dist`` CLI flags all land in these dataclasses. Every key is a field name; a bad value raises ValueError
naming the field, the value and the choices.

Example::

    cfg = resolve_config("fp8dist.yaml", strategy="fsdp1")     # file, then keyword overrides
    cfg.parallel.param_dtype                                    # 'bf16'
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ._schema import route_keys
from .accelerate_config import translate_accelerate_config
from .dtypes import torch_dtype
from .lean import lean_refusal
from .options import SECTIONS, FP8Config, StrategyConfig

__all__ = [
    "StrategyConfig",
    "FP8Config",
    "Config",
    "resolve_config",
    "load_config_file",
    "torch_dtype",
]

_SECTIONS = SECTIONS


def _check_combination(parallel: StrategyConfig, precision: FP8Config) -> None:
    """Cross-section rules: combinations no engine supports are errors naming what works instead."""
    strategy, fp8 = parallel.strategy, precision.fp8
    if parallel.param_dtype == "fp16" and strategy != "deepspeed":
        raise ValueError(f"param_dtype='fp16' with strategy={strategy!r}: fp16 compute needs loss scaling, which "
                         "fp8dist does not add to your training loop, and without it small gradients underflow to "
                         "zero silently. Use param_dtype='bf16' (no scaling needed; every FP8 GPU has it), or "
                         "strategy='deepspeed', whose fp16 mode scales the loss dynamically.")
    lean = lean_refusal(parallel, precision)
    if lean:
        raise ValueError(lean)
    if fp8 == "msamp" and strategy in ("fsdp", "fsdp1"):
        raise ValueError(f"fp8='msamp' with strategy={strategy!r}: MS-AMP has no FSDP integration here. Use "
                         "strategy='ddp' or 'none' with MS-AMP, 'deepspeed' for MS-AMP with ZeRO, or "
                         "fp8='torchao' / 'te' with FSDP.")
    if parallel.offload_param and parallel.zero_stage != 3 and strategy == "deepspeed":
        raise ValueError(f"offload_param=True with zero_stage={parallel.zero_stage}: only ZeRO-3 partitions "
                         "parameters. Use zero_stage=3 or offload_optimizer=True.")
    if fp8 == "msamp" and precision.opt_level == "O3" and strategy != "deepspeed":
        raise ValueError(f"opt_level='O3' with strategy={strategy!r}: MS-AMP O3 is its ZeRO optimizer and runs only "
                         "under strategy='deepspeed'. Use opt_level='O1' or 'O2'.")
    if (fp8 == "torchao" and precision.torchao_recipe == "rowwise_with_gw_hp" and strategy in ("none", "ddp")
            and parallel.param_dtype != "fp32"):
        raise ValueError(f"torchao_recipe='rowwise_with_gw_hp' with strategy={strategy!r} and param_dtype="
                         f"{parallel.param_dtype!r}: its high-precision weight-gradient GEMM mixes the autocast dtype "
                         "with fp32 and fails (torchao 0.18). Use strategy='fsdp' or 'fsdp1' (no autocast), "
                         "torchao_recipe='rowwise', or param_dtype='fp32'.")
    if precision.fp8_all_gather and precision.torchao_recipe != "tensorwise":
        raise ValueError(f"fp8_all_gather=True with torchao_recipe={precision.torchao_recipe!r}: torchao all-gathers "
                         "in FP8 only with the tensorwise recipe. Use torchao_recipe='tensorwise' or leave "
                         "fp8_all_gather unset.")


@dataclass(kw_only=True, frozen=True)
class Config:
    """Everything ``wrap_model`` needs, by concern. Keys are flat: each is a field of one section."""

    parallel: StrategyConfig = field(default_factory=StrategyConfig)
    """Strategy and its mixed precision."""

    precision: FP8Config = field(default_factory=FP8Config)
    """FP8 backend and its knobs."""

    def __post_init__(self) -> None:
        _check_combination(self.parallel, self.precision)

    def to_dict(self) -> dict[str, Any]:
        """Flat ``{key: value}`` dict, the same keys a YAML file and ``wrap_model`` take."""
        flat: dict[str, Any] = {}
        for name in _SECTIONS:
            flat.update(asdict(getattr(self, name)))
        return {k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()}

    def unused_options(self) -> list[str]:
        """Messages for options changed from their default that the chosen strategy / backend does not read."""
        values = self.to_dict()
        notes = []
        for section in _SECTIONS.values():
            for f in fields(section):
                only = f.metadata.get("only")
                any_of = f.metadata.get("only_any")
                default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                if not (only or any_of) or values[f.name] == (list(default) if isinstance(default, tuple) else default):
                    continue
                if only:
                    unmet = {k: v for k, v in only.items() if values[k] not in v}
                    if unmet:
                        needs = " and ".join(f"{k} in {list(v)}" for k, v in only.items())
                        notes.append(f"{f.name}={values[f.name]!r} has no effect here (read only when {needs}; "
                                     + ", ".join(f"{k}={values[k]!r}" for k in unmet) + ").")
                elif not any(all(values[k] in v for k, v in alt.items()) for alt in any_of):
                    needs = " or ".join(" and ".join(f"{k} in {list(v)}" for k, v in alt.items()) for alt in any_of)
                    keys = dict.fromkeys(k for alt in any_of for k in alt)
                    notes.append(f"{f.name}={values[f.name]!r} has no effect here (read only when {needs}; "
                                 + ", ".join(f"{k}={values[k]!r}" for k in keys) + ").")
        return notes

    @classmethod
    def from_dict(cls, flat: Mapping[str, Any], *, source: str = "config") -> "Config":
        """Build from flat keys; unknown keys and bad values raise ValueError."""
        routed = route_keys(flat, _SECTIONS.values(), source=source)
        return cls(**{name: section(**routed[section]) for name, section in _SECTIONS.items()})


def _read_config_text(path: Path) -> Any:
    """The file parsed as JSON (``.json``) or YAML, None when empty; a syntax error names the file, the line and
    the column."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    if not text.strip():
        return None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"config file {str(path)!r} is not valid JSON: line {err.lineno}, column {err.colno}: "
                             f"{err.msg}.") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark, context, start = (getattr(err, name, None) for name in ("problem_mark", "context", "context_mark"))
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())  # one line
        if context and start is not None:  # where the unfinished construct began ("while scanning a quoted scalar")
            problem += f" ({context} at line {start.line + 1}, column {start.column + 1})"
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {where}{problem}.") from None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file into a flat dict (not validated yet); the keys of a file written by
    ``accelerate config`` are translated (:mod:`fp8dist.accelerate_config`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is empty, not valid YAML/JSON (naming the line and column) or not a mapping, or an
            Accelerate key or value has no fp8dist equivalent.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist.")
    data = _read_config_text(path)
    if data is None:  # nothing, or only comments
        raise ValueError(f"config file {str(path)!r} is empty: write at least one key (e.g. strategy: fsdp), or "
                         "pass no config file.")
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of keys to values, got {type(data).__name__}.")
    return translate_accelerate_config(data, source=str(path))


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
        base = translate_accelerate_config(config)
    else:
        raise TypeError(f"config must be a Config, a dict or a path to a YAML/JSON file, got {type(config).__name__}.")
    base_cfg = Config.from_dict(base, source=source)
    merged = {**base_cfg.to_dict(), **overrides}
    return Config.from_dict(merged, source="wrap_model options")
