"""Generic machinery for fp8dist's keyword-only config dataclasses.

One place turns a dataclass into: validation of every field against its type (``Literal`` choices, bool, int,
float, str, tuples), the docstring written under each field, a flat ``key -> section`` routing table, and
``argparse`` flags. The dataclasses in :mod:`fp8dist.config` and :mod:`fp8dist.train` hold the defaults; this
module never defines one.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["check_fields", "field_docs", "route_keys", "add_arguments", "choice_error"]


def choice_error(name: str, value: Any, choices: Iterable[Any], way_out: str = "") -> ValueError:
    """A ValueError naming the field, the bad value, the valid choices and (optionally) a close match."""
    choices = list(choices)
    msg = f"{name}={value!r} is not valid; choose one of: {', '.join(repr(c) for c in choices)}."
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    if close:
        msg += f" Did you mean {close[0]!r}?"
    if way_out:
        msg += f" {way_out}"
    return ValueError(msg)


def _check_value(name: str, value: Any, hint: Any) -> None:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        if value not in args:
            raise choice_error(name, value, args)
    elif origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        options = [a for a in args if a is not type(None)]
        first_error: ValueError | None = None
        for option in options:
            try:
                _check_value(name, value, option)
                return
            except ValueError as err:
                first_error = first_error or err
        assert first_error is not None
        raise first_error
    elif hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be true or false.")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r} must be an integer.")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}={value!r} must be a number.")
    elif hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{name}={value!r} must be a string.")
    elif origin is tuple:
        if not isinstance(value, tuple):
            raise ValueError(f"{name}={value!r} must be a tuple.")
        for item in value:
            _check_value(name, item, args[0])


def check_fields(obj: Any) -> None:
    """Validate every field of dataclass instance ``obj`` against its annotation.

    Raises:
        ValueError: naming the field, the value and, for ``Literal`` fields, the choices.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        _check_value(f.name, getattr(obj, f.name), hints[f.name])


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written right under each field of dataclass ``cls`` (torchtitan style)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def route_keys(flat: Mapping[str, Any], classes: Iterable[type], *, source: str) -> dict[type, dict[str, Any]]:
    """Split a flat ``{key: value}`` mapping into one kwargs dict per dataclass in ``classes``.

    Keys are field names, unique across ``classes``. An unknown key raises ValueError listing the valid keys.
    ``source`` says where the keys came from (``"wrap_model"``, a file name) for the error text.
    """
    classes = list(classes)
    owner = {f.name: cls for cls in classes for f in dataclasses.fields(cls)}
    routed: dict[type, dict[str, Any]] = {cls: {} for cls in classes}
    for key, value in flat.items():
        if key not in owner:
            raise choice_error(f"option {key!r} in {source}", key, sorted(owner),
                               "Unknown keys are never ignored: remove it or fix its spelling.")
        routed[owner[key]][key] = value
    return routed


def _flag_type(hint: Any) -> tuple[dict[str, Any], str]:
    """argparse kwargs and a metavar-ish description for a field annotation."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        kwargs, _ = _flag_type(options[0])
        if kwargs.get("choices") is not None and type(None) in args:
            kwargs["choices"] = ["none", *kwargs["choices"]]
        return kwargs, ""
    if origin is typing.Literal:
        return {"choices": [a for a in args if a is not None], "type": type(args[0])}, ""
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}, ""
    if origin is tuple:
        return {"nargs": "+", "type": args[0], "metavar": "NAME"}, ""
    return {"type": hint, "metavar": {int: "N", float: "X"}.get(hint, "VALUE")}, ""


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, title: str | None = None,
                  skip: Iterable[str] = (), shown_defaults: Mapping[str, str] | None = None) -> None:
    """Add one ``--flag`` per field of dataclass ``cls``; help text and default come from the dataclass.

    Flags default to "not given" (absent from the namespace), so a YAML file can sit under the command line.
    ``shown_defaults`` describes a command's own default where it differs from the dataclass's.
    """
    group = parser.add_argument_group(title or cls.__name__)
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    skip = set(skip)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kwargs, _ = _flag_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        shown = (shown_defaults or {}).get(f.name, "none" if default is None else default)
        text = f"{docs.get(f.name, '')} (default: {shown})".replace("%", "%%")  # argparse formats help with %
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS, help=text,
                           **kwargs)
