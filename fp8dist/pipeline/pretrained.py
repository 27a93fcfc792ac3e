"""Filling a sharded model from a Hugging Face safetensors directory (``pretrained=``), or a meta model by its own
initialization: each rank reads only its part of every tensor (safetensors' ``get_slice``), by the names the model
had before wrapping (:func:`fp8dist.strategies.local_shards.plain_name`; tied parameters by any of theirs)."""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config.text import listing, plural
from ..config.args import require_bool
from .agree import on_all_ranks
from ..config.dtypes import dtype_name
from .meta_init import init_weights
from ..strategies import unwrap_model
from ..strategies.local_shards import LocalParam, Region, local_params, plain_name

__all__ = ["persistent_buffers", "SafetensorsDir", "PretrainedError", "LoadReport", "load_pretrained", "materialize",
           "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
_SCALES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".activation_scale")  # inference's, beside FP8 weights
SINGLE_FILE = "model.safetensors"
_SHOWN = 5  # mismatches listed in an error


class PretrainedError(ValueError):
    """A pretrained directory that is missing, malformed, or does not match the model (says what differs)."""


class SafetensorsDir:
    """A Hugging Face model directory's safetensors weights (one ``model.safetensors``, or shards named by
    ``model.safetensors.index.json``), read lazily: :meth:`read` returns only the part asked for."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.bytes_read = 0  # tensor bytes read so far
        if not self.path.is_dir():
            raise PretrainedError(f"pretrained={str(path)!r} is not a directory. Pass a Hugging Face model "
                                  "directory (model.safetensors, or model-0000x-of-0000y.safetensors + "
                                  f"{INDEX_FILE}), e.g. one written by model.save_pretrained() or "
                                  "fp8dist.save_pretrained().")
        self._handles: dict[str, Any] = {}
        self._files = self._weight_files()
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for name, file in self._files.items():
            piece = self._open(file).get_slice(name)
            self.shapes[name], self.dtypes[name] = tuple(piece.get_shape()), piece.get_dtype()
        self._aliases: dict[str, Any] = {}  # a model's name -> the files' older name, or a hf_layouts.FusedExperts
        self._scale_shapes: dict[str, tuple[int, ...]] = {}
        self.quantized: dict[str, tuple[str, str]] = {}
        """An FP8 weight's name -> (its scale's name, the scale's granularity): read dequantized."""
        self.quantization: str | None = None
        """The checkpoint's FP8 layout (:data:`fp8dist.fp8.hf_format.FP8_FORMATS`); None: not quantized."""
        self._adopt_quantization()

    def adopt_layout(self, wanted: list[str], model_type: str | None) -> None:
        """Let the names of ``wanted`` that the files hold in ``model_type``'s older layout (:mod:`.hf_layouts`) be
        found, shaped and read as the model names them, in place of the files' own names."""
        from .hf_layouts import resolve

        for name, found in resolve(wanted, self.shapes, self.dtypes, model_type).items():
            self._aliases[name] = found
            sources = [found] if isinstance(found, str) else [n for expert in found.parts for n in expert]
            self.shapes[name] = self.shapes[found] if isinstance(found, str) else found.shape
            self.dtypes[name] = self.dtypes[found] if isinstance(found, str) else found.dtype
            for source in sources:
                self.shapes.pop(source, None), self.dtypes.pop(source, None)

    def _adopt_quantization(self) -> None:
        """Read config.json's ``quantization_config``: FP8 weights with their scales are read dequantized (the scales
        and any activation scales are no tensors of the model); PretrainedError for a kind fp8dist cannot read, or
        FP8 tensors that nothing says how to scale."""
        from ..fp8.hf_format import READ_KINDS, granularity_of_scale, read_layout

        layout = read_layout(self._config())
        reads = "; ".join(READ_KINDS)
        if isinstance(layout, str):
            raise PretrainedError(f"pretrained={str(self.path)!r} is quantized as {layout} (config.json's "
                                  f"quantization_config), which fp8dist cannot read; it reads: {reads}. Pass the "
                                  "model's bf16 or fp32 checkpoint.")
        fp8 = [n for n, d in self.dtypes.items() if d.startswith("F8_")]
        if layout is None:
            if fp8:
                raise PretrainedError(f"pretrained={str(self.path)!r} holds FP8 tensors ({listing(fp8, _SHOWN)}) but "
                                      "its config.json has no quantization_config saying how they are scaled; "
                                      f"fp8dist reads: {reads}. Add the quantization_config the checkpoint was "
                                      "written with, or pass its bf16 or fp32 checkpoint.")
            return
        for name in fp8:
            scale = layout.scale_of(name)
            if scale not in self.shapes or len(self.shapes[name]) != 2:
                what = f"{scale} is missing" if scale not in self.shapes else f"it has {len(self.shapes[name])} dims"
                raise PretrainedError(f"pretrained={str(self.path)!r}: the FP8 tensor {name} cannot be dequantized "
                                      f"({what}; fp8dist reads 2-D FP8 weights, each with its {scale.rsplit('.')[-1]})."
                                      " Pass the model's bf16 or fp32 checkpoint.")
            self.quantized[name] = (scale, granularity_of_scale(self.shapes[name], self.shapes[scale]))
        for name in [n for n in self.shapes if n.endswith(_SCALES)]:  # no tensors of the model
            self._scale_shapes[name] = self.shapes.pop(name)
            self.dtypes.pop(name)
        self.quantization = layout.fmt

    def _config(self) -> dict[str, Any] | None:
        path = self.path / "config.json"
        try:
            return json.loads(path.read_text()) if path.is_file() else None
        except (OSError, json.JSONDecodeError) as err:
            raise PretrainedError(f"{path} is not readable JSON ({err}): fix it, or write the directory again with "
                                  "save_pretrained.") from None

    def _weight_files(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise PretrainedError(f"{index} is not a safetensors index (no readable 'weight_map': {err}). "
                                      "Write the directory again with save_pretrained.") from None
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                verb = "is" if len(missing) == 1 else "are"
                raise PretrainedError(f"{index} names {plural(len(missing), 'file')} that {verb} not in {self.path}: "
                                      f"{missing[:_SHOWN]}. Copy the whole directory.")
            return dict(weight_map)
        if (self.path / SINGLE_FILE).is_file():
            return {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}
        there = sorted(p.name for p in self.path.iterdir())[:8]
        raise PretrainedError(f"pretrained={str(self.path)!r} holds no safetensors weights ({SINGLE_FILE} or "
                              f"{INDEX_FILE}); it has {there or 'nothing'}. fp8dist reads safetensors only (no "
                              "pickled .bin files): convert with model.save_pretrained(dir, safe_serialization=True) "
                              "or fp8dist.save_pretrained().")

    def _open(self, file: str) -> Any:
        from safetensors import SafetensorError, safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(self.path / file), framework="pt")
            except (SafetensorError, OSError) as err:
                raise PretrainedError(f"{self.path / file} is not a readable safetensors file ({err}): it is truncated "
                                      "or damaged. Copy it again, or write the directory again with "
                                      "save_pretrained.") from None
        return self._handles[file]

    def file_of(self, name: str) -> Path:
        """The file that holds tensor ``name`` (of a fused experts tensor, the file of its first part)."""
        found = self._aliases.get(name, name)
        source = found if isinstance(found, str) else found.parts[0][0]
        return self.path / self._files[source]

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def names(self) -> list[str]:
        """The tensors' names, as the model names them where :meth:`adopt_layout` mapped an older layout."""
        return list(self.shapes)

    def read(self, name: str, region: Region) -> torch.Tensor:
        """The ``region`` of tensor ``name``: a box (as its shape), or a flat range (1-D, reading only the rows that
        cover it)."""
        found = self._aliases.get(name, name)
        if isinstance(found, str):
            return self._read_file(found, region, self.shapes[name])
        return self._read_fused(found, region)

    def _read_fused(self, fused: Any, region: Region) -> torch.Tensor:
        """A region of a fused experts tensor, read from the rows of each expert's tensors that fall in it."""
        if region.flat is not None:  # the rows (dim 1) that cover the range, expert by expert
            if region.numel == 0:
                return torch.empty(0)
            rows, rest, row = fused.shape[1], tuple((0, s) for s in fused.shape[2:]), math.prod(fused.shape[2:])
            start, stop = region.flat
            first, last = start // row, (stop - 1) // row + 1
            pieces = []
            for e in range(first // rows, (last - 1) // rows + 1):
                lo, hi = max(first, e * rows) - e * rows, min(last, (e + 1) * rows) - e * rows
                pieces.append(self._read_fused(fused, Region(box=((e, 1), (lo, hi - lo), *rest))).reshape(-1))
            return torch.cat(pieces)[start - first * row: stop - first * row]
        (e0, experts), (r0, rows), *rest = region.box
        stacked = []
        for expert in fused.parts[e0:e0 + experts]:
            pieces, offset = [], 0
            for source, length in zip(expert, fused.rows):
                lo, hi = max(r0, offset), min(r0 + rows, offset + length)
                if lo < hi:
                    box = ((lo - offset, hi - lo), *rest)
                    pieces.append(self._read_file(source, Region(box=box), (length, *fused.shape[2:])))
                offset += length
            stacked.append(torch.cat(pieces))
        return torch.stack(stacked)

    def read_stored(self, name: str, region: Region) -> torch.Tensor:
        """The ``region`` (a box) of FP8 weight ``name`` as the file stores it: its e4m3 bits, not dequantized."""
        return self._read_raw(name, region, self.shapes[name])

    def scale_of(self, name: str) -> torch.Tensor:
        """The whole fp32 scale of FP8 weight ``name`` (what dequantizes its bits)."""
        scale = self.quantized[name][0]
        shape = self._scale_shapes[scale]
        return self._read_raw(scale, Region(box=tuple((0, s) for s in shape)), shape).float()

    def _read_dequantized(self, name: str, region: Region, shape: tuple[int, ...]) -> torch.Tensor:
        """A region of FP8 weight ``name``, as fp32 values: its e4m3 bits times its scales (a flat range: the rows
        that cover it)."""
        from ..fp8.hf_format import dequantize

        if region.flat is not None:
            if region.numel == 0:
                return torch.empty(0)
            cols = shape[1]
            start, stop = region.flat
            first, last = start // cols, (stop - 1) // cols + 1
            rows = self._read_dequantized(name, Region(box=((first, last - first), (0, cols))), shape)
            return rows.reshape(-1)[start - first * cols: stop - first * cols]
        scale_name, granularity = self.quantized[name]
        scale_shape = self._scale_shapes[scale_name]
        scale = self._read_raw(scale_name, Region(box=tuple((0, s) for s in scale_shape)), scale_shape)
        bits = self._read_raw(name, region, shape)
        return dequantize(bits, scale, granularity, (region.box[0][0], region.box[1][0]))

    def _read_file(self, name: str, region: Region, shape: tuple[int, ...]) -> torch.Tensor:
        if name in self.quantized:
            return self._read_dequantized(name, region, shape)
        return self._read_raw(name, region, shape)

    def _read_raw(self, name: str, region: Region, shape: tuple[int, ...]) -> torch.Tensor:
        piece = self._open(self._files[name]).get_slice(name)
        if region.flat is None:
            out = piece[tuple(slice(start, start + length) for start, length in region.box)] if shape else piece[:]
        elif region.numel == 0:
            return torch.empty(0)
        else:
            start, stop = region.flat
            row = math.prod(shape[1:])
            first, last = start // row, (stop - 1) // row + 1
            rows = piece[first:last] if shape else piece[:]
            out = rows.reshape(-1)[start - first * row: stop - first * row]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self._handles.clear()


@dataclass(frozen=True)
class LoadReport:
    """What loading a pretrained directory read on this rank."""

    path: str
    bytes_read: int
    """Tensor bytes this rank read from the files."""
    checkpoint_bytes: int
    """Tensor bytes of the whole checkpoint."""
    dequantized: str = ""
    """What of an FP8 checkpoint was dequantized into the parameters ("" for none), as said in a warning."""
    held_fp8: int = 0
    """FP8 weights kept as the checkpoint's e4m3 bits (a LoRA base loaded in FP8: :mod:`.fp8_base`)."""


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds, by their plain (unwrapped) names."""
    return {plain_name(f"{prefix}.{name}" if prefix else name): buf
            for prefix, module in model.named_modules() for name, buf in module._buffers.items()
            if buf is not None and name not in module._non_persistent_buffers_set}


def _mismatches(source: SafetensorsDir, params: list[LocalParam], buffers: dict[str, torch.Tensor],
                ignore: list[str]) -> list[str]:
    def listed(kind: str, items: list[str]) -> list[str]:
        return [f"{plural(len(items), *kind)}: {listing(items, _SHOWN)}"] if items else []

    missing, shapes, known = [], [], set()
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
    buffers either way)."""
    require_bool("meta", meta)
    params = local_params(model)
    if meta:
        init_weights(model, device, params=params, buffers_only=pretrained is not None)
    if pretrained is None:
        return None
    return load_pretrained(model, pretrained, params=params, fp32_master=fp32_master)
