"""Words in messages: a count and its noun agreeing (:func:`plural`), one rule for every line fp8dist prints."""

from __future__ import annotations

__all__ = ["plural"]

_SIBILANT = ("s", "x", "z", "ch", "sh")
"""Endings whose plural takes "es" (process -> processes, batch -> batches, mismatch -> mismatches)."""


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``count`` and ``noun`` agreeing, the count with thousands separators: "1 step", "2 steps", "1,024 windows",
    "3 batches". ``many``: an irregular plural.

    Example::

        f"linear warm-up over {plural(warmup, 'step')}"
    """
    if count == 1:
        return f"{count:,} {noun}"
    return f"{count:,} {many or noun + ('es' if noun.endswith(_SIBILANT) else 's')}"
