"""A Hugging Face safetensors directory as fp8dist reads it (``pretrained=``): its files, index and tensor names,
each tensor read in part (safetensors' ``get_slice``), and the quantized layouts it can dequantize (FP8: fp8dist's
own export, compressed-tensors, transformers' fine-grained); :mod:`.pretrained` fills a model from it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from ..config.text import listing, plural
from ..strategies.local_shards import Region

__all__ = ["SafetensorsDir", "PretrainedError", "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
"""The index file of a sharded safetensors directory (tensor name -> shard file)."""
_SCALES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".activation_scale")  # inference's, beside FP8 weights
SINGLE_FILE = "model.safetensors"
"""The weights file of an unsharded directory."""
SHOWN = 5
"""How many names an error lists (mismatched or missing tensors, missing files) before "and N more"."""


class PretrainedError(ValueError):
    """A pretrained directory that is missing, malformed, or does not match the model (says what differs)."""


class SafetensorsDir:
    """A Hugging Face model directory's safetensors weights (one ``model.safetensors``, or shards named by
    ``model.safetensors.index.json``), read lazily: :meth:`read` returns only the part asked for.

    Opening ``SafetensorsDir(path)`` reads the index and every file's header (names, shapes, dtypes), no tensor;
    it raises :class:`PretrainedError` where ``path`` is not a directory, holds no safetensors, its index is
    unreadable or names missing files, or a file is damaged. :meth:`close` when done."""

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
                raise PretrainedError(f"pretrained={str(self.path)!r} holds FP8 tensors ({listing(fp8, SHOWN)}) but "
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
                                      f"{missing[:SHOWN]}. Copy the whole directory.")
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
            rows = fused.shape[1]
            rest = tuple((0, s) for s in fused.shape[2:])
            row = math.prod(fused.shape[2:])
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
        """Drop the open safetensors files (their memory maps). Call it when the model is filled; a later
        :meth:`read` opens its file again."""
        self._handles.clear()
