"""What the three axes of a run (strategy, FP8 backend, memory level) share, as data: the facts of a strategy, a
rule of the combination table, the condition under which an option is read, and each axis's registry."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StrategyFacts", "Rule", "When", "ALWAYS", "Registry", "STRATEGIES", "BACKENDS", "LEVELS",
           "engine_packages"]


@dataclass(frozen=True)
class StrategyFacts:
    """How a strategy holds, computes and updates parameters: the one thing FP8 backends and memory levels learn
    about it. They never see its name or its engine's classes, so a rule written against a fact ("torchao
    all-gathers in FP8 only where parameters are DTensor shards") holds for any strategy that has it. The plan
    records them (``plan.facts``): a backend's conversion and wiring read the facts the plan was made with."""

    dtensor_shards: bool = False
    """Each parameter is a DTensor sharded on dim 0 over a shard group and all-gathered per unit (FSDP2): the
    engine calls a tensor subclass's all-gather hooks (FP8 all-gather) and shards 3-D expert weights on the
    expert dim."""
    flat_params: bool = False
    """Parameters are flattened into one FlatParameter per unit (FSDP1): a tensor-subclass weight does not survive."""
    engine_owns_params: bool = False
    """The engine replaces and casts parameters itself during initialization (DeepSpeed ZeRO): tensor-subclass
    weights cannot be swapped in."""
    engine_builds_optimizer: bool = False
    """The engine builds the optimizer from a spec, steps, accumulates and clips itself (DeepSpeed)."""
    autocast_forward: bool = False
    """The forward runs under ``torch.autocast`` to the compute dtype while parameters stay fp32 (DDP, one
    process): GEMMs compute in the compute dtype, other ops in fp32."""
    broadcasts_weights: bool = False
    """The engine copies rank 0's weights to every rank when it wraps the model (DDP, DeepSpeed without
    ``zero.Init``): ranks may start from different weights."""
    casts_gradients: bool = False
    """The engine casts gradients to ``reduce_dtype`` for their reduction itself, on any device (FSDP's mixed
    precision); without it a non-fp32 reduce needs a communication hook."""
    shard_degree: int | None = None
    """Ranks each parameter is split over (1: replicated); None: not known (no world size given)."""
    world_size: int | None = None
    """Ranks of the run, set by the table when the caller gives them (:func:`fp8dist.config.rules.refusals`), for a
    rule on how many processes a strategy runs in; None: not known."""

    @property
    def shards_params(self) -> bool:
        """Each rank holds a part of each parameter in an FSDP engine (not the engine's own ZeRO partitions)."""
        return self.dtensor_shards or self.flat_params


@dataclass(frozen=True)
class Rule:
    """One row of the combination table: a combination of option values that cannot run, owned by the axis that
    imposes it. ``keys`` are the options involved: the error names their values as given
    (``fp8='msamp' with strategy='fsdp': ...``), and the way out, when not written here, is derived from the table
    itself (the values of each key that would combine with the others as given)."""

    keys: tuple[str, ...]
    """The options involved, in the order the message names them (the owning axis's own option among them)."""
    applies: Callable[[Any, StrategyFacts], bool]
    """``(config, facts of its strategy) -> bool``: True where the combination cannot run."""
    reason: str
    """Why not: the engines' behaviour, not a restatement of the rule."""
    way_out: str = ""
    """What to do instead; empty: derived from the table (:func:`fp8dist.config.rules.alternatives`)."""


@dataclass(frozen=True)
class When:
    """An axis reads an option of its own only when every named option has one of the given values and the
    strategy has every named fact (e.g. TE reads ``margin`` only with ``te_recipe='delayed'``; torchao reads
    ``fp8_all_gather`` only where parameters are DTensor shards)."""

    options: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    facts: tuple[str, ...] = ()
    """Names of :class:`StrategyFacts` fields that must be true."""

    def holds(self, cfg: Any, facts: StrategyFacts) -> bool:
        values = {**vars(cfg.parallel), **vars(cfg.precision)}
        return all(values[k] in v for k, v in self.options.items()) and all(getattr(facts, f) for f in self.facts)


ALWAYS = When()
"""Read whenever its axis is chosen."""


class Registry(Mapping[str, Any]):
    """The values of one axis by the name its option takes (``strategy="fsdp"``): the one list the config's choices,
    the CLI, the bench and every tool read, and where a new value registers (:meth:`register`). A built-in value
    may be registered as the module that holds it, imported when first asked for (an FP8 backend's module is
    imported only where that backend is chosen)."""

    def __init__(self, option: str, kind: str, reserved: tuple[str, ...] = ()) -> None:
        self.option, self.kind, self.reserved = option, kind, reserved
        self._values: dict[str, Any] = {}

    def register(self, value: Any, base: type) -> Any:
        """Add ``value``, an instance of a subclass of ``base``, under its ``name``; returns it. A name another
        value holds is refused, and so is a reserved word (``fp8="none"``: no backend)."""
        if isinstance(value, type) and base in value.__mro__:
            raise TypeError(f"register: pass an instance of {value.__qualname__} (its object: "
                            f"{value.__qualname__}()), not the class.")
        if base not in type(value).__mro__:  # the bases are Protocols: subclassing is the contract
            raise TypeError(f"register: {value!r} is not a {self.kind}: subclass fp8dist's {base.__qualname__} "
                            "and register an instance of it.")
        name = getattr(value, "name", None)
        if not isinstance(name, str) or not name.strip() or name != name.strip() or name.lower() in self.reserved:
            reserved = f", not {' or '.join(map(repr, self.reserved))}" if self.reserved else ""
            raise ValueError(f"register: {type(value).__qualname__}.name={name!r}: a {self.kind} needs a name, the "
                             f"value {self.option}= takes (a non-empty word without spaces around it{reserved}).")
        if name in self._values and self._values[name] is not value:
            raise ValueError(f"register: {self.option}={name!r} is already a {self.kind} "
                             f"({type(self[name]).__qualname__}); give {type(value).__qualname__} another name.")
        self._values[name] = value
        return value

    def register_module(self, name: str, module: str) -> None:
        """A built-in value: ``module``'s ``BACKEND``, imported when ``name`` is first asked for."""
        self._values.setdefault(name, module)

    def __getitem__(self, name: str) -> Any:
        value = self._values[name]
        if isinstance(value, str):
            value = self._values[name] = importlib.import_module(value).BACKEND
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def names(self) -> tuple[str, ...]:
        """The names, in registration order (the built-ins first)."""
        return tuple(self._values)


STRATEGIES = Registry("strategy", "sharding strategy")
"""Every sharding strategy by the name ``strategy=`` takes (the built-ins: :mod:`fp8dist.strategies`)."""
BACKENDS = Registry("fp8", "FP8 backend", reserved=("none",))
"""Every FP8 backend by the name ``fp8=`` takes (the built-ins: :mod:`fp8dist.fp8`)."""
LEVELS = Registry("memory", "memory level")
"""Every memory level by the name ``memory=`` takes (the built-ins: :mod:`fp8dist.memory_levels`)."""


def engine_packages() -> tuple[str, ...]:
    """The libraries a run may use, each once: torch, transformers and every registered strategy's and FP8
    backend's own (``package``) — what ``fp8dist env`` checks and bench results record."""
    engines = (value.package for registry in (STRATEGIES, BACKENDS) for value in registry.values())
    return tuple(dict.fromkeys(("torch", "transformers", *(p for p in engines if p))))
