"""Machinery for fp8dist's config dataclasses: each field checked against its type, the docstring under each field,
flat keys routed to their dataclass, and ``argparse`` flags. The dataclasses hold every default."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["Choices", "choices_of", "type_hints", "flat_fields", "normalize_fields", "normalize_value", "field_docs",
           "route_keys", "add_arguments", "cli_flag", "choice_error", "BOOL_WORDS"]


class Choices:
    """``Annotated[str, Choices(registry)]``: a Literal whose values are ``source``'s names when read."""

    def __init__(self, source: Iterable[Any]) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Any]:
        return iter(tuple(self.source))


def choices_of(hint: Any) -> tuple[Any, ...] | None:
    """The closed set of values a type hint allows (a Literal's, a :class:`Choices`'), else None."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return typing.get_args(hint)
    if origin is typing.Annotated:
        return next((tuple(m) for m in hint.__metadata__ if isinstance(m, Choices)), None)
    return None


def type_hints(cls: Any) -> dict[str, Any]:
    """The fields' hints of dataclass ``cls``, :class:`Choices` kept."""
    return typing.get_type_hints(cls, include_extras=True)


def flat_fields(cls: type) -> list[tuple[type, dataclasses.Field]]:
    """``(owner, field)`` for each option of ``cls``; a field with ``nested`` metadata (a callable giving classes:
    FP8Config's backends' knobs, asked each time) stands for their fields, each a flat key."""
    out = []
    for f in dataclasses.fields(cls):
        nested = f.metadata.get("nested")
        out += [pair for sub in nested() for pair in flat_fields(sub)] if nested else [(cls, f)]
    return out


def choice_error(name: str, value: Any, choices: Iterable[Any], way_out: str = "",
                 or_none: str | None = None) -> ValueError:
    """A ValueError naming the field, the bad value, the valid choices and a close match. ``or_none``: None is a
    choice too (the text says what it means; "" says nothing more)."""
    choices = list(choices)
    none = "" if or_none is None else f", or none{f' ({or_none})' if or_none else ''}"
    msg = f"{name}={value!r} is not valid; choose one of: {', '.join(repr(c) for c in choices)}{none}."
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    if close and close[0] != str(value):
        msg += f" Did you mean {close[0]!r}?"
    if way_out:
        msg += f" {way_out}"
    return ValueError(msg)


BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}
"""What a boolean option accepts as text (case-insensitive)."""


def _describe_type(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        item = "names" if args[0] is str else "booleans" if args[0] is bool else "values"
        return f"a list of {len(args)} {item}" if Ellipsis not in args else f"a list of {item}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _normalize_tuple(name: str, value: Any, args: tuple) -> tuple:
    variadic = len(args) == 2 and args[1] is Ellipsis
    if isinstance(value, str) and variadic and args[0] is str:
        value = (value,)  # one pattern / class name for a list of them
    if not isinstance(value, (list, tuple)):
        example = "['lm_head', '*.mlp.*']" if args[0] is str else "[false, false, true]"
        raise ValueError(f"{name}={value!r} must be {_describe_type(tuple[args])} (e.g. {example}), "
                         f"not {type(value).__name__}.")
    if not variadic and len(value) != len(args):
        raise ValueError(f"{name}={value!r} must be {_describe_type(tuple[args])}, got {len(value)}.")
    return tuple(normalize_value(name, item, args[0] if variadic else arg)
                 for item, arg in zip(value, args if not variadic else [args[0]] * len(value)))


def _normalize_scalar(name: str, value: Any, hint: Any) -> Any:
    if hint is bool:
        if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
            return BOOL_WORDS[value.strip().lower()]
        if isinstance(value, int) and value in (0, 1):  # True and False among them
            return bool(value)
        raise ValueError(f"{name}={value!r} must be true or false (also yes/no, 1/0).")
    if hint in (int, float):
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = hint(value.strip())
        if isinstance(value, bool) or not isinstance(value, (int, float) if hint is float else int):
            raise ValueError(f"{name}={value!r} must be {_describe_type(hint)}.")
        return value
    if hint is str and not isinstance(value, str):
        raise ValueError(f"{name}={value!r} must be a string.")
    return value


def _normalize_choice(name: str, value: Any, choices: tuple, or_none: str | None = None) -> Any:
    if isinstance(value, str):  # case-insensitive; "3" for the integer choice 3, as the command line gives it
        for choice in choices:
            if isinstance(choice, str) and choice.lower() == value.strip().lower() or (
                    not isinstance(choice, str) and str(choice) == value.strip()):
                return choice
    elif value in choices and not isinstance(value, bool):
        return value
    raise choice_error(name, value, choices, or_none=or_none)


def normalize_value(name: str, value: Any, hint: Any, aliases: Mapping[str, str] | None = None,
                    none: str | None = None) -> Any:
    """``value`` of field ``name`` in its canonical form, or ValueError naming the field, the value and the choices;
    one for Python, files and flags. Choices match case-insensitively, ``aliases`` map other spellings
    ("bfloat16"), text parses as the type, "none" is None where allowed, a list is a tuple. ``hint``: the field's
    type annotation (a ``Literal``, an ``Annotated`` with :class:`Choices`, a union with None, a tuple, a scalar);
    ``none``: what None means, for the error."""
    if aliases is not None and value is not None and not isinstance(value, (bool, int, float, tuple, list)):
        value = aliases.get(str(value).lower(), value)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if type(None) in args and (value is None or isinstance(value, str) and value.strip().lower() == "none"):
            return None
        if type(None) in args and len(options) == 1 and choices_of(options[0]) is not None:
            return _normalize_choice(name, value, choices_of(options[0]), or_none=none or "")
        errors = []
        for option in options:
            try:
                return normalize_value(name, value, option)
            except ValueError as err:
                errors.append(err)
        if type(None) in args:  # say that None is a choice too, and what it means
            raise ValueError(f"{str(errors[0]).rstrip('.')}, or none{f' ({none})' if none else ''}.") from None
        raise errors[0]
    choices = choices_of(hint)
    if choices is not None:
        return _normalize_choice(name, value, choices)
    if origin is typing.Annotated:
        return normalize_value(name, value, args[0], aliases, none)
    if origin is tuple:
        return _normalize_tuple(name, value, args)
    return _normalize_scalar(name, value, hint)


def normalize_fields(obj: Any) -> None:
    """Normalize (:func:`normalize_value`) every field of the dataclass ``obj`` in place, frozen or not, and of the
    dataclasses a ``nested`` field holds; a config's ``__post_init__`` calls it. Metadata: ``aliases``, ``refused``
    (``{"E5M2": why}``), ``min`` (the least number).

    Raises:
        ValueError: a refused value (with why), a value :func:`normalize_value` refuses, or one below ``min``.
    """
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        refused = f.metadata.get("refused", {})
        low = f.metadata.get("min")
        if f.metadata.get("nested"):
            for sub in value:
                normalize_fields(sub)
            continue
        if isinstance(value, str) and value.upper() in refused:
            raise ValueError(f"{f.name}={value.upper()!r} is not supported: {refused[value.upper()]}")
        value = normalize_value(f.name, value, hints[f.name], f.metadata.get("aliases"), f.metadata.get("none"))
        if low is not None and value < low:
            raise ValueError(f"{f.name}={value} must be at least {low}.")
        object.__setattr__(obj, f.name, value)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls``; none without source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def route_keys(flat: Mapping[str, Any], classes: Iterable[type], *, source: str) -> dict[type, dict[str, Any]]:
    """One kwargs dict per dataclass in ``classes`` (field names unique across them); an unknown key raises
    ValueError listing the valid keys and naming ``source`` (``"wrap_model"``, a file name)."""
    classes = list(classes)
    owner = {f.name: cls for cls in classes for _, f in flat_fields(cls)}
    routed: dict[type, dict[str, Any]] = {cls: {} for cls in classes}
    for key, value in flat.items():
        if key not in owner:
            raise choice_error(f"option {key!r} in {source}", key, sorted(owner),
                               "Unknown keys are never ignored: remove it or fix its spelling.")
        routed[owner[key]][key] = value
    return routed


def _cli_type(name: str, hint: Any, aliases: Mapping[str, str] | None, none: str | None = None) -> Any:
    def parse(text: str) -> Any:
        try:
            return normalize_value(name, text, hint, aliases, none)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = name  # argparse names the type in some messages
    return parse


def _flag_kwargs(name: str, hint: Any, aliases: Mapping[str, str] | None, none: str | None = None) -> dict[str, Any]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    inner = next((a for a in args if a is not type(None)), hint) if optional else hint
    inner_origin, inner_args = typing.get_origin(inner), typing.get_args(inner)
    if inner is bool:
        words = "/".join(BOOL_WORDS) + ("/none" if optional else "")
        return {"nargs": "?", "const": True, "type": _cli_type(name, hint, aliases, none), "metavar": f"{{{words}}}"}
    if inner_origin is tuple:
        item = inner_args[0]
        count = "+" if Ellipsis in inner_args else len(inner_args)
        metavar = "{" + "/".join(BOOL_WORDS) + "}" if item is bool else "NAME"
        return {"nargs": count, "type": _cli_type(name, item, aliases), "metavar": metavar}
    if choices_of(inner) is not None:
        choices = [str(a) for a in choices_of(inner)] + (["none"] if optional else [])
        return {"type": _cli_type(name, hint, aliases), "metavar": "{" + ",".join(choices) + "}"}
    return {"type": _cli_type(name, hint, aliases), "metavar": {int: "N", float: "X"}.get(inner, "VALUE")}


def cli_flag(name: str) -> str:
    """The flag of field ``name``: ``data_cache`` -> ``--data-cache``."""
    return f"--{name.replace('_', '-')}"


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, title: str | None = None,
                  skip: Iterable[str] = (), shown_defaults: Mapping[str, str] | None = None) -> None:
    """One ``--flag`` per field of ``cls``, help and default from the dataclass, parsed by :func:`normalize_value`; a
    boolean also takes ``--flag`` and ``--no-flag``, ``cli_aliases`` metadata adds spellings. An absent flag is
    absent from the namespace (a file can sit under it). ``shown_defaults``: a command's own defaults."""
    group = parser.add_argument_group(title or cls.__name__)
    skip = set(skip)
    for owner, f in flat_fields(cls):
        if f.name in skip:
            continue
        hint, docs = type_hints(owner)[f.name], field_docs(owner)
        kwargs = _flag_kwargs(f.name, hint, f.metadata.get("aliases"), f.metadata.get("none"))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        shown = (shown_defaults or {}).get(f.name, "none" if default is None else default)
        text = f"{docs.get(f.name, '')} (default: {shown})".replace("%", "%%")  # argparse formats help with %
        flag = cli_flag(f.name)
        group.add_argument(flag, *f.metadata.get("cli_aliases", ()), dest=f.name, default=argparse.SUPPRESS,
                           help=text, **kwargs)
        if kwargs.get("const") is True:  # a boolean: --flag, --flag VALUE, --no-flag
            group.add_argument(f"--no-{flag[2:]}", dest=f.name, action="store_const", const=False,
                               default=argparse.SUPPRESS, help=f"the same as {flag} false")
