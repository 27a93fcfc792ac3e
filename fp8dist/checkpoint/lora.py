"""Export of a PEFT LoRA model trained under :func:`fp8dist.wrap_model`: the adapters in PEFT's format
(:func:`save_adapters`) or the base with the adapters merged (:func:`save_merged`). Every rank gathers the full
tensors (FSDP2, FSDP1, ZeRO-3 alike); rank 0 writes. Either export removes the model files of an earlier one it did
not write (:func:`~fp8dist.checkpoint.hf.remove_stale`)."""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..runtime.agree import rank_world
from ..strategies import unwrap_model
from ..runtime.names import plain_name
from ..strategies.local_shards import gather_full
from ..pipeline.pretrained import persistent_buffers
from ..pipeline.pretrained import SINGLE_FILE
from .fp8_export import RECORD_FILE, plan_fp8_export, write_record
from .hf import ADAPTER_CONFIG, ADAPTER_FILE, _dtype, _write_config, _write_file, _Writer, check_out_dir, is_fp8, \
    remove_stale

__all__ = ["save_adapters", "save_merged", "ADAPTER_FILE"]

_SAVED = ("lora_", ".modules_to_save.")  # what an adapter's file holds, by name: FSDP1 hides what trains


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


def _check_exportable(inner: Any, out: Path, base_model: str | None) -> None:
    """ValueError before anything is gathered for an adapter this export cannot write as PEFT does, or an ``out``
    that is the base's own folder (its weights would be removed as an earlier export's)."""
    biases = any(n.endswith("bias") for n, _ in inner.named_parameters())  # what bias="all"/"lora_only" would add
    for name, config in inner.peft_config.items():
        kind = getattr(config.peft_type, "value", config.peft_type)
        if kind != "LORA" or (biases and getattr(config, "bias", "none") != "none"):
            what = f"peft_type {kind!r}" if kind != "LORA" else f"bias={config.bias!r}"
            raise ValueError(f"save_adapters: adapter {name!r} has {what}; fp8dist exports LoRA adapters that train no "
                             "bias. Export the whole model instead (save_merged, or fp8dist.save_pretrained).")
    if base_model is not None and Path(base_model).resolve() == out.resolve():
        raise ValueError(f"save_adapters: out_dir {str(out)!r} is the base model's folder (base_model): the export "
                         "removes the model weights it finds there. Write the adapters into a folder of their own.")


def _adapter_tensors(full: dict[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    """One adapter's tensors under PEFT's names (get_peft_model_state_dict's, which misses FSDP1-wrapped adapters):
    the adapter's name dropped, a DoRA magnitude without its ``.weight``, a module to save under the module's name."""
    lora = re.compile(rf"\.(lora_\w+)\.{re.escape(adapter)}(?=\.|$)")
    to_save = f".modules_to_save.{adapter}."
    tensors = {}
    for key, value in full.items():
        if to_save in key:
            tensors[key.replace(to_save, ".")] = value
        elif lora.search(key):
            name = lora.sub(r".\1", key)
            tensors[name.removesuffix(".weight") if name.endswith(".lora_magnitude_vector.weight") else name] = value
    return tensors


def save_adapters(model: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
                  base_model: str | None = None) -> Path:
    """Write the LoRA adapters of ``model`` (a wrapped PEFT model) into ``out_dir`` as PEFT's ``save_pretrained``
    does: the adapter "default" in ``out_dir`` itself, each other one in a subfolder of its name, each with its own
    ``adapter_config.json`` (``base_model``: the base's directory it names) and its modules to save. Model files of
    an earlier export there are removed (:func:`~fp8dist.checkpoint.hf.remove_stale`). Call it on every rank; rank 0
    writes.

    Raises:
        ValueError: before anything is gathered: not a PEFT model, an adapter that is not LoRA or trains biases of
            the model, ``out_dir`` the ``base_model`` folder or not writable.

    Example::

        save_adapters(model, "out")                       # after training, on every rank
        PeftModel.from_pretrained(base, "out")            # anywhere; model.load_adapter("out/NAME", "NAME")
    """
    inner = _peft_model(model)
    out = Path(out_dir)
    dtype = _dtype(dtype)
    _check_exportable(inner, out, base_model)
    full = _gathered(model, out, lambda name: any(mark in name for mark in _SAVED))
    writer = _Writer(out, rank_world()[0])

    def write() -> list[str]:
        for adapter, config in inner.peft_config.items():
            where = Path(".") if adapter == "default" else Path(adapter)  # PEFT's layout
            (out / where).mkdir(parents=True, exist_ok=True)
            tensors = {k: v.to(dtype).contiguous() for k, v in _adapter_tensors(full, adapter).items()}
            _write_file(out / where / ADAPTER_FILE, tensors)
            writer.written.append((where / ADAPTER_FILE).as_posix())  # recorded as written: a failure removes it
            config = copy.copy(config)  # the model's own keeps its base name
            if base_model is not None:
                config.base_model_name_or_path = str(base_model)
            config.save_pretrained(str(out / where))
            writer.written.append((where / ADAPTER_CONFIG).as_posix())
        remove_stale(out, set(writer.written))
        return []

    writer.run(f"writing {ADAPTER_FILE} into {out}", write)
    return out


def _check_mergeable(inner: Any) -> None:
    """ValueError before anything is gathered unless the model holds one adapter, "default", that a plain merge
    reproduces (W + scaling * B A): DoRA rescales each row by its magnitude, which this merge does not apply."""
    configs = inner.peft_config
    if list(configs) != ["default"]:
        raise ValueError(f"save_merged: the model holds the adapters {', '.join(map(repr, configs))}; fp8dist merges "
                         "one, 'default'. Export them with save_adapters (one folder each, as PEFT does), or delete "
                         "the others (model.delete_adapter) before wrap_model.")
    if getattr(configs["default"], "use_dora", False):
        raise ValueError("save_merged: the adapter 'default' is DoRA (use_dora=True), whose magnitudes this merge does "
                         "not apply. Export it with save_adapters and merge with PEFT (merge_and_unload).")


def _dequantize_held(inner: Any, full: dict[str, torch.Tensor]) -> None:
    """Replace in ``full`` the weights of a base held in FP8 (:mod:`fp8dist.pipeline.fp8_base`) by their fp32 values
    (bits times scale): what a merge adds to and an export writes."""
    from ..fp8.hf_format import SCALE_ATTR, dequantize, granularity_of_scale

    for name, param in inner.named_parameters():
        scale = getattr(param, SCALE_ATTR, None)
        name = plain_name(name)
        if scale is not None and name in full:
            full[name] = dequantize(full[name], scale.cpu(), granularity_of_scale(tuple(param.shape),
                                                                                  tuple(scale.shape)))


def _merged(inner: Any, full: dict[str, torch.Tensor], adapted: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The base model's state dict under its own names: each adapted weight W + scaling * B A (PEFT's merge), each
    module to save as trained (its frozen original left out); ``adapted`` collects the merged weights' names. A base
    held in FP8 is merged from its values (bits times scale)."""
    _dequantize_held(inner, full)
    for name, module in inner.named_modules():
        if not hasattr(module, "lora_A") or "default" not in getattr(module, "scaling", {}):
            continue
        name = plain_name(name)  # FSDP1's and activation checkpointing's wrappers left out, as gather_full does
        weight = full.pop(f"{name}.base_layer.weight")
        a, b = full.pop(f"{name}.lora_A.default.weight"), full.pop(f"{name}.lora_B.default.weight")
        delta = module.scaling["default"] * (b.float() @ a.float())
        full[f"{name}.base_layer.weight"] = (weight.float() + (delta.t() if module.fan_in_fan_out else delta)
                                             ).to(weight.dtype)
        if adapted is not None:
            adapted.add(f"{name.removeprefix('base_model.model.')}.weight")
    prefix = "base_model.model."
    return {k.removeprefix(prefix).replace(".base_layer.", ".").replace(".modules_to_save.default.", "."): v
            for k, v in full.items() if ".original_module." not in k}


def save_merged(model: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype | str = torch.bfloat16,
                fp8_format: str = "compressed-tensors") -> Path:
    """Write ``model`` (a wrapped PEFT LoRA model) with its adapters merged into the base weights, as a transformers
    model in ``dtype``; model files of an earlier export there (an adapter a loader would apply again) are removed
    (:func:`~fp8dist.checkpoint.hf.remove_stale`). Call it on every rank; rank 0 holds the whole model in CPU memory
    while it writes. ``dtype="fp8"``: merged in fp32, then the layers the plan ran in FP8 quantized as
    :func:`fp8dist.save_pretrained` writes them (``fp8_format``), each merged layer's relative quantization error in
    ``fp8_export.json``.

    Raises:
        ValueError: before anything is gathered: not a PEFT model, adapters other than one "default", a DoRA adapter
            (export those with :func:`save_adapters`), a dtype or fp8_format not among the choices, or ``out_dir``
            not writable.
    """
    inner, out = _peft_model(model), Path(out_dir)
    _check_mergeable(inner)
    if is_fp8(dtype):
        return _save_merged_fp8(model, inner, out, fp8_format)
    from transformers import AutoModelForCausalLM

    dtype = _dtype(dtype)
    full = _gathered(model, out, lambda name: True)
    full.update({n: b.detach().cpu() for n, b in persistent_buffers(inner).items()})  # every rank holds them whole
    writer = _Writer(out, rank_world()[0])

    def write() -> list[str]:
        merged = _merged(inner, full)
        base = inner.get_base_model().config
        with torch.device("meta"):
            target = AutoModelForCausalLM.from_config(base, dtype=dtype)
        keys = target.state_dict().keys()  # a tied weight is saved once, under the name the model keeps
        target.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in merged.items()
                                if k in keys}, assign=True, strict=True)
        out.mkdir(parents=True, exist_ok=True)
        for leftover in out.glob(".tmp-merged-*"):  # of an export killed while writing
            shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-merged-", dir=out))  # what transformers writes, by name
        try:
            target.save_pretrained(str(staging), safe_serialization=True)
            for file in sorted(staging.iterdir()):
                os.replace(file, out / file.name)
                writer.written.append(file.name)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        remove_stale(out, set(writer.written))
        return []

    writer.run(f"writing the merged model into {out}", write)
    return out


def _save_merged_fp8(model: nn.Module, inner: Any, out: Path, fp8_format: str) -> Path:
    """:func:`save_merged` with ``dtype="fp8"``: one ``model.safetensors``, config.json with its
    ``quantization_config``, and the export's record."""
    from transformers import AutoModelForCausalLM

    export = plan_fp8_export(model, fp8_format, prefix="base_model.model.")
    full = _gathered(model, out, lambda name: True)
    full.update({n: b.detach().cpu() for n, b in persistent_buffers(inner).items()})
    writer = _Writer(out, rank_world()[0])
    base = inner.get_base_model()

    def write() -> list[str]:
        adapted: set[str] = set()
        merged = _merged(inner, full, adapted)
        with torch.device("meta"):
            keys = AutoModelForCausalLM.from_config(base.config).state_dict().keys()  # a tied weight once
        tensors: dict[str, torch.Tensor] = {}
        for name in keys:
            if name in merged:
                value = merged[name]
                tensors.update(export.quantize(name, value, value if name in adapted else None))
        out.mkdir(parents=True, exist_ok=True)
        writer.written += _write_file(out / SINGLE_FILE, tensors, base)
        if export.layers:
            write_record(out, export)
            writer.written.append(RECORD_FILE)
        _write_config(base, out, torch.bfloat16, writer.written,
                      export.quantization_config() if export.layers else None)
        remove_stale(out, set(writer.written))
        return []

    writer.run(f"writing the merged FP8 model into {out}", write)
    return out
