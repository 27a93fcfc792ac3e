"""Sharding strategies, one module each implementing :class:`~fp8dist.strategies.base.Strategy`. Their ``apply_*``
functions take explicit dtypes and devices, not the whole config, so they can be used on their own. Importing this
package imports no engine: the built-ins' names are known before torch is imported."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config.axis import STRATEGIES
from ..config.lazy import lazy_names

if TYPE_CHECKING:
    from torch import nn

    from .base import Strategy

__all__ = ["STRATEGIES", "get_strategy", "register_strategy", "Strategy", "ShardJob", "Sharded", "ShardingInfo",
           "unwrap_model", "build_fsdp_policy", "build_fsdp1_policy", "find_blocks", "zero_config",
           "build_deepspeed_config", "is_deepspeed_engine", "apply_fsdp", "apply_fsdp1", "apply_ddp", "apply_single",
           "fsdp_mesh", "cast_buffers", "register_builtins"]


def register_builtins() -> None:
    """Register fp8dist's strategies in the order choices are listed in, each imported when first chosen, its
    bench_devices known before (the bench's flags) and checked against its own on import. :data:`STRATEGIES` calls it
    through the ``fp8dist.strategies`` entry point when first read. Each one's knobs (``Config``) are known
without importing it: the CLI's flags and the config's keys."""
    from .deepspeed_knobs import DeepSpeedConfig
    from .fsdp_knobs import FSDPConfig

    for name, module, devices, knobs in (("none", "single", (), None), ("ddp", "ddp", ("cpu", "cuda"), None),
                                         ("fsdp", "fsdp", ("cpu", "cuda"), FSDPConfig),
                                         ("fsdp1", "fsdp1", ("cpu",), FSDPConfig),
                                         ("deepspeed", "deepspeed", ("cpu",), DeepSpeedConfig)):
        STRATEGIES.register_module(name, f"{__name__}.{module}", "STRATEGY", bench_devices=devices, Config=knobs)


def _load() -> dict[str, Any]:
    """The engines' names (they import torch), imported when first read."""
    from .base import Sharded, ShardingInfo, ShardJob, Strategy
    from .common import cast_buffers, find_blocks
    from .ddp import apply_ddp
    from .deepspeed import build_deepspeed_config, is_deepspeed_engine, zero_config
    from .fsdp import apply_fsdp, build_fsdp_policy, fsdp_mesh
    from .fsdp1 import apply_fsdp1, build_fsdp1_policy
    from .single import apply_single

    return locals()


def register_strategy(strategy: Strategy) -> Strategy:
    """Make ``strategy`` (an instance of a :class:`Strategy` subclass) what ``strategy=<its name>`` selects, in
    ``wrap_model``, config files, the CLI's choices, the plan, the estimate and the bench; returns it. Its knobs
    (``Config``, a dataclass) become flat keys and flags; each must be named in its ``options`` (or in those of a
    strategy sharing the class), so that a knob set under another strategy is reported: else ValueError, and nothing
    is registered. Raises what the registry raises for a name taken or a value that is no Strategy."""
    import dataclasses

    from .base import Strategy

    knobs = getattr(strategy, "Config", None)
    if knobs is not None:
        if not (isinstance(knobs, type) and dataclasses.is_dataclass(knobs)):
            raise TypeError(f"register: {type(strategy).__qualname__}.Config={knobs!r} must be a dataclass of the "
                            "strategy's knobs (@dataclass(kw_only=True, frozen=True)), or None.")
        sharing = [strategy] + [STRATEGIES[name] for name in STRATEGIES
                                if name != strategy.name and STRATEGIES.attribute(name, "Config") is knobs]
        unread = [f.name for f in dataclasses.fields(knobs) if not any(f.name in s.options for s in sharing)]
        if unread:
            raise ValueError(f"register: {type(strategy).__qualname__}.Config's knob {unread[0]!r} is in none of its "
                             f"options: add {unread[0]!r}: ALWAYS (fp8dist.config.axis; or the When it is read "
                             "under) to its options, so that the knob set under another strategy is reported.")
    return STRATEGIES.register(strategy, Strategy)


def get_strategy(name: str) -> Strategy:
    """The strategy ``strategy=name`` selects (names are validated by the config)."""
    return STRATEGIES[name]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside what :func:`fp8dist.wrap_model` returned: the ``.module`` of DDP, FSDP1 and the
    DeepSpeed engine; the model itself under FSDP2 (sharded in place) and strategy "none"."""
    from .introspect import engine_of

    engine = engine_of(model)  # the wrappers' strategies answer their .module (fully_shard shards in place)
    return model if engine is None else STRATEGIES[engine].unwrap(model)


__getattr__ = lazy_names(globals(), _load)
