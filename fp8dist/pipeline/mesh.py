"""``wrap_model(mesh=...)``: a ``DeviceMesh`` (or process group) the user built, e.g. inside Ray Train's worker
group, checked against the job before anything changes; the strategy then shards over it instead of its own."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..config.text import plural
from ..runtime.env import LaunchEnv

__all__ = ["check_mesh"]


def _as_mesh(mesh: Any, device: torch.device) -> DeviceMesh:
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, dist.ProcessGroup):  # a 1-D mesh over the group: what DDP and FSDP take it as
        return DeviceMesh.from_group(mesh, device.type)
    raise TypeError(f"wrap_model: mesh={type(mesh).__name__} must be a torch.distributed DeviceMesh (e.g. "
                    "init_device_mesh('cuda', (world_size,))) or a ProcessGroup, or None for fp8dist's own over "
                    "every rank.")


def check_mesh(mesh: Any, strategy: Any, cfg: Any, launch: LaunchEnv, device: torch.device) -> DeviceMesh | None:
    """``mesh`` as the DeviceMesh the strategy shards over, or None (not given: the strategy builds its own).

    Call it with wrap_model's checks, before anything changes. Refused with ValueError: a mesh over other than
    every rank of the job (fp8dist's clipping, non-finite guard, checkpoints and FP8 amax reduction use the world
    group, so a mesh over some ranks would sync the gradients of some and the rest of everything), one for another
    device type, and one the strategy cannot shard over (:meth:`~fp8dist.strategies.base.Strategy.check_mesh`);
    TypeError for something that is no mesh or process group."""
    if mesh is None:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("wrap_model: mesh= given but torch's default process group is not initialized: a mesh is "
                         "built over it (init_process_group first, as torchrun and Ray Train's TorchTrainer do).")
    found = _as_mesh(mesh, device)
    if found.size() != launch.world_size:
        raise ValueError(f"wrap_model: mesh {tuple(found.shape)} covers {plural(found.size(), 'rank')} but the job has "
                         f"{launch.world_size} (the default process group): fp8dist shards over every rank, and its "
                         "gradient clipping, non-finite guard, checkpoints and FP8 amax reduction use the world "
                         f"group. Pass a mesh over all {launch.world_size} ranks (init_device_mesh(device_type, "
                         f"({launch.world_size},))), or none.")
    if found.device_type != device.type:
        raise ValueError(f"wrap_model: mesh is a {found.device_type!r} mesh but this rank trains on {device} "
                         f"(device={cfg.parallel.device!r}): build it with init_device_mesh({device.type!r}, ...).")
    strategy.check_mesh(found, cfg)
    return found
