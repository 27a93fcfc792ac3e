"""The library's folders form a stack: no import (at module level or inside a function, outside ``if TYPE_CHECKING:``)
runs from a folder to one above it, and the built-in strategies, FP8 backends and memory levels reach their
registries through entry points rather than through config importing the axes."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

from cli_helpers import ROOT, assigned_names

PACKAGE = ROOT / "fp8dist"
STACK = ("config", "runtime", ("fp8", "strategies"), "memory_levels", "plan", "pipeline",
         ("numerics", "accounting", "checkpoint"), "train", "integrations", "bench", "cli")
"""From the bottom: a folder imports only folders below it (those on one level import none of each other)."""


def _level() -> dict[str, int]:
    return {name: i for i, entry in enumerate(STACK) for name in ((entry,) if isinstance(entry, str) else entry)}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every fp8dist import in ``path`` that runs (not under ``if TYPE_CHECKING:``)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1]
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for branch in ast.walk(tree) if isinstance(branch, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(branch.test) for node in ast.walk(branch)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [f"{module}.{alias.name}" for alias in node.names] if node.module is None else [module]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return [(line, name) for line, name in found if name.startswith("fp8dist.")]


def test_no_folder_imports_one_above_it():
    level = _level()
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(level), "each folder of fp8dist has its place in STACK"
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        home = path.relative_to(PACKAGE).parts[0]
        if home not in level:  # fp8dist/__init__.py and __main__.py sit on top
            continue
        for line, module in _imports(path):
            target = module.split(".")[1]
            if target != home and level[target] >= level[home]:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert upward == []


def test_the_built_ins_register_through_entry_points():
    """The three groups each name fp8dist's own registration function; config/ imports none of the axes."""
    for group, package in (("fp8dist.strategies", "fp8dist.strategies"), ("fp8dist.fp8_backends", "fp8dist.fp8"),
                           ("fp8dist.memory_levels", "fp8dist.memory_levels")):
        points = [p for p in importlib.metadata.entry_points(group=group) if p.name == "fp8dist"]
        assert [p.value for p in points] == [f"{package}:register_builtins"], group


ONE_PER_MODULE = {"BACKEND", "STRATEGY", "LEVEL", "HELP", "add_parser", "run", "register_builtins"}
"""Names each module of a kind defines by convention: a backend's, strategy's or memory level's value, a command's
help line, parser and runner, an axis package's registration function."""


def test_no_public_name_is_defined_in_two_modules():
    """A public top-level name means one thing: two modules defining it (two ``engine_of``, two ``CheckpointState``)
    leave a reader guessing which one an import brings."""
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            defined = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            for name in [node.name] if defined else assigned_names(node):
                if not name.startswith("_") and name not in ONE_PER_MODULE:
                    where.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in where.items() if len(set(paths)) > 1} == {}
