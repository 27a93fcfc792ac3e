"""A LoRA base loaded in FP8: ``pretrained=`` an FP8 checkpoint (:mod:`fp8dist.fp8.hf_format`) under ``--lora-rank``
fills each frozen Linear whose weight the checkpoint holds in e4m3 with those bits (1 byte per weight) and their
scale, never a high-precision copy of it; torchao's frozen Float8Linear multiplies with them
(:class:`~fp8dist.fp8.frozen.FrozenFloat8Linear`). It runs where the strategy keeps each parameter's own dtype
(none, ddp, and fsdp: FSDP2 all-gathers the e4m3 bytes, the scale kept whole beside) and torchao's module swap
converts; a layer the plan keeps out of FP8 gets its weight dequantized once."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..fp8.hf_format import SCALE_ATTR, dequantize, granularity_of_scale, holds_fp8
from .meta_init import init_weights
from ..runtime.load_report import LoadReport
from .pretrained import SafetensorsDir, load_pretrained

__all__ = ["fp8_checkpoint", "fp8_base_refusal", "load_fp8_base", "release_unplanned"]


def fp8_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the model directory ``path`` holds FP8 weights with scales (reads the headers and config.json only)."""
    return bool(SafetensorsDir(path).quantized)


def fp8_base_refusal(cfg: Any, facts: Any) -> str | None:
    """Why a LoRA base cannot be held in FP8 under ``cfg`` whose strategy has ``facts`` (it is dequantized instead),
    or None where it can: torchao's module swap (the frozen Float8Linear multiplies with given bits) on a strategy
    that keeps each parameter's dtype (FSDP1 flattens, DeepSpeed casts the e4m3 bits)."""
    from ..fp8 import get_backend

    if not get_backend(cfg.precision.fp8).runs_held_fp8(cfg):
        return (f"fp8={cfg.precision.fp8!r} as configured does not multiply with given FP8 bits (the base is held in "
                "FP8 under fp8='torchao' with its module swap and a tensorwise or rowwise recipe)")
    # FSDP2 all-gathers the e4m3 bytes as they are: it casts floating parameters only (FSDPParam.init_dtype_attrs)
    how = ("flattens each unit's parameters into one flat parameter of one dtype" if facts.flat_params else
           "casts every parameter to its own dtype" if facts.engine_owns_params else None)
    if how:
        return (f"strategy={cfg.parallel.strategy!r} {how} (the base is held in FP8 under strategy 'none', 'ddp' or "
                "'fsdp')")
    return None


def load_fp8_base(model: nn.Module, path: str | os.PathLike) -> LoadReport:
    """Fill ``model``, built on the meta device (before PEFT), from the FP8 checkpoint ``path``: each nn.Linear whose
    weight the checkpoint holds in e4m3 gets those bits as a frozen parameter (their bytes, uint8), its scale on it
    (``weight.fp8_scale``: it stays with the weight when torchao swaps the module) and ``compute_dtype`` (the dtype
    PEFT builds its adapters in); every other parameter is allocated in its dtype and read (dequantized where FP8),
    the buffers from the model's own initialization. Returns the load's report (``held_fp8``: the weights kept in
    FP8). Call it on every rank, before ``apply_lora``."""
    source = SafetensorsDir(path)
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                full = f"{prefix}.{name}" if prefix else name
                if isinstance(module, nn.Linear) and name == "weight" and source.dtypes.get(full) == "F8_E4M3" \
                        and full in source.quantized:  # the e4m3 bytes (uint8: what every engine broadcasts)
                    param = nn.Parameter(torch.empty(p.shape, dtype=torch.uint8), requires_grad=False)
                    setattr(param, SCALE_ATTR, source.scale_of(full))
                    module.compute_dtype = p.dtype  # PEFT reads it for the adapters' dtype
                else:
                    param = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                module._parameters[name] = param
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    source.close()
    init_weights(model, torch.device("cpu"), buffers_only=True)
    return load_pretrained(model, path)


def release_unplanned(model: nn.Module, plan: Any) -> list[str]:
    """Dequantize, once, the weights held in FP8 (:func:`load_fp8_base`) of the layers ``plan`` keeps out of FP8 (they
    compute in high precision, from a weight in their ``compute_dtype``). Call before conversion. Returns their
    names."""
    fp8 = {e.name for e in plan if e.precision == "fp8"}
    released = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if holds_fp8(module) and name not in fp8:
                weight = module.weight
                scale = getattr(weight, SCALE_ATTR)
                values = dequantize(weight, scale, granularity_of_scale(tuple(weight.shape), tuple(scale.shape)))
                module.weight = nn.Parameter(values.to(module.compute_dtype), requires_grad=False)
                released.append(name)
    return released


def held_note(model: nn.Module, released: list[str]) -> str | None:
    """The plan's note of a frozen base loaded in FP8 into ``model``: how many Linears hold e4m3 weights, and
    ``released`` (the names the plan keeps out of FP8, dequantized once); None when no weight is held in FP8 and
    none was released."""
    held = [name for name, module in model.named_modules() if holds_fp8(module)]
    if not held and not released:
        return None
    params = sum(model.get_submodule(n).weight.numel() for n in held)
    note = (f"the frozen base came in FP8 from the checkpoint: {len(held)} Linears ({params:,} weights) hold its e4m3 "
            "bits and scales (1 byte per weight), multiplied as they are where their scale is the recipe's, else "
            "re-cast once")
    if released:
        note += f"; {len(released)} the plan keeps out of FP8 dequantized once ({', '.join(released[:3])}"
        note += ", ...)" if len(released) > 3 else ")"
    return note
