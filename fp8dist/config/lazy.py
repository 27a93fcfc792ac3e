"""One rule for packages whose public names import torch: they load on the first read of any of them, so importing a
light module of the package (the CLI's choices, the registries' names) imports no engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(namespace: dict[str, Any], load: Callable[[], dict[str, Any]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the package whose ``globals()`` is ``namespace``.

    The first read of a name the package does not hold yet calls ``load`` once (it imports the heavy names and
    returns them, e.g. its ``locals()``) and binds those the package's ``__all__`` lists. A name already bound is kept
    (a test's monkeypatch), a name deleted afterwards stays deleted, and Python's dunder probes (``__wrapped__``)
    never load. Raises AttributeError, as a module does, for a name the package does not have. Use it as
    ``__getattr__ = lazy_names(globals(), _load)`` at the end of the package's ``__init__``."""
    loaded = False

    def __getattr__(name: str) -> Any:
        nonlocal loaded
        if not name.startswith("__") and not loaded:
            names = load()
            loaded = True
            for key, value in names.items():
                if key in namespace["__all__"]:
                    namespace.setdefault(key, value)
            if name in namespace:
                return namespace[name]
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")

    return __getattr__
