"""Bytes of model state on this rank, by walking the real tensors.

Each storage is counted once, whole (padding and the unused tail of a flat buffer are memory too), in the first
category that reaches it: parameters, master weights, gradients, optimizer states, FP8 buffers. Tensor
subclasses (DTensor, torchao's FP8 weight wrapper) are opened down to the plain tensors that own storage.
Communication buckets (DDP's, unless gradients are views of them, and DeepSpeed's IPG buffers) are not model
state and are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["CATEGORIES", "StateBytes", "StateTally", "leaves", "model_state_tensors", "deepspeed_gradients"]

CATEGORIES = ("parameters", "master_weights", "gradients", "optimizer_states", "fp8_buffers")
# scales an FP8 weight wrapper carries (torchao's, precomputed for the FP8 all-gather): FP8 buffers, not weights
_FP8_SCALES = ("_precomputed_scale",)


def leaves(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The plain tensors inside ``obj``: a tensor (subclasses opened), or lists/tuples/dicts of them, or an
    object that keeps tensors in its attributes (MS-AMP's ScalingTensor, TE's FP8 meta)."""
    if depth > 4 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if is_traceable_wrapper_subclass(obj):
            names, _ = obj.__tensor_flatten__()
            for name in names:  # DTensor also names its device mesh here: only tensors hold the data
                inner = getattr(obj, name)
                if isinstance(inner, torch.Tensor) and name not in _FP8_SCALES:
                    yield from leaves(inner, depth + 1)
        else:
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from leaves(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from leaves(value, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, torch.optim.Optimizer, type)):
        for value in vars(obj).values():
            if isinstance(value, (torch.Tensor, list, tuple, dict)):
                yield from leaves(value, depth + 1)


class StateBytes:
    """Totals shared by the measured report and the estimate: both hold ``bytes`` per category and
    ``total_params``."""

    bytes: Any
    total_params: int

    @property
    def model_state_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def bytes_per_param(self) -> dict[str, float]:
        """Bytes on this rank per parameter of the full model, per category and ``"total"``."""
        n = max(self.total_params, 1)
        return {**{k: v / n for k, v in self.bytes.items()}, "total": self.model_state_bytes / n}


class StateTally:
    """Bytes and dtypes per category, each storage counted once."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()
        self.bytes: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.dtypes: dict[str, set[torch.dtype]] = {c: set() for c in CATEGORIES}

    def add(self, category: str, tensors: Iterable[Any]) -> None:
        for obj in tensors:
            for leaf in leaves(obj):
                if leaf.device.type == "meta":
                    continue
                storage = leaf.untyped_storage()
                key = (str(leaf.device), storage.data_ptr())
                if storage.nbytes() == 0 or key in self._seen:
                    continue
                self._seen.add(key)
                self.bytes[category] += storage.nbytes()
                self.dtypes[category].add(leaf.dtype)


def _deepspeed_tensors(engine: Any) -> dict[str, list[Any]]:
    """ZeRO keeps bf16 weights in the module (stage 3: ``ds_tensor`` partitions), fp32 master partitions and
    gradient partitions in its optimizer, and the optimizer states in the inner torch optimizer."""
    zero = engine.optimizer
    params = list(engine.module.parameters())
    stage3 = all(hasattr(p, "ds_tensor") for p in params)
    found: dict[str, list[Any]] = {
        # ZeRO-3 keeps small parameters (ds_persist) whole in p.data besides their partition
        "parameters": [[p.ds_tensor, p.data if getattr(p, "ds_persist", False) else None] if stage3 else p
                       for p in params],
        "master_weights": [getattr(zero, name, None) for name in ("single_partition_of_fp32_groups",
                                                                   "fp32_partitioned_groups_flat")],
        "gradients": [p.grad for p in params],
        "optimizer_states": [getattr(getattr(zero, "optimizer", zero), "state", {})],
    }
    found["gradients"] += deepspeed_gradients(zero)
    return found


# where ZeRO keeps this rank's reduced gradients between backward and step (stage 1/2, stage 3)
_DS_GRADIENTS = ("averaged_gradients", "grads_in_partition", "grad_partitions_flat_buffer",
                 "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition")


def deepspeed_gradients(zero: Any) -> list[Any]:
    """The gradient partitions a ZeRO optimizer holds now (freed by its step)."""
    return [getattr(zero, name) for name in _DS_GRADIENTS if getattr(zero, name, None) is not None]


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param._local_tensor if isinstance(param, DTensor) else param  # the object itself, not a new alias


def model_state_tensors(model: nn.Module, optimizer: Any, fp8_modules: list[nn.Module]) -> dict[str, list[Any]]:
    """The tensors of each category, for any wrapped model (FSDP2, FSDP1, DDP, plain, DeepSpeed engine)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from ..strategies.deepspeed import is_deepspeed_engine

    fp8 = [getattr(m, "fp8_meta", None) for m in fp8_modules] + [b for m in fp8_modules
                                                                   for b in m.buffers(recurse=False)]
    fp8 += [getattr(_local(p), name, None) for m in fp8_modules for p in m.parameters(recurse=False)
            for name in _FP8_SCALES]
    if is_deepspeed_engine(model):
        return {**_deepspeed_tensors(model), "fp8_buffers": fp8}
    flats = [m._flat_param for m in FullyShardedDataParallel.fsdp_modules(model) if m._flat_param is not None]
    params = flats + list(model.parameters())
    state = getattr(optimizer, "state", {}) if optimizer is not None else {}
    return {"parameters": params, "master_weights": [], "gradients": [p.grad for p in params],
            "optimizer_states": [state], "fp8_buffers": fp8}
