"""The one config: the sections of :mod:`fp8dist.config.options` combined, checked together, and read from Python
keywords, YAML/JSON files and the CLI's flags, every key a field name."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

from .rules import check as check_combination, unread_options
from .axis import STRATEGIES
from .schema import flat_fields, route_keys
from .accelerate import translate_accelerate_config
from .files import read_config_text
from .dtypes import torch_dtype
from .options import SECTIONS, FP8Config, StrategyConfig, knob_configs

__all__ = ["StrategyConfig", "FP8Config", "Config", "resolve_config", "load_config_file", "torch_dtype"]


@dataclass(kw_only=True, frozen=True)
class Config:
    """Everything ``wrap_model`` needs, by concern. Keys are flat: each a field of one section or a backend's knob."""

    parallel: StrategyConfig = field(default_factory=StrategyConfig)
    """The strategy and its mixed precision, the batch shape, blocks, guards: every option but FP8's."""
    precision: FP8Config = field(default_factory=FP8Config)
    """The FP8 backend, what every backend shares, and each backend's knobs."""

    def __post_init__(self) -> None:
        check_combination(self)  # the one table of what combines (.rules), before anything uses the config

    def to_dict(self) -> dict[str, Any]:
        """Flat ``{key: value}`` dict, the same keys a YAML file and ``wrap_model`` take (every backend's knobs)."""
        return {f.name: list(v) if isinstance(v := getattr(getattr(self, name), f.name), tuple) else v
                for name, cls in SECTIONS.items() for _, f in flat_fields(cls)}

    def unread_notes(self) -> list[str]:
        """A note for each option changed from its default that no chosen axis reads (wrap_model, the planner, the
        estimate and the probe each say them once as warnings; :func:`.rules.unread_options` keys them by option)."""
        return list(unread_options(self).values())

    @classmethod
    def from_dict(cls, flat: Mapping[str, Any], *, source: str = "config",
                  given: Collection[str] | None = None) -> "Config":
        """Build from flat keys; unknown keys and bad values raise ValueError. ``given``: the keys the user set
        (None: all of ``flat``); a refused combination names any other option in it as the default."""
        routed = route_keys(flat, SECTIONS.values(), source=source)
        sections = {name: section(**routed[section]) for name, section in SECTIONS.items()}
        if given is not None:
            names = {f.name for cls in SECTIONS.values() for _, f in flat_fields(cls)}
            check_combination(SimpleNamespace(**sections), defaulted=names - set(given))
        return cls(**sections)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file into a flat dict (not validated yet), the keys of a file written by
    ``accelerate config`` translated.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is empty, not valid YAML/JSON (naming the line and column), gives a key twice, is not
            a mapping, or an Accelerate key or value has no fp8dist equivalent.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist.")
    data = read_config_text(path)
    if data is None:  # nothing, or only comments
        raise ValueError(f"config file {str(path)!r} is empty: write at least one key (e.g. strategy: fsdp), or "
                         "pass no config file.")
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of keys to values, got {type(data).__name__}.")
    return translate_accelerate_config(_flat_knobs(data), source=str(path))


def _flat_knobs(data: Mapping[str, Any]) -> dict[str, Any]:
    """Each backend's and strategy's knobs nested under its name (``te: {te_recipe: current}``, ``deepspeed:
    {zero_stage: 3}``) made flat."""
    owners = {*knob_configs(), *(name for name in STRATEGIES if STRATEGIES.attribute(name, "Config") is not None)}
    nested = [k for k, v in data.items() if k in owners and isinstance(v, Mapping)]
    return {**{k: v for k, v in data.items() if k not in nested}, **{k: v for n in nested for k, v in data[n].items()}}


def resolve_config(config: "Config | Mapping[str, Any] | str | Path | None" = None, *,
                   defaults: Mapping[str, Any] | None = None, source: str = "wrap_model options",
                   **overrides: Any) -> Config:
    """The one path from Python keywords, a dict, a YAML/JSON file (fp8dist's keys or Accelerate's) and command-line
    flags to a validated :class:`Config`.

    Args:
        config: the base: a Config, a flat dict, or a YAML/JSON path; None means all defaults.
        defaults: values where neither ``config`` nor ``overrides`` gives the key (the CLI's ``fp8``).
        source: where a mapping ``config`` came from, for the error text (a path names itself).
        **overrides: flat keys (``strategy="fsdp1"``); they win over ``config``.

    Returns:
        The Config.

    Raises:
        ValueError: a bad key (with the closest known one), value or combination (naming the rule and the way out).
        TypeError: ``config`` is none of the kinds above.
        FileNotFoundError: ``config`` names a file that does not exist.

    Example::

        cfg = resolve_config("fp8dist.yaml", strategy="fsdp1")  # file, then keyword overrides
        cfg.parallel.param_dtype                                 # 'bf16'
    """
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, Config):
        base = config.to_dict()
    elif isinstance(config, (str, Path)):
        base = load_config_file(config)
        source = str(config)
    elif isinstance(config, Mapping):
        base = translate_accelerate_config(_flat_knobs(config), source=source)
    else:
        raise TypeError(f"config must be a Config, a dict or a path to a YAML/JSON file, got {type(config).__name__}.")
    return Config.from_dict({**(defaults or {}), **base, **overrides}, source=source, given={*base, *overrides})
