"""Pieces the strategies share: finding the transformer blocks, casting buffers, autocast forward, materializing."""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
from torch import nn

from .ties import TiedBlock, untie_blocks

__all__ = ["find_blocks", "shard_blocks", "block_ties", "cast_buffers", "apply_autocast", "to_empty", "check_fits",
           "available_bytes"]


def _with_params(model: nn.Module) -> str:
    with_params = sorted({type(m).__name__ for m in model.modules()
                          if m is not model and any(True for _ in m.parameters())})
    return (f"Classes that hold parameters in this model: {with_params}. Pass one of them, or leave block_classes "
            "empty to detect the blocks.")


def find_blocks(model: nn.Module, block_classes: tuple[str, ...] = ()) -> tuple[list[tuple[str, nn.Module]], str]:
    """The blocks FSDP shards one by one, ``([(fqn, module), ...], how they were found)``, innermost first; empty:
    the root only. By the user's ``block_classes``, else Hugging Face ``_no_split_modules``, else the children of
    the largest ``nn.ModuleList``; a block tied to a module outside it is left out (:func:`block_ties`).
    ValueError: a class in ``block_classes`` is not in the model or holds no parameters."""
    found, how = _candidate_blocks(model, block_classes)
    kept, ties = untie_blocks(model, found)
    if ties:
        how += f"; left out, tied to a parameter outside them: {', '.join(t.block for t in ties)}"
    return kept, how


def shard_blocks(model: nn.Module, job: Any) -> tuple[list[tuple[str, nn.Module]], str, tuple[str, ...]]:
    """The blocks a block-wise strategy shards (the block step's, else found now), how they were found, and the
    notes: a model sharded as one unit, blocks left out for a tie (read before sharding replaces parameters)."""
    classes = job.cfg.parallel.block_classes
    found, how = job.blocks if job.blocks is not None else find_blocks(model, classes)
    one_unit = () if found else (f"{type(model).__name__}: {how}. All parameters are gathered at once; pass "
                                 "block_classes=[...] to shard block by block.",)
    return found, how, one_unit + tuple(t.note for t in block_ties(model, classes))


def block_ties(model: nn.Module, block_classes: tuple[str, ...] = ()) -> tuple[TiedBlock, ...]:
    """The blocks :func:`find_blocks` leaves out of block-wise sharding for a tied parameter, with the tie."""
    return untie_blocks(model, _candidate_blocks(model, block_classes)[0])[1]


def _candidate_blocks(model: nn.Module, block_classes: tuple[str, ...]) -> tuple[list[tuple[str, nn.Module]], str]:
    classes_in_model = {type(m).__name__ for m in model.modules()}
    if block_classes:
        missing = [c for c in block_classes if c not in classes_in_model]
        if missing:
            raise ValueError(f"block_classes={list(block_classes)}: {missing} not found in {type(model).__name__}. "
                             f"{_with_params(model)}")
        empty = [c for c in block_classes if not any(True for m in model.modules() if type(m).__name__ == c
                                                      for _ in m.parameters())]
        if empty:
            raise ValueError(f"block_classes={list(block_classes)}: {empty} hold no parameters in "
                             f"{type(model).__name__}, so there is nothing to shard per block. {_with_params(model)}")
        wanted, how = set(block_classes), f"block_classes={list(block_classes)}"
    else:
        # Hugging Face _no_split_modules of the model or of any submodule (a HF model inside a wrapper)
        wanted = {n for m in model.modules() for n in getattr(m, "_no_split_modules", None) or ()
                  if n in classes_in_model}
        how = f"Hugging Face _no_split_modules {sorted(wanted)}"
    if wanted:
        blocks = [(fqn, m) for fqn, m in model.named_modules() if type(m).__name__ in wanted and m is not model]
        return blocks[::-1], how
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return [], "no blocks found (no block_classes, no _no_split_modules, no nn.ModuleList): root only"
    fqn, largest = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    blocks = [(f"{fqn}.{i}", child) for i, child in enumerate(largest)]
    return blocks[::-1], f"children of the largest nn.ModuleList {fqn!r}"


def cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating-point buffers in place (FSDP2 and DDP do not cast buffers themselves)."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                setattr(module, name, buf.to(dtype))


def apply_autocast(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``module``'s forward (not its backward, as PyTorch recommends) under ``torch.autocast`` to ``dtype``;
    fp32: no autocast."""
    if dtype == torch.float32:
        return
    forward = module.forward

    @functools.wraps(forward)
    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = autocast_forward  # type: ignore[method-assign]


def to_empty(module: nn.Module, device: torch.device, *, recurse: bool = True) -> nn.Module:
    """``module.to_empty(device)`` keeping tied parameters tied (plain ``to_empty`` gives each holder its own)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return module.to_empty(device=device, recurse=recurse)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def available_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device, or the memory the kernel can give this machine's processes; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:  # MemAvailable counts the page cache the kernel would give back; free pages alone undercount it
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(model: nn.Module, device: torch.device, strategy: str) -> None:
    """MemoryError for a meta model larger than the device's free memory, before a strategy that materializes it
    whole on every rank allocates it; a warning above half."""
    need = sum(t.numel() * t.element_size() for t in {id(t): t for t in (*model.parameters(),
                                                                         *model.buffers())}.values())
    free = available_bytes(device)
    if free is not None and need > free:
        raise MemoryError(f"strategy={strategy!r} materializes the whole meta-device model on every rank: "
                          f"{need / 2**30:,.1f} GiB of parameters and buffers, and {device} has "
                          f"{free / 2**30:,.1f} GiB free. Use strategy='fsdp' or 'fsdp1' (each rank materializes "
                          "its shard only) or deepspeed with zero_stage=3.")
    if free is not None and need > free // 2:
        warnings.warn(f"strategy={strategy!r} materializes the whole meta-device model on every rank: "
                      f"{need / 2**30:,.1f} GiB of {free / 2**30:,.1f} GiB free on {device}, before gradients and "
                      "optimizer states. strategy='fsdp' materializes 1/world_size of it.", UserWarning, stacklevel=5)
