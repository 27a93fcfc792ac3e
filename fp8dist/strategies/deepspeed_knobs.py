"""DeepSpeed's knobs (:class:`DeepSpeedConfig`, strategy deepspeed's ``Config``): the ZeRO stage, CPU offload and the
user's own json. Known without importing DeepSpeed or torch (the CLI's flags); not DeepSpeed's own config class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DeepSpeedConfig"]


@dataclass(kw_only=True, frozen=True)
class DeepSpeedConfig:
    """DeepSpeed's own knobs (flat keys of the config; read only when ``strategy='deepspeed'``, ``offload_param``
    only with ``zero_stage=3``)."""

    zero_stage: Literal[1, 2, 3] = 2
    """DeepSpeed ZeRO stage: 1 (optimizer states partitioned), 2 (+ gradients), 3 (+ parameters)."""

    offload_optimizer: bool = False
    """DeepSpeed: keep optimizer states on the CPU."""

    offload_param: bool = False
    """DeepSpeed ZeRO-3: keep parameters on the CPU."""

    ds_config: str | None = None
    """Path to your own DeepSpeed json: its values win; fp8dist fills only the keys it lacks."""
