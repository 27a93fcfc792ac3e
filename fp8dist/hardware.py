"""What FP8 decisions depend on about a machine: the device type and, on CUDA, the compute capability. Read from
the device a model trains on (:func:`hardware_of`), or named to plan for a machine one is not on
(:func:`parse_target`: ``fp8dist plan --target h100`` on a CPU login node).

Every FP8 gate (the backends' hardware reason, torchao's MoE grouped-GEMM recipe, compile's default, the lean
optimizer) reads a :class:`Hardware`, so a named target gets exactly the decisions that machine would."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["Hardware", "hardware_of", "parse_target", "TARGETS"]


@dataclass(frozen=True)
class Hardware:
    """A device as FP8 decisions see it. ``type`` reads like :attr:`torch.device.type`."""

    type: str
    """torch's device type: "cuda" or "cpu" (or another type torch names)."""
    capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor); None off CUDA."""
    name: str = ""
    """What to call it in messages ("NVIDIA H100 80GB HBM3", "sm_90")."""

    @property
    def sm(self) -> str:
        """``sm_90``-style name of the capability; the device type off CUDA."""
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else self.type

    def __str__(self) -> str:
        if self.capability is None:
            return self.name or self.type
        return self.sm if self.name in ("", self.sm) else f"{self.name} ({self.sm})"


def hardware_of(device: torch.device | Hardware) -> Hardware:
    """The :class:`Hardware` of ``device`` (asking CUDA for its capability and name); a Hardware is returned as is."""
    if isinstance(device, Hardware):
        return device
    if device.type == "cuda":
        return Hardware("cuda", tuple(torch.cuda.get_device_capability(device)), torch.cuda.get_device_name(device))
    return Hardware(device.type)


TARGETS: dict[str, Hardware] = {
    "cpu": Hardware("cpu"),
    "a100": Hardware("cuda", (8, 0), "A100"),
    "l4": Hardware("cuda", (8, 9), "L4"),
    "l40s": Hardware("cuda", (8, 9), "L40S"),
    "rtx4090": Hardware("cuda", (8, 9), "RTX 4090"),
    "h100": Hardware("cuda", (9, 0), "H100"),
    "h200": Hardware("cuda", (9, 0), "H200"),
    "gh200": Hardware("cuda", (9, 0), "GH200"),
    "b200": Hardware("cuda", (10, 0), "B200"),
    "gb200": Hardware("cuda", (10, 0), "GB200"),
}
"""Named targets (lower case) and their hardware; any ``sm_XY`` / ``sm_XYZ`` capability is accepted too."""


def parse_target(text: str) -> Hardware:
    """The :class:`Hardware` a target names: a GPU (``h100``, ``b200``, ...; case-insensitive), a CUDA capability
    (``sm_90``, ``sm_100``, ``sm90``) or ``cpu``.

    Raises:
        ValueError: anything else, naming the choices.
    """
    key = text.strip().lower()
    if key in TARGETS:
        return TARGETS[key]
    match = re.fullmatch(r"sm_?(\d{1,2})(\d)", key)
    if match:
        capability = (int(match.group(1)), int(match.group(2)))
        return Hardware("cuda", capability, f"sm_{capability[0]}{capability[1]}")
    gpus = ", ".join(k for k in TARGETS if k != "cpu")
    raise ValueError(f"target {text!r} is not a known machine: name a GPU ({gpus}), a CUDA compute capability "
                     "(sm_89, sm_90, sm_100) or cpu.")
