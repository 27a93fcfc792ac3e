"""Bytes of model state on this rank, by walking the real tensors: each storage counted once, whole (padding too), in
the first category that reaches it; tensor subclasses (DTensor, torchao's FP8 weight) opened down to the tensors
that own storage. Communication buckets are not model state; where each engine keeps its state, its strategy says."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .rows import text_table

__all__ = ["CATEGORIES", "StateBytes", "StateTally", "ParamGroup", "leaves", "model_state_tensors", "holds_words"]

CATEGORIES = ("parameters", "master_weights", "gradients", "optimizer_states", "fp8_buffers")
"""The model-state categories every byte count is split into; a storage reached from two is counted once, in the
first category that reaches it. ``ParamGroup.bytes`` sums the first four (all but the FP8 buffers)."""


def leaves(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The plain tensors inside ``obj``: a tensor (subclasses opened), containers of them, or an object keeping
    tensors in its attributes (MS-AMP's ScalingTensor, TE's FP8 meta)."""
    if depth > 4 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if is_traceable_wrapper_subclass(obj):
            names, _ = obj.__tensor_flatten__()
            for name in names:  # DTensor also names its device mesh here: only tensors hold the data
                inner = getattr(obj, name)
                if isinstance(inner, torch.Tensor) and name not in _scale_names():
                    yield from leaves(inner, depth + 1)
        else:
            yield obj
    elif isinstance(obj, (dict, list, tuple)):
        for value in obj.values() if isinstance(obj, dict) else obj:
            yield from leaves(value, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, torch.optim.Optimizer, type)):
        for value in vars(obj).values():
            if isinstance(value, (torch.Tensor, list, tuple, dict)):
                yield from leaves(value, depth + 1)


@dataclass(frozen=True)
class ParamGroup:
    """The parameters that train, or those that are frozen (a LoRA base), as one rank holds them."""

    label: str
    """"frozen" or "trained"."""
    params: int
    """Elements of the full model (all ranks) in this group."""
    bytes: int
    """Model-state bytes on this rank, FP8 buffers aside."""
    holds: str
    """What each element holds: "bf16 weight" for a frozen base, "fp32 weight, fp32 grad, ..."."""


def holds_words(names: Iterable[Collection[str]]) -> str:
    """"fp32 weight, fp32 grad, fp32 optimizer states" from the dtype names of each category but FP8 buffers."""
    return ", ".join(f"{'/'.join(sorted(set(n) - {'none'}))} {what}" for n, what in
                     zip(names, ("weight", "master", "grad", "optimizer states")) if set(n) - {"none"})


class StateBytes:
    """What the measured report and the estimate share: ``bytes`` and ``dtypes`` per category, ``total_params``."""

    bytes: Any
    """Bytes on this rank per category (:data:`CATEGORIES`)."""
    dtypes: Any
    """The dtypes each category holds, as ``"bf16/fp32"``."""
    total_params: int
    """Elements of all parameters of the full model (all ranks)."""
    groups: tuple[ParamGroup, ...] = ()
    """The frozen and the trained parameters apart; () where all train."""

    @property
    def model_state_bytes(self) -> int:
        """Bytes of every model-state category together."""
        return sum(self.bytes.values())

    @property
    def bytes_per_param(self) -> dict[str, float]:
        """Bytes on this rank per parameter of the full model, per category and ``"total"``."""
        n = max(self.total_params, 1)
        return {**{k: v / n for k, v in self.bytes.items()}, "total": self.model_state_bytes / n}

    def state_rows(self, size: Callable[[int], str], host: Collection[str] = ()) -> list[list[str]]:
        """Per category (those in ``host`` marked so): bytes per parameter, ``size`` of its bytes, dtypes; then
        the total."""
        per_param = self.bytes_per_param
        rows = [[c.replace("_", " ") + (" (host)" if c in host else ""), f"{per_param[c]:.3f}", size(self.bytes[c]),
                 self.dtypes[c]] for c in CATEGORIES]
        return rows + [["total model states", f"{per_param['total']:.3f}", size(self.model_state_bytes), ""]]

    def group_table(self, size: Callable[[int], str]) -> list[str]:
        """The frozen and the trained parameters' table and a blank line; nothing where every parameter trains.
        ``size`` formats a byte count, as the rest of the report does."""
        rows = [[g.label, f"{g.params:,}", f"{g.bytes / max(g.params, 1):.3f}", size(g.bytes), g.holds]
                for g in self.groups]
        return [text_table(["parameters (this rank)", "count", "bytes/param", "size", "holds"], rows), ""] \
            if rows else []


class StateTally:
    """Bytes and dtypes per category, each storage counted once; ``counted``: a tally whose storages it skips."""

    def __init__(self, counted: StateTally | None = None) -> None:
        self._seen: set[tuple[str, int]] = set(counted._seen) if counted is not None else set()
        self.bytes: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        """Bytes counted so far per category."""
        self.dtypes: dict[str, set[torch.dtype]] = {c: set() for c in CATEGORIES}
        """The dtypes met so far per category."""

    def add(self, category: str, tensors: Iterable[Any]) -> None:
        """Count the storages of ``tensors`` (and of their subclass leaves) under ``category``, each storage once
        across all categories; meta and empty storages count nothing."""
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


def model_state_tensors(held: dict[str, list[Any]], fp8_modules: list[nn.Module], backend: Any) -> \
        dict[str, list[Any]]:
    """The tensors of each category: what the engine holds (``held``: ``Strategy.state_tensors``) and the FP8
    state ``backend`` says its converted modules keep."""
    return {**held, "fp8_buffers": [t for m in fp8_modules for t in backend.state_tensors(m)]}


def _scale_names() -> set[str]:
    """Every registered backend's :attr:`FP8Backend.weight_scale_names`: FP8 buffers, not weight data."""
    from ..fp8 import BACKENDS

    return {name for backend in BACKENDS.values() for name in backend.weight_scale_names}
