"""Words in messages: a count and its noun agreeing, a byte count in binary units; one rule for every line printed."""

from __future__ import annotations

__all__ = ["plural", "byte_size", "listing"]

_SIBILANT = ("s", "x", "z", "ch", "sh")  # plural in "es": processes, batches


def plural(count: int, noun: str, many: str | None = None) -> str:
    """"1 step", "2 steps", "1,024 windows", "3 batches"; ``many``: an irregular plural."""
    if count == 1:
        return f"{count:,} {noun}"
    return f"{count:,} {many or noun + ('es' if noun.endswith(_SIBILANT) else 's')}"


def byte_size(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches: "1.50 GiB", "12.00 MiB", "512 B"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def listing(items: list[str], shown: int = 3) -> str:
    """The first ``shown`` items joined by commas, then "and N more": "a, b, c and 2 more"."""
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")
