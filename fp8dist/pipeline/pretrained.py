"""Filling a sharded model from a Hugging Face safetensors directory (``pretrained=``), or a meta model by its own
initialization: each rank reads only its part of every tensor (safetensors' ``get_slice``), by the names the model
had before wrapping (:func:`fp8dist.strategies.local_shards.plain_name`; tied parameters by any of theirs)."""

from __future__ import annotations

import math
import os
import re
import warnings

import torch
from torch import nn

from ..config.text import listing, plural
from ..config.args import require_bool
from ..runtime.agree import on_all_ranks
from ..runtime.load_report import LoadReport
from ..config.dtypes import dtype_name
from .meta_init import init_weights
from ..strategies import unwrap_model
from ..runtime.names import plain_name
from ..strategies.local_shards import LocalParam, Region, local_params
from .safetensors_dir import SHOWN, INDEX_FILE, SINGLE_FILE, PretrainedError, SafetensorsDir

__all__ = ["persistent_buffers", "SafetensorsDir", "PretrainedError", "load_pretrained", "materialize",
           "INDEX_FILE", "SINGLE_FILE"]

def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of ``model`` a state dict holds (persistent ones), by their plain names (the engine's wrapper
    prefixes removed): what :func:`load_pretrained` fills and :func:`fp8dist.save_pretrained` writes."""
    buffers = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                buffers[plain_name(f"{prefix}.{name}" if prefix else name)] = buf
    return buffers


def _mismatches(source: SafetensorsDir, params: list[LocalParam], buffers: dict[str, torch.Tensor],
                ignore: list[str]) -> list[str]:
    def listed(kind: str, items: list[str]) -> list[str]:
        return [f"{plural(len(items), *kind)}: {listing(items, SHOWN)}"] if items else []

    missing = []
    shapes = []
    known = set()
    for p in params:
        known.update(p.names)
        found = [n for n in p.names if n in source]
        if not found:
            missing.append(p.names[0])
        elif source.shapes[found[0]] != p.checkpoint_shape:
            shapes.append(f"{found[0]} {list(source.shapes[found[0]])} in the checkpoint, {list(p.checkpoint_shape)} "
                          "in the model")
    for name, buf in buffers.items():
        known.add(name)
        if name in source and source.shapes[name] != tuple(buf.shape):
            shapes.append(f"{name} {list(source.shapes[name])} in the checkpoint, {list(buf.shape)} in the model")
    unexpected = [n for n in source.names() if n not in known and not any(re.search(pat, n) for pat in ignore)]
    return (listed(("shape mismatch",), shapes)
            + listed(("parameter missing from the checkpoint", "parameters missing from the checkpoint"), missing)
            + listed(("checkpoint tensor the model does not have", "checkpoint tensors the model does not have"),
                     unexpected))


def load_pretrained(model: nn.Module, path: str | os.PathLike, *, params: list[LocalParam] | None = None,
                    fp32_master: bool | None = None) -> LoadReport:
    """Fill this rank's part of every parameter (default :func:`~fp8dist.strategies.local_shards.local_params` of
    the wrapped ``model``) and the persistent buffers from the safetensors in ``path``, cast to their dtypes. Call it
    on every rank: PretrainedError on every rank for no safetensors, a damaged file, names or shapes that differ, or
    non-finite values. ``fp32_master``: whether the engine keeps fp32 masters of bf16 parameters (None: unknown)."""
    params = local_params(model) if params is None else params
    return on_all_ranks(f"loading pretrained={str(path)!r}", lambda: _load(model, path, params, fp32_master),
                        error=PretrainedError, passthrough=(PretrainedError,))


def _load(model: nn.Module, path: str | os.PathLike, params: list[LocalParam],
          fp32_master: bool | None) -> LoadReport:
    source = SafetensorsDir(path)
    inner = unwrap_model(model)
    buffers = persistent_buffers(inner)
    source.adopt_layout([n for p in params for n in p.names] + list(buffers),
                        getattr(getattr(inner, "config", None), "model_type", None))
    ignored = getattr(inner, "_keys_to_ignore_on_load_unexpected", None) or ()  # Hugging Face's: keys to ignore
    problems = _mismatches(source, params, buffers, list(ignored))
    if problems:
        raise PretrainedError(f"pretrained={str(path)!r} does not match {type(inner).__name__}: "
                              + "; ".join(problems) + ". Build the model from the config the checkpoint was saved "
                              "with (AutoConfig.from_pretrained(dir)), or pass the directory of this model's "
                              "checkpoint.")
    _warn_precision(source, params, fp32_master)
    held = []
    with torch.no_grad():
        for p in params:
            name = next(n for n in p.names if n in source)
            if p.local.dtype == torch.uint8 and name in source.quantized:
                held.append(name)  # the bits as stored, their bytes (a LoRA base held in FP8: pipeline.fp8_base)
                p.local.copy_(_finite(source, name, source.read_stored(name, p.region)).view(torch.uint8))
            elif p.region.numel:
                p.local.copy_(_finite(source, name, _read_local(source, name, p)))
        for name, buf in buffers.items():
            if name in source:
                buf.copy_(_finite(source, name, source.read(name, Region(box=tuple((0, s) for s in buf.shape)))))
    total = sum(math.prod(source.shapes[n]) * _itemsize(source.dtypes[n]) for n in source.names())
    report = LoadReport(str(path), source.bytes_read, total, _say_dequantized(source, params, held), len(held))
    source.close()
    return report


def _say_dequantized(source: SafetensorsDir, params: list[LocalParam], held: list[str]) -> str:
    """Warn, and return the phrase, that an FP8 checkpoint's weights (but ``held``) were dequantized once into the
    parameters."""
    dequantized = [n for n in source.quantized if n not in held]
    if not dequantized:
        return ""
    dtypes = sorted({dtype_name(p.local.dtype) for p in params if any(n in dequantized for n in p.names)})
    said = (f"{plural(len(dequantized), 'FP8 weight')} of the {source.quantization} checkpoint dequantized "
            f"once (e4m3 x scale) into the {'/'.join(dtypes)} parameters")
    warnings.warn(f"pretrained={str(source.path)!r}: {said}; they train from there in high precision, and an export "
                  "writes them again as --save-dtype says (fp8 re-quantizes the layers that ran FP8).", UserWarning,
                  stacklevel=4)
    return said


def _finite(source: SafetensorsDir, name: str, part: torch.Tensor) -> torch.Tensor:
    """``part`` of tensor ``name``, refused when it holds NaN or inf (a damaged file, a model saved diverged)."""
    if not part.is_floating_point():
        return part
    if part.element_size() == 1:  # FP8 bits, checked as bytes (no copy in fp32): their NaN (e5m2: and inf) patterns
        mask = 0x7F if part.dtype == torch.float8_e4m3fn else 0x7C
        bad = int(((part.view(torch.uint8) & mask) == mask).sum())
    else:
        bad = part.numel() - int(torch.isfinite(part).sum())
    if bad:
        raise PretrainedError(f"{source.file_of(name)} holds non-finite values (NaN or inf) in {name}: {bad:,} "
                              f"of the {part.numel():,} values read: the file is damaged, or the model had "
                              "diverged when it was saved. Load a copy saved before that, or copy the file again.")
    return part


def _warn_precision(source: SafetensorsDir, params: list[LocalParam], master: bool | None) -> None:
    """Warn once of bf16/fp16 parameters: without fp32 masters they train so, with them an fp32 checkpoint rounds."""
    low = {p.local.dtype for p in params if p.local.dtype in (torch.bfloat16, torch.float16)}
    if not low:
        return
    dtype = dtype_name(next(iter(low)))
    if master is False:
        warnings.warn(f"pretrained={str(source.path)!r} is loaded into {dtype} parameters (the model was built in "
                      f"{dtype}, e.g. from a config whose dtype is {dtype}): they train as {dtype} with no fp32 master "
                      "copy, so small updates round away. Build the model with dtype=torch.float32 "
                      "(AutoModelForCausalLM.from_config(config, dtype=torch.float32)); mixed precision still computes "
                      "in bf16.", UserWarning, stacklevel=4)
    elif master and any(source.dtypes.get(n) in ("F32", "F64") for p in params for n in p.names if n in source):
        warnings.warn(f"pretrained={str(source.path)!r} holds fp32 weights and DeepSpeed's {dtype} mode holds the "
                      f"parameters in {dtype} (its fp32 master weights, in the optimizer, start from them): the "
                      f"checkpoint is rounded to {dtype} once, as deepspeed.initialize rounds any model. "
                      "strategy='fsdp' keeps fp32 parameters (bf16 compute) if the fp32 values matter.",
                      UserWarning, stacklevel=4)


def _read_local(source: SafetensorsDir, name: str, p: LocalParam) -> torch.Tensor:
    """This rank's part of ``p`` from the checkpoint's tensor ``name``, shaped as ``p.local``; a transposed (out, in)
    parameter reads the transposed box of the (in, out) tensor, or for a flat range the columns that cover it."""
    if not p.transposed:
        return source.read(name, p.region).view(p.local.shape)
    if p.region.flat is None:
        return source.read(name, Region(box=p.region.box[::-1])).t().reshape(p.local.shape)
    _, in_features = p.shape
    start, stop = p.region.flat
    first, last = start // in_features, (stop - 1) // in_features + 1
    columns = source.read(name, Region(box=((0, in_features), (first, last - first))))
    return columns.t().reshape(-1)[start - first * in_features: stop - first * in_features]


def _itemsize(safetensors_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
            "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}.get(safetensors_dtype, 4)


def materialize(model: nn.Module, device: torch.device, pretrained: str | os.PathLike | None, *,
                meta: bool, fp32_master: bool | None = None) -> LoadReport | None:
    """Fill the sharded (or whole) ``model`` from ``pretrained``, or a meta model by its own initialization (its
    buffers either way). Call it on every rank, after the strategy has allocated its shards (the strategy's filler
    step in ``wrap_model``), before the optimizer is built.

    Args:
        model: the wrapped model, each rank holding its part (:func:`~fp8dist.strategies.local_shards.local_params`).
        device: where the model's own initialization runs at full size, one module at a time.
        pretrained: a Hugging Face safetensors directory; None: the model's own initialization only.
        meta: whether the model was built on the meta device: True runs its initialization (only the buffers with
            ``pretrained``); False with ``pretrained`` only loads.
        fp32_master: whether the engine keeps fp32 masters of bf16/fp16 parameters (DeepSpeed's optimizer): False
            warns that bf16 parameters train without them, True that an fp32 checkpoint rounds to bf16 once; None:
            unknown, no warning.

    Returns:
        The :class:`LoadReport` of ``pretrained``; None without one.

    Raises:
        PretrainedError: on every rank, as :func:`load_pretrained` says.
        ValueError: a meta model without ``pretrained`` holding parameters no initialization sets.
        TypeError: ``meta`` is not a bool.
    """
    require_bool("meta", meta)
    params = local_params(model)
    if meta:
        init_weights(model, device, params=params, buffers_only=pretrained is not None)
    if pretrained is None:
        return None
    return load_pretrained(model, pretrained, params=params, fp32_master=fp32_master)
