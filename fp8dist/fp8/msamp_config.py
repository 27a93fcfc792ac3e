"""MS-AMP's knobs: :class:`MSAMPConfig`, the MS-AMP backend's ``Config``, apart from the backend so that the options
(the CLI's flags) are known without importing torch or MS-AMP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["MSAMPConfig"]


@dataclass(kw_only=True, frozen=True)
class MSAMPConfig:
    """MS-AMP's own knobs (flat keys of the config; read only when ``fp8='msamp'``)."""
    opt_level: Literal["O1", "O2", "O3"] = "O2"
    """MS-AMP: O1 (FP8 weights and gradients), O2 (plus FP8/FP16 optimizer states), O3 (ZeRO, DeepSpeed only)."""
