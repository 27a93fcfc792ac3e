"""What FP8 decisions depend on about a machine: device type and CUDA capability, read from a device
(:func:`hardware_of`) or named (:func:`parse_target`: ``--target h100`` on a CPU login node). Every FP8 gate reads a
:class:`Hardware`, so a named target gets exactly the decisions that machine would."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .gpus import GPUS, GpuSpec, gpu_by_device_name, gpu_by_key

__all__ = ["Hardware", "hardware_of", "parse_target", "TARGETS", "GpuLookup", "find_gpu"]


@dataclass(frozen=True)
class Hardware:
    """A device as FP8 decisions see it. ``type`` reads like :attr:`torch.device.type`."""

    type: str
    """"cuda" or "cpu" (any other torch device type as it is)."""
    capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor); None off CUDA."""
    name: str = ""
    """What to call it in messages ("NVIDIA H100 80GB HBM3", "sm_90")."""

    @property
    def sm(self) -> str:
        """``sm_90``; the device type off CUDA."""
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else self.type

    def __str__(self) -> str:
        if self.capability is None:
            return self.name or self.type
        return self.sm if self.name in ("", self.sm) else f"{self.name} ({self.sm})"


def hardware_of(device: torch.device | Hardware) -> Hardware:
    """The :class:`Hardware` of ``device`` (asking CUDA); a Hardware is returned as is."""
    if isinstance(device, Hardware):
        return device
    if device.type == "cuda":
        return Hardware("cuda", tuple(torch.cuda.get_device_capability(device)), torch.cuda.get_device_name(device))
    return Hardware(device.type)


TARGETS: dict[str, Hardware] = {
    "cpu": Hardware("cpu"),
    **{spec.key: Hardware("cuda", spec.capability, spec.label) for spec in GPUS},
}
"""Named targets (lower case) and their hardware; any ``sm_XY`` / ``sm_XYZ`` capability is accepted too."""


def parse_target(text: str) -> Hardware:
    """The :class:`Hardware` a target names: a GPU (``h100``, ``b200``, ...; case-insensitive), a CUDA capability
    (``sm_90``, ``sm_100``, ``sm90``) or ``cpu``; ValueError naming the choices for anything else."""
    key = text.strip().lower()
    if key in TARGETS:
        return TARGETS[key]
    if match := re.fullmatch(r"sm_?(\d{1,2})(\d)", key):
        major, minor = int(match.group(1)), int(match.group(2))
        return Hardware("cuda", (major, minor), f"sm_{major}{minor}")
    gpus = ", ".join(k for k in TARGETS if k != "cpu")
    raise ValueError(f"target {text!r} is not a known machine: name a GPU ({gpus}), a CUDA compute capability "
                     "(sm_89, sm_90, sm_100) or cpu.")


@dataclass(frozen=True)
class GpuLookup:
    """The GPU record of a :class:`Hardware`, or None with ``reason`` saying why and the way out."""

    spec: GpuSpec | None
    """The record found; None where none is."""
    reason: str = ""
    """Why none was found, with the way out (``--target h100``); "" where one was."""


def find_gpu(hardware: Hardware) -> GpuLookup:
    """The GPU record of a named target or a real device (matched by its CUDA name); none for a CPU, a bare
    capability such as ``sm_90`` (several GPUs share it) or a GPU the table does not list."""
    if hardware.type != "cuda":
        return GpuLookup(None, f"{hardware} is not a GPU: FP8 speed applies to CUDA GPUs only")
    named = next((key for key, target in TARGETS.items() if target == hardware), None)
    spec = gpu_by_key(named) if named else gpu_by_device_name(hardware.name)
    if spec is not None and spec.capability == hardware.capability:
        return GpuLookup(spec)
    known = ", ".join(s.key for s in GPUS)
    what = "a compute capability, not one GPU" if hardware.name in ("", hardware.sm) else "not in fp8dist's GPU table"
    return GpuLookup(None, f"{hardware} is {what}: its peaks are unknown. Plan with --target naming one of "
                           f"{known}, the closest to it.")
