"""The one reader of the YAML/JSON files a user configures fp8dist with. A key given twice in one mapping (which JSON
and YAML let win silently) is an error, as is bad syntax, naming the file, the line and the column."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

__all__ = ["read_config_text", "no_duplicate_keys"]


def no_duplicate_keys(what: str, path: Path):
    """A ``json.loads`` ``object_pairs_hook`` refusing a key given twice in one object: the hook raises ValueError
    naming ``what`` (``"config file"``), ``path``, the key and both values."""
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"{what} {str(path)!r} gives the key {key!r} twice in one object ({seen[key]!r}, "
                                 f"then {value!r}): JSON would keep the last silently. Keep one.")
            seen[key] = value
        return seen
    return hook


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (merge keys ``<<:`` still merge)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) or key is None:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"the key {key!r} is given twice in one mapping (first at line "
                                        f"{seen[key].line + 1}): YAML would keep the last silently. Keep one",
                            key_node.start_mark)
                    seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def read_config_text(path: Path, *, what: str = "config file") -> Any:
    """The file at ``path`` parsed as JSON (``.json``) or YAML (any other suffix); None when empty. ``what`` names
    the file in messages (``"config file"``, ``"DeepSpeed config"``).

    Raises:
        ValueError: not UTF-8, bad syntax (with line and column), or a key given twice in one mapping.
        OSError: the file cannot be read.
    """
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    if not text.strip():
        return None
    try:
        if path.suffix.lower() == ".json":
            return json.loads(text, object_pairs_hook=no_duplicate_keys(what, path))
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON: line {err.lineno}, column {err.colno}: "
                         f"{err.msg}.") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        context = getattr(err, "context", None)
        start = getattr(err, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())  # one line
        if context and start is not None:  # where the unfinished construct began ("while scanning a quoted scalar")
            problem += f" ({context} at line {start.line + 1}, column {start.column + 1})"
        raise ValueError(f"{what} {str(path)!r} is not valid YAML: {where}{problem}.") from None
