"""Installed versions of fp8dist's dependencies and the ranges fp8dist supports, read from package metadata without
importing the packages."""

from __future__ import annotations

import functools

__all__ = ["__version__", "package_version", "supported_range"]

__version__ = "0.1.0"
"""fp8dist's own version: the one place it is written (pyproject.toml and checkpoints' meta.json read it here)."""


@functools.cache
def package_version(name: str) -> str | None:
    """Installed version of a distribution (``_`` or ``-`` alike), without importing it; None when absent. Read once
    per process: the planner asks per layer, and each read parses the package's metadata file."""
    from importlib import metadata

    try:
        return metadata.version(name)  # Python >= 3.10 matches the normalized name
    except metadata.PackageNotFoundError:
        return None


def supported_range(name: str) -> str | None:
    """The versions of ``name`` that fp8dist's own package metadata takes (its dependencies and extras, as
    pyproject.toml declares them); None when it names none (MS-AMP: not on the package index)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        requirements = [Requirement(text) for text in metadata.requires("fp8dist") or ()]
    except metadata.PackageNotFoundError:
        return None
    wanted = canonicalize_name(name)
    return next((str(r.specifier) for r in requirements if canonicalize_name(r.name) == wanted), None)
