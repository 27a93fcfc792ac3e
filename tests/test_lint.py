"""The linter the project is held to (ruff, configured in pyproject.toml): pyflakes and syntax errors in every Python
file; in the library, no line over 120 and a docstring on every public class, method and function."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_pyflakes_and_syntax_hold_everywhere():
    proc = _ruff("fp8dist", "tests", "benchmarks", "examples")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_the_library_keeps_its_line_length_and_documents_every_public_class_method_and_function():
    proc = _ruff("--select", "E501,D101,D102,D103", "fp8dist")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_every_exported_constant_has_a_docstring():
    """pydocstyle covers classes and functions; a constant a module exports (its ``__all__``, or an axis value's
    ``BACKEND`` / ``STRATEGY`` / ``LEVEL``) carries the string literal under it that says what it holds."""
    import ast

    from cli_helpers import assigned_names

    bare = []
    for path in sorted((ROOT / "fp8dist").rglob("*.py")):
        body = ast.parse(path.read_text()).body
        exported = {"BACKEND", "STRATEGY", "LEVEL"}
        for node in body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                exported |= set(ast.literal_eval(node.value))
        for node, after in zip(body, [*body[1:], None]):
            names = assigned_names(node)
            documented = isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant) \
                and isinstance(after.value.value, str)
            bare += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                     if n in exported and n != "__all__" and not documented]
    assert bare == []
