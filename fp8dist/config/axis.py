"""What the three axes (strategy, FP8 backend, memory level) share: a strategy's facts, a rule of the combination
table, when an option is read, and each axis's registry."""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["StrategyFacts", "Rule", "When", "ALWAYS", "Registry", "STRATEGIES", "BACKENDS", "LEVELS",
           "engine_packages"]


@dataclass(frozen=True)
class StrategyFacts:
    """How a strategy holds, computes and updates parameters: all FP8 backends and memory levels learn of it (never
    its name), so a rule written against a fact holds for any strategy that has it. The plan records them."""

    dtensor_shards: bool = False
    """Each parameter is a DTensor sharded on dim 0 and all-gathered per unit (FSDP2): the engine calls a tensor
    subclass's all-gather hooks (FP8 all-gather) and shards 3-D expert weights on the expert dim."""
    flat_params: bool = False
    """Parameters are flattened into one FlatParameter per unit (FSDP1): a tensor-subclass weight does not survive."""
    engine_owns_params: bool = False
    """The engine replaces and casts parameters itself (DeepSpeed ZeRO): tensor-subclass weights cannot go in."""
    engine_builds_optimizer: bool = False
    """The engine builds the optimizer from a spec, steps, accumulates and clips itself (DeepSpeed)."""
    autocast_forward: bool = False
    """The forward runs under ``torch.autocast`` to the compute dtype, parameters fp32 (DDP, one process)."""
    broadcasts_weights: bool = False
    """The engine copies rank 0's weights to every rank (DDP, DeepSpeed without ``zero.Init``)."""
    casts_gradients: bool = False
    """The engine casts gradients to ``reduce_dtype`` for their reduction on any device (FSDP); else a non-fp32
    reduce needs a communication hook."""
    shard_degree: int | None = None
    """Ranks each parameter is split over (1: replicated); None: not known."""
    world_size: int | None = None
    """Ranks of the run, set by the table when the caller gives them; None: not known."""

    @property
    def shards_params(self) -> bool:
        """An FSDP engine holds a part of each parameter on each rank (not ZeRO's own partitions)."""
        return self.dtensor_shards or self.flat_params


@dataclass(frozen=True)
class Rule:
    """One row of the combination table: option values that cannot run together, owned by the axis that imposes it."""

    keys: tuple[str, ...]
    """The options involved, in the order the message names them (``fp8='msamp' with strategy='fsdp': ...``)."""
    applies: Callable[[Any, StrategyFacts], bool]
    """``(config, facts of its strategy) -> bool``: True where the combination cannot run."""
    reason: str
    """Why not: the engines' behaviour, not a restatement of the rule."""
    way_out: str = ""
    """What to do instead; empty: the values of each key that combine with the rest (:func:`.rules.alternatives`)."""


@dataclass(frozen=True)
class When:
    """An axis reads an option only when every named option has one of the given values and every named
    :class:`StrategyFacts` field is true (TE reads ``margin`` only with ``te_recipe='delayed'``)."""

    options: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    """Option name -> the values under which it is read (``{"te_recipe": ("delayed",)}``)."""
    facts: tuple[str, ...] = ()
    """:class:`StrategyFacts` fields that must be true."""

    def holds(self, cfg: Any, facts: StrategyFacts) -> bool:
        """Whether this condition holds for ``cfg``: every option it names has one of its values and every strategy
        fact it names is true in ``facts``."""
        def value(key: str) -> Any:  # a knob of a strategy or a backend too (each section reads them flat)
            return getattr(cfg.parallel, key) if hasattr(cfg.parallel, key) else getattr(cfg.precision, key)

        return all(value(k) in v for k, v in self.options.items()) and all(getattr(facts, f) for f in self.facts)


ALWAYS = When()
"""The condition of an option read whenever its axis value is chosen (no option or strategy fact narrows it)."""


class Registry(Mapping[str, Any]):
    """The values of one axis by the name its option takes (``strategy="fsdp"``): the one list every tool reads and
    a new value registers in. A built-in may be registered as its module, imported when first asked for: its name
    (the option's choices) is known before its engine is imported.

    The installed values come through the entry-point group :attr:`group` (``fp8dist.strategies``,
    ``fp8dist.fp8_backends``, ``fp8dist.memory_levels``), loaded when the registry is first read: each entry point
    names a function, called with no arguments, that registers its package's values (fp8dist's built-ins:
    ``fp8dist.fp8:register_builtins``; another package's calls ``fp8dist.fp8.register_backend(MyBackend())``). A
    package adds its own with one line in its ``pyproject.toml``:
    ``[project.entry-points."fp8dist.fp8_backends"] my_pkg = "my_pkg.fp8:register"``.
    """

    def __init__(self, option: str, kind: str, group: str | None = None, reserved: tuple[str, ...] = ()) -> None:
        """``option``: the option whose values these are; ``kind``: what a value is called in messages; ``group``: the
        entry-point group the installed values come through (None: only what is registered on it);
        ``reserved``: names no value may take (``"none"``)."""
        self.option = option
        self.kind = kind
        self.group = group
        self.reserved = reserved
        self._values: dict[str, Any] = {}  # a value, or (module, attribute) of a built-in not imported yet
        self._known: dict[str, dict[str, Any]] = {}
        self._loaded = False

    def _with_builtins(self) -> dict[str, Any]:
        if not self._loaded and self.group is not None:
            self._loaded = True  # before loading: the built-ins' registration reads the registry
            self._load_entry_points()
        return self._values

    def _load_entry_points(self) -> None:
        points = importlib.metadata.entry_points(group=self.group)
        ours = [point for point in points if point.module.partition(".")[0] == "fp8dist"]
        if not ours:
            self._loaded = False
            raise RuntimeError(f"fp8dist's built-in {self.kind}s are registered through its package metadata (entry "
                               f"point group {self.group!r}), which this Python does not see: fp8dist is imported "
                               "from a folder that is not installed. Install it: pip install -e <the fp8dist "
                               "checkout> (or pip install fp8dist).")
        for point in [*ours, *(point for point in points if point not in ours)]:  # the built-ins first
            register = point.load()
            if not callable(register) or isinstance(register, type):
                raise TypeError(f"entry point {point.name} = {point.value!r} (group {self.group!r}): name a function "
                                f"that registers its {self.kind}s, e.g. one calling fp8dist's register_* function.")
            register()

    def register(self, value: Any, base: type) -> Any:
        """Add ``value``, an instance of a subclass of ``base``, under its ``name``; returns it. Call it at import
        time of the package defining the value, before any config names it (the public ``register_*`` functions
        call it).

        Raises:
            TypeError: ``value`` is a class, or not an instance of a ``base`` subclass.
            ValueError: its ``name`` is empty, padded with spaces, reserved (``fp8="none"``), or another value's.
        """
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
        if name in self._with_builtins() and self._values[name] is not value:
            raise ValueError(f"register: {self.option}={name!r} is already a {self.kind} "
                             f"({type(self[name]).__qualname__}); give {type(value).__qualname__} another name.")
        self._values[name] = value
        return value

    def register_module(self, name: str, module: str, attribute: str = "BACKEND", **known: Any) -> None:
        """A built-in value: ``module``'s ``attribute``, imported when ``name`` is first asked for. ``known``: its
        attributes :meth:`attribute` answers without importing it (a backend's ``Config``, the facts ``fp8dist
        bench``'s flags read), checked on import: each must equal the value's own."""
        if name not in self._values:
            self._values[name] = (module, attribute)
            self._known[name] = known

    def __getitem__(self, name: str) -> Any:
        value = self._with_builtins()[name]
        if isinstance(value, tuple):
            module, attribute = value
            value = getattr(importlib.import_module(module), attribute)
            wrong = [key for key, known in self._known.pop(name, {}).items() if getattr(value, key, None) != known]
            if value.name != name or wrong:
                raise TypeError(f"{module}.{attribute}: registered as {self.option}={name!r} with "
                                f"{', '.join(wrong) or 'its name'} other than its own; register it with its own.")
            self._values[name] = value
        return value

    def attribute(self, name: str, key: str) -> Any:
        """``self[name].<key>``; a built-in not imported yet answers what it registered, without being imported."""
        known = self._known.get(name, {}) if name in self._with_builtins() else {}
        return known[key] if key in known else getattr(self[name], key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._with_builtins())

    def __len__(self) -> int:
        return len(self._with_builtins())

    def names(self) -> tuple[str, ...]:
        """In registration order (the built-ins first)."""
        return tuple(self._with_builtins())


STRATEGIES = Registry("strategy", "sharding strategy", "fp8dist.strategies")
"""Every sharding strategy by its ``strategy=`` name (read it through ``fp8dist.strategies.get_strategy``; add one
with ``register_strategy``)."""
BACKENDS = Registry("fp8", "FP8 backend", "fp8dist.fp8_backends", reserved=("none",))
"""Every FP8 backend by its ``fp8=`` name; "none" is reserved for no FP8, which is not in it (read a backend through
``fp8dist.fp8.get_backend``, which maps None and "none" to no FP8; add one with ``register_backend``)."""
LEVELS = Registry("memory", "memory level", "fp8dist.memory_levels")
"""Every memory level by its ``memory=`` name (read through ``fp8dist.memory_levels.get_level``; add one with
``register_level``)."""


def engine_packages() -> tuple[str, ...]:
    """torch, transformers and every registered strategy's and FP8 backend's ``package``, each once."""
    engines = (value.package for registry in (STRATEGIES, BACKENDS) for value in registry.values())
    return tuple(dict.fromkeys(("torch", "transformers", *(p for p in engines if p))))
