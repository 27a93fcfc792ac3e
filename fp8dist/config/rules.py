"""The one table of what combines, read from the axes' ``rules`` and the options each axis alone reads (``options``,
a backend's ``Config``). Every Config is checked once when built; a refusal names the values as given and the way
out, derived from the table where its rule gives none."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Collection, Iterator
from types import SimpleNamespace
from typing import Any

from .axis import ALWAYS, BACKENDS, LEVELS, STRATEGIES, Rule, StrategyFacts, When
from .schema import choices_of, flat_fields, route_keys, type_hints
from .options import SECTIONS, knob_configs

__all__ = ["table", "refusal_of", "check", "refusing_rule", "unread_options", "facts_of",
           "choices", "EVERY_RUN", "EVERY_FP8_BACKEND"]

PIPELINE_STEPS = {
    "block_classes": (When({"activation_checkpointing": ("full", "selective")}), When({"compile": (True,)})),
    "max_skipped_steps": (When({"nonfinite_step": ("skip",)}),),
}
"""Options a step of the pipeline reads, and when: the block step, the guard of non-finite steps."""
EVERY_FP8_BACKEND = ("on_unsupported", "fp8_exclude", "keep_last_blocks_share")
"""The FP8 options every FP8 backend reads (its hardware gate, the layers kept out, the tail kept out) and no run
without one does."""
EVERY_RUN = ("strategy", "fp8", "memory", "param_dtype", "buffer_dtype", "activation_checkpointing", "compile",
             "device", "check_ranks", "nonfinite_step", "pretrained")
"""The options every run reads, whatever its axes. Every other option has its readers above, in an axis's
``options`` or in a backend's ``Config``: none is taken as read for want of a reader."""
_AXES = (("strategy", STRATEGIES), ("fp8", BACKENDS), ("memory", LEVELS))


def facts_of(cfg: Any, world_size: int | None = None) -> StrategyFacts:
    """The strategy facts of ``cfg``'s strategy under ``cfg`` (``world_size``: the ranks it runs on, None: unknown),
    as the combination table's conditions read them."""
    return STRATEGIES[cfg.parallel.strategy].facts(cfg, world_size)


def _axes(cfg: Any) -> Iterator[tuple[str, Any]]:
    yield "strategy", STRATEGIES[cfg.parallel.strategy]
    if cfg.precision.fp8 is not None:
        yield "fp8", BACKENDS[cfg.precision.fp8]
    yield "memory", LEVELS[cfg.parallel.memory]


def table() -> list[tuple[str, Rule]]:
    """Every rule of every axis value, each with its owner (``"fp8='msamp'"``)."""
    return [(f"{key}={name!r}", rule) for key, values in _AXES for name, axis in values.items() for rule in axis.rules]


def _values(cfg: Any, section: str | None = None) -> dict[str, Any]:
    return {f.name: getattr(getattr(cfg, name), f.name) for name, cls in SECTIONS.items()
            if section in (None, name) for _, f in flat_fields(cls)}


def _applying(cfg: Any, world_size: int | None = None) -> list[Rule]:
    facts = dataclasses.replace(facts_of(cfg, world_size), world_size=world_size)
    return [rule for _, axis in _axes(cfg) for rule in axis.rules if rule.applies(cfg, facts)]


def choices(key: str) -> tuple[Any, ...]:
    """The values option ``key`` takes when they are a closed set (a Literal, a boolean; None left out); else ()."""
    hint = next((type_hints(owner)[key] for section in SECTIONS.values() for owner, f in flat_fields(section)
                 if f.name == key), None)
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    values = [value for arg in args for value in choices_of(arg) or ((True, False) if arg is bool else ())]
    return tuple(dict.fromkeys(values))


def _with(cfg: Any, **changes: Any) -> Any:
    """``cfg`` with options changed, unchecked: a stand-in the rules read, knobs flat."""
    return SimpleNamespace(**{name: SimpleNamespace(**{k: changes.get(k, v) for k, v in _values(cfg, name).items()})
                              for name in SECTIONS})


def alternatives(cfg: Any, rule: Rule, defaulted: Collection[str] = ()) -> str:
    """The way out of ``rule``'s refusal of ``cfg``, as a sentence: for each option of the rule, the values that
    combine with the rest as given (by the whole table); "" where none does. ``defaulted``: options the user did not
    set, said as "the default ..."."""
    given = _values(cfg)
    parts = []
    for key in rule.keys:
        ok = [v for v in choices(key) if v != given[key] and v is not None and not _applying(_with(cfg, **{key: v}))]
        if ok:
            others = " and ".join(f"{'the default ' if k in defaulted else ''}{k}={given[k]!r}"
                                  for k in rule.keys if k != key)
            shown = ", ".join(repr(v) for v in ok[:-1]) + (" or " if len(ok) > 1 else "") + repr(ok[-1])
            parts.append(f"with {others} use {key}={shown}")
    return ("; ".join(parts)[:1].upper() + "; ".join(parts)[1:] + ".") if parts else ""


def message(cfg: Any, rule: Rule, defaulted: Collection[str] = (), run: dict[str, tuple[str, Any]] | None = None) \
        -> str:
    """The refusal of ``rule`` for ``cfg``: the values as given (``defaulted`` ones named as the default), why, and
    the way out. ``run``: values beyond the config, ``{key: (the caller's name for it, value)}``."""
    given = {**{k: (k, v) for k, v in _values(cfg).items()}, **(run or {})}
    first, *rest = (f"{'the default ' if key in defaulted else ''}{given[key][0]}={given[key][1]!r}"
                    for key in rule.keys)
    head = f"{first} with {' and '.join(rest)}" if rest else first
    way_out = rule.way_out or alternatives(cfg, rule, defaulted)
    return f"{head}: {rule.reason}." + (f" {way_out}" if way_out else "")


def _refusal(cfg: Any, defaulted: Collection[str], world_size: int | None, world_name: str) -> str | None:
    rule = next(iter(_applying(cfg, world_size)), None)
    return None if rule is None else message(cfg, rule, defaulted, {"world_size": (world_name, world_size)})


def refusal_of(**options: Any) -> str | None:
    """The first refusal of the config ``options`` make (None: they combine); a bad value raises ValueError."""
    routed = route_keys(options, SECTIONS.values(), source="options")
    sections = {name: section(**routed[section]) for name, section in SECTIONS.items()}
    return _refusal(SimpleNamespace(**sections), (), None, "world_size")


def check(cfg: Any, defaulted: Collection[str] = (), *, world_size: int | None = None,
          world_name: str = "world_size") -> None:
    """Raise ValueError with the first refusal of the table for ``cfg``; options in ``defaulted`` were not given,
    ``world_size`` (None: not known) is named ``world_name`` in the message (``fp8dist train``: ``nproc``)."""
    found = _refusal(cfg, defaulted, world_size, world_name)
    if found is not None:
        raise ValueError(found)


def refusing_rule(cfg: Any, **changes: Any) -> Rule | None:
    """The first rule ``cfg`` would break with ``changes`` (``compile=True``), or None."""
    return next(iter(_applying(_with(cfg, **changes))), None)


def _readers() -> dict[str, list[tuple[str, str, When]]]:
    """``{option: [(axis option, axis value, When)]}``; ``("", "")`` for a pipeline step."""
    found = [(f.name, "fp8", name, f.metadata.get("when", ALWAYS))
             for name, cls in knob_configs().items() for f in dataclasses.fields(cls)]
    found += [(option, key, name, when) for key, values in _AXES for name, axis in values.items()
              for option, when in axis.options.items()]
    found += [(option, "", "", when) for option, whens in PIPELINE_STEPS.items() for when in whens]
    found += [(option, "fp8", name, ALWAYS) for option in EVERY_FP8_BACKEND for name in BACKENDS]
    readers: dict[str, list[tuple[str, str, When]]] = {}
    for option, key, name, when in found:
        readers.setdefault(option, []).append((key, name, when))
    return readers


def _conditions(readers: list[tuple[str, str, When]]) -> list[list[tuple[str, list[Any]]]]:
    """Each condition under which an option is read, as ``[(option, values)]``, readers with the same one merged:
    ``[[("fp8", ["te"]), ("te_recipe", ["delayed"])]]``; a strategy fact as the strategies that have it."""
    grouped: dict[tuple[str, str], tuple[list[str], When]] = {}
    for key, name, when in readers:
        grouped.setdefault((key, repr(when)), ([], when))[0].append(name)
    conditions = []
    for (key, _), (names, when) in grouped.items():
        condition = [(key, names)] if key else []
        condition += [(k, list(v)) for k, v in when.options.items()]
        if when.facts:
            condition.append(("strategy", _strategies_with(when.facts)))
        conditions.append(condition)
    return conditions


def _strategies_with(facts: tuple[str, ...]) -> list[str]:
    """The registered strategies whose :class:`StrategyFacts` has every field in ``facts`` true."""
    return [name for name, strategy in STRATEGIES.items() if all(getattr(strategy.facts(None), f) for f in facts)]


def unread_options(cfg: Any) -> dict[str, str]:
    """``{option: note}`` for each option set away from its default that no chosen axis reads under ``cfg``."""
    values = _values(cfg)
    facts = facts_of(cfg)
    flat = _with(cfg)
    defaults = _values(SimpleNamespace(**{name: section() for name, section in SECTIONS.items()}))
    chosen = {(key, values[key]) for key, _ in _axes(cfg)} | {("", "")}
    notes = {}
    for option, who in _readers().items():
        if values[option] == defaults[option] or any((key, name) in chosen and when.holds(flat, facts)
                                                     for key, name, when in who):
            continue
        value = list(values[option]) if isinstance(values[option], tuple) else values[option]
        conditions = _conditions(who)
        needs = " or ".join(" and ".join(f"{k} in {v}" for k, v in condition) for condition in conditions)
        given = ", ".join(f"{k}={values[k]!r}" for k in dict.fromkeys(k for c in conditions for k, _ in c))
        notes[option] = f"{option}={value!r} has no effect here (read only when {needs}; {given})."
    return notes
