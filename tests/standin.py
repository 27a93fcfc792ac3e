"""Put the Transformer Engine / MS-AMP stand-ins (tests/standins, NOT the real libraries) on the path, and open
the hardware gate that would otherwise (rightly) refuse FP8 on this CPU."""

from __future__ import annotations

import sys
from pathlib import Path

STANDINS = str(Path(__file__).parent / "standins")


def use_standins() -> None:
    """For spawned ranks: import path + gate, for the life of the process."""
    import fp8dist.fp8.msamp as msamp_backend
    import fp8dist.fp8.te as te_backend

    if STANDINS not in sys.path:
        sys.path.insert(0, STANDINS)
    for backend in (te_backend, msamp_backend):
        backend.BACKEND.hardware_reason = lambda cfg, hardware: None  # this instance only: the class keeps its rule


def drop_standins() -> None:
    """For in-process tests: forget the stand-in modules so later imports see the real (absent) libraries,
    and close the hardware gate again."""
    import fp8dist.fp8.msamp as msamp_backend
    import fp8dist.fp8.te as te_backend

    for backend in (te_backend, msamp_backend):
        backend.BACKEND.__dict__.pop("hardware_reason", None)
    while STANDINS in sys.path:
        sys.path.remove(STANDINS)
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")
                 or n == "msamp" or n.startswith("msamp.")]:
        del sys.modules[name]
