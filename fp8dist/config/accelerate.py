"""Files written by ``accelerate config``, read as fp8dist keys by the tables of :mod:`.accelerate_keys`: each key
becomes an option, nothing (fp8dist does it anyway), a line of a notice, or a ValueError naming the key, the value,
what fp8dist accepts and the way out. Targets are :mod:`.options` fields, checked there: no rule of its own."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .schema import BOOL_WORDS, choice_error, normalize_value
from .accelerate_keys import (_DS_FILE_DECIDES, _FP8, _FSDP, _HYBRID, _SECTIONS, _TOP, NO_ACCELERATE_KEY, _Mark,
                              _Refuse, _Rule, _schema, _Section, _to, targets)

__all__ = ["translate_accelerate_config", "NO_ACCELERATE_KEY", "targets"]


_YAML_BOOL_WORDS = {False: ("no", "off", "false", "n"), True: ("yes", "on", "true", "y")}
"""The words YAML 1.1 (PyYAML's safe_load, as Accelerate reads its files) turns into each boolean."""


@dataclass
class _State:
    flat: dict[str, Any]
    origin: dict[str, str] = field(default_factory=dict)  # fp8dist key -> the Accelerate key that set it
    seen: dict[str, Any] = field(default_factory=dict)  # "section.key" -> the table's value it matched
    launcher: list[str] = field(default_factory=list)  # "key=value" for the launcher notice
    model: list[str] = field(default_factory=list)  # lines of the notice about building the model
    data: Mapping[str, Any] = field(default_factory=dict)  # the file as given


def _normalized(key: str, value: Any, name: str | None = None) -> Any:
    by_key, hints, _ = _schema()
    return normalize_value(name or key, value, hints[key], by_key[key].metadata.get("aliases"))


def _unset(value: Any) -> bool:
    """Accelerate leaves out what is None or empty (``fsdp_config: {}``, ``main_process_ip: null``)."""
    return value is None or (isinstance(value, (str, list, tuple, dict)) and not value)


def _lookup(values: Mapping[Any, Any], value: Any) -> tuple[Any, Any]:
    """The entry for ``value``: text case-insensitively, booleans also as true/false/yes/no."""
    text = str(value).strip().lower() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    for key, result in values.items():
        if (value is key or BOOL_WORDS.get(text) is key) if isinstance(key, bool) else text == str(key).lower():
            return key, result
    if isinstance(value, bool):  # YAML 1.1 reads an unquoted NO/off/yes/on as a boolean: the word the file had
        for key, result in values.items():
            if not isinstance(key, bool) and str(key).lower() in _YAML_BOOL_WORDS[value]:
                return key, result
    raise KeyError(value)


def _match(where: str, rule: _Rule, value: Any) -> tuple[Any, Any]:
    """(the table's value, what it becomes)."""
    values = rule.values or {}
    accepted = [key for key, result in values.items() if not isinstance(result, _Refuse)]
    try:
        key, result = _lookup(values, value)
    except KeyError:
        if not rule.other:
            raise choice_error(where, value, accepted) from None
        key, result = value, _Refuse(rule.other)
    if isinstance(result, _Refuse):
        shown = f" Accepted here: {', '.join(repr(a) for a in accepted)}." if accepted else ""
        raise ValueError(f"{where}={value!r} has no fp8dist equivalent: {result}.{shown}")
    return key, result


def _set_once(state: _State, key: str, value: Any, where: str) -> None:
    """A different value set before (by the file's own key or another) is an error."""
    if key in state.flat:
        try:
            before = _normalized(key, state.flat[key])
        except ValueError:
            before = state.flat[key]  # reported with the file's own key when the config is built
        if before != value:
            said = f"{state.origin[key]} says" if key in state.origin else "the file also says"
            raise ValueError(f"{where} sets {key}={value!r} but {said} {key}={state.flat[key]!r}: keep one.")
    state.flat[key] = value
    state.origin[key] = where


def _apply(where: str, rule: _Rule, value: Any, state: _State, name: str) -> None:
    if rule.launcher:
        state.launcher.append(f"{where}={value!r}")
        return
    if rule.values is None and not rule.to:  # accepted as given: fp8dist derives it (the shard group size)
        state.seen[name] = value
        return
    if rule.values is None:
        matched = result = _normalized(rule.to[0], rule.convert(value) if rule.convert else value, where)
    else:
        matched, result = _match(where, rule, value)
    state.seen[name] = matched
    if rule.model and matched is True:
        state.model.append(rule.model)
    if result is _Mark.SAME:
        return
    for key, item in zip(rule.to, result if len(rule.to) > 1 else (result,)):
        if item is not _Mark.LEAVE:
            _set_once(state, key, item, where)


def _section_rule(block: str, section: _Section, key: str) -> tuple[str, _Rule]:
    for name in (key, section.prefix + key, key.removeprefix(section.prefix)):
        if name in section.rules:
            return name, section.rules[name]
    own = _schema()[2] if section.own_keys else ()
    if key in own:
        return key, _to(key)
    if section.rest is not None:
        return key, section.rest
    choices = [*section.rules, *(k for k in own if k not in section.rules)]
    close = difflib.get_close_matches(key, choices, n=1)
    raise ValueError(f"key {key!r} in {block} is not one fp8dist reads; choose one of: {', '.join(choices)}."
                     + (f" Did you mean {close[0]!r}?" if close else " Remove it."))


def _translate_block(block: str, value: Any, state: _State) -> None:
    section = _SECTIONS[block]
    if not isinstance(value, Mapping):
        raise ValueError(f"{block} must be a mapping of keys to values, got {value!r}.")
    given = state.seen.get("distributed_type", "none")
    if section.needs and given != section.needs:
        raise ValueError(f"{block} is read only with distributed_type: {section.needs} (this file: {given}). Set "
                         f"distributed_type: {section.needs}, or remove {block}.")
    for key, item in value.items():
        if not _unset(item):
            name, rule = _section_rule(block, section, str(key))
            _apply(f"{block}.{key}", rule, item, state, f"{block}.{name}")


def _check_foreign(key: str) -> None:
    """fp8dist's key passes; a block's key or a near miss of Accelerate's is an error."""
    if key in _schema()[0]:
        return
    for block, section in _SECTIONS.items():
        if key in section.rules:
            raise ValueError(f"{key!r} is a key of Accelerate's {block}: put it under {block}:.")
    close = difflib.get_close_matches(key, [*_TOP, *_SECTIONS], n=1, cutoff=0.8)
    if close:
        raise ValueError(f"option {key!r} is neither fp8dist's nor Accelerate's. Did you mean {close[0]!r}?")


def _hybrid(state: _State) -> None:
    """HYBRID_SHARD(_ZERO2) shards within a node, replicates across nodes: HSDP, replicate_degree = num_machines."""
    where = next((f"fsdp_config.{k}" for k in ("fsdp_sharding_strategy", "fsdp_reshard_after_forward")
                  if str(state.seen.get(f"fsdp_config.{k}", "")).startswith(_HYBRID)), None)
    if where is None:
        return
    nodes = state.data.get("num_machines", 1)
    if not isinstance(nodes, int) or nodes < 2:
        raise ValueError(f"{where}={state.seen[where]!r} replicates across "
                         f"nodes and shards within one, and num_machines is {nodes!r}: set num_machines to the nodes "
                         "of the job, or parallelism_config_dp_replicate_size, or use FULL_SHARD.")
    _set_once(state, "replicate_degree", nodes, f"{where} with num_machines: {nodes}")


def _finish(state: _State) -> None:
    """What depends on several keys."""
    if state.seen.get("distributed_type") == "FSDP" and "fsdp_config.fsdp_version" not in state.seen:
        _set_once(state, "strategy", _FSDP["fsdp_version"].values[1],  # type: ignore[index]
                  "distributed_type: FSDP without fsdp_config.fsdp_version (Accelerate's default is 1)")
    if state.seen.get("mixed_precision") == "fp8" and _normalized("fp8", state.flat.get("fp8")) is None:
        backends = ", ".join(_FP8["backend"].values or {})
        raise ValueError(f"mixed_precision: fp8 needs a backend: set fp8_config.backend to one of {backends} "
                         "(or fp8dist's key fp8).")
    given = {name.split(".", 1)[1]: v for name, v in state.seen.items() if name.startswith("deepspeed_config.")}
    clash = [key for key in _DS_FILE_DECIDES if key in given]
    if given.get("deepspeed_config_file") and clash:
        raise ValueError(f"deepspeed_config.{clash[0]}={given[clash[0]]!r} beside deepspeed_config_file: the DeepSpeed "
                         f"json decides it, as in Accelerate. Set it in {given['deepspeed_config_file']!r} and remove "
                         "it here.")
    stage = given.get("zero_stage", _schema()[0]["zero_stage"].default)
    if given.get("offload_param_device") == "cpu" and stage != 3:
        raise ValueError(f"deepspeed_config.offload_param_device='cpu' with zero_stage {stage}: only ZeRO-3 "
                         "partitions parameters. Use zero_stage: 3, or offload_param_device: none "
                         "(offload_optimizer_device: cpu offloads the optimizer states).")
    _hybrid(state)


def translate_accelerate_config(data: Mapping[str, Any], *, source: str = "config") -> dict[str, Any]:
    """fp8dist's flat keys (not validated yet) for a mapping that may hold Accelerate's keys; ``source`` names it in
    messages. The keys only the launcher reads are named in one UserWarning; a key or value with no fp8dist
    equivalent, or two keys setting one option differently, raise ValueError."""
    ours = [*_TOP, *_SECTIONS]  # this order: distributed_type before the blocks it gates
    state = _State(flat={k: v for k, v in data.items() if k not in ours}, data=data)
    try:
        for key in state.flat:
            _check_foreign(str(key))
        for key in (k for k in ours if k in data and not _unset(data[k])):
            if key in _SECTIONS:
                _translate_block(key, data[key], state)
            else:
                _apply(key, _TOP[key], data[key], state, key)
        _finish(state)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    if state.launcher:
        warnings.warn(f"{source}: Accelerate keys for the launcher, not read here: {', '.join(state.launcher)}. "
                      "fp8dist takes the processes from the launcher that starts them (torchrun, deepspeed, srun; "
                      "see launch/).", UserWarning, stacklevel=3)
    if state.model:
        warnings.warn(f"{source}: Accelerate keys about how the model is built, which fp8dist does from the model "
                      f"you pass: {'; '.join(state.model)}.", UserWarning, stacklevel=3)
    return state.flat
