"""Export of a PEFT LoRA model trained under :func:`fp8dist.wrap_model`: the adapters in PEFT's format
(:func:`save_adapters`) or the base with the adapters merged (:func:`save_merged`). Every rank gathers the full
tensors (FSDP2, FSDP1, ZeRO-3 alike); rank 0 writes."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..pipeline.agree import rank_world
from ..strategies import unwrap_model
from ..strategies.local_shards import gather_full, plain_name
from ..pipeline.pretrained import persistent_buffers
from .hf import _dtype, _write_file, _Writer, check_out_dir

__all__ = ["save_adapters", "save_merged", "ADAPTER_FILE"]

ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's, beside its adapter_config.json


def _peft_model(model: nn.Module) -> Any:
    inner = unwrap_model(model)
    if not hasattr(inner, "peft_config"):
        raise ValueError(f"{type(inner).__name__} is not a PEFT model (peft.get_peft_model): it has no adapters to "
                         "export. Use fp8dist.save_pretrained for the whole model.")
    return inner


def _gathered(model: nn.Module, out: Path, keep: Any) -> dict[str, torch.Tensor]:
    """On rank 0, the full tensors whose plain names ``keep`` accepts (empty on the others); checks ``out`` first."""
    check_out_dir(out, f"exporting to {out}: checking it")
    return {names[0]: full for names, full in gather_full(model) if full is not None and keep(names[0])}


def save_adapters(model: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
                  base_model: str | None = None) -> Path:
    """Write the LoRA adapters of ``model`` (a wrapped PEFT model) into ``out_dir`` as PEFT does (``base_model``: the
    base's directory the config names). Call it on every rank; rank 0 writes.

    Example::

        save_adapters(model, "out")                       # after training, on every rank
        PeftModel.from_pretrained(base, "out")            # anywhere
    """
    inner, out, dtype = _peft_model(model), Path(out_dir), _dtype(dtype)
    # by name, as PEFT picks them: FSDP1's flat parameters hide which of their parameters train
    full = _gathered(model, out, lambda name: "lora_" in name)

    def write() -> list[str]:
        out.mkdir(parents=True, exist_ok=True)
        # PEFT's names drop the adapter's (as get_peft_model_state_dict, which misses FSDP1-wrapped adapters)
        tensors = {re.sub(r"\.(lora_[AB])\.default\.", r".\1.", k): v.to(dtype).contiguous() for k, v in full.items()}
        _write_file(out / ADAPTER_FILE, tensors)
        config = inner.peft_config["default"]
        if base_model is not None:
            config.base_model_name_or_path = str(base_model)
        config.save_pretrained(str(out))
        return [ADAPTER_FILE, "adapter_config.json"]

    _Writer(out, rank_world()[0]).run(f"writing {ADAPTER_FILE} into {out}", write)
    return out


def _merged(inner: Any, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict under its own names, each adapted weight W + scaling * B A (PEFT's merge)."""
    for name, module in inner.named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "scaling", {}):
            continue
        name = plain_name(name)  # FSDP1's and activation checkpointing's wrappers left out, as gather_full does
        weight = full.pop(f"{name}.base_layer.weight")
        a, b = full.pop(f"{name}.lora_A.default.weight"), full.pop(f"{name}.lora_B.default.weight")
        delta = module.scaling["default"] * (b.float() @ a.float())
        full[f"{name}.base_layer.weight"] = (weight.float() + (delta.t() if module.fan_in_fan_out else delta)
                                             ).to(weight.dtype)
    prefix = "base_model.model."
    return {k.removeprefix(prefix).replace(".base_layer.", "."): v for k, v in full.items()}


def save_merged(model: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype | str = torch.bfloat16) -> Path:
    """Write ``model`` (a wrapped PEFT LoRA model) with its adapters merged into the base weights, as a transformers
    model in ``dtype``. Call it on every rank; rank 0 holds the whole model in CPU memory while it writes."""
    from transformers import AutoModelForCausalLM

    inner, out, dtype = _peft_model(model), Path(out_dir), _dtype(dtype)
    full = _gathered(model, out, lambda name: True)
    full.update({n: b.detach().cpu() for n, b in persistent_buffers(inner).items()})  # every rank holds them whole

    def write() -> list[str]:
        merged = _merged(inner, full)
        base = inner.get_base_model().config
        with torch.device("meta"):
            target = AutoModelForCausalLM.from_config(base, dtype=dtype)
        keys = target.state_dict().keys()  # a tied weight is saved once, under the name the model keeps
        target.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()
                                if k in keys}, assign=True, strict=True)
        target.save_pretrained(str(out), safe_serialization=True)
        return [p.name for p in out.iterdir()]

    _Writer(out, rank_world()[0]).run(f"writing the merged model into {out}", write)
    return out
