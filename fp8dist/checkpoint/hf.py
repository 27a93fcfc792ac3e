"""Export to Hugging Face: :func:`save_pretrained` writes a wrapped model as safetensors with ``config.json``, FP8
modules as their high-precision weights (or, ``dtype="fp8"``, as e4m3 weights with scales: :mod:`.fp8_export`),
gathered one parameter (FSDP1: one unit) at a time, under the names and in the layout transformers' own
``save_pretrained`` writes (:func:`hub_layout`: a Mixtral's experts one by one, as its Hub checkpoints hold them);
``AutoModelForCausalLM.from_pretrained(dir)`` and vLLM reload it."""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..runtime.files import atomic_write, atomic_write_text, check_output_path
from ..config.dtypes import DTYPE_ALIASES, DTYPES, torch_dtype
from ..pipeline.pretrained import INDEX_FILE, SINGLE_FILE, persistent_buffers
from ..strategies import unwrap_model
from ..strategies.local_shards import gather_full, local_params, original_class
from ..runtime.agree import on_all_ranks, rank_world
from .fp8_export import RECORD_FILE, write_record

__all__ = ["save_pretrained", "export_dtype", "remove_stale", "hub_layout", "MODEL_FILES", "ADAPTER_FILE",
           "ADAPTER_CONFIG"]

DEFAULT_MAX_SHARD_SIZE = "2GB"
FP8 = "fp8"
"""The export dtype that writes the Linears the plan ran in FP8 as e4m3 weights with scales
(:mod:`fp8dist.checkpoint.fp8_export`), the rest in bf16."""
_SAFETENSORS_DTYPES = {"BF16": "bf16", "F32": "fp32", "F16": "fp16", "F64": "fp32", "F8_E4M3": FP8}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _shard_bytes(size: int | str) -> int:
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size={size!r} is not a size: pass bytes (an int) or text such as '2GB', "
                         "'500MB', '1GiB'.")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The export dtype, from a torch dtype or a name of one ("bf16", "float32", ...)."""
    name = DTYPE_ALIASES.get(dtype.lower(), dtype.lower()) if isinstance(dtype, str) else None
    if dtype in DTYPES.values() or name in DTYPES:
        return dtype if isinstance(dtype, torch.dtype) else torch_dtype(name)
    raise ValueError(f"dtype={dtype!r} is not an export dtype; choose torch.bfloat16, torch.float32 or torch.float16 "
                     f"(or one of {', '.join(repr(n) for n in DTYPES)}).")


def export_dtype(save_dtype: str, pretrained: str | os.PathLike | None) -> str:
    """The dtype name ``--save-dtype`` writes: itself, or for "as-loaded" the floating dtype of most of the
    ``pretrained`` directory's weight elements (a fine-tune is saved as given; "fp8" for an FP8 checkpoint's e4m3
    weights), bf16 from scratch (how models are shared)."""
    if save_dtype != "as-loaded":
        return save_dtype
    if pretrained is None:
        return "bf16"
    from ..pipeline.pretrained import SafetensorsDir

    source, counts = SafetensorsDir(pretrained), Counter()
    for name, dtype in source.dtypes.items():
        if dtype in _SAFETENSORS_DTYPES:
            counts[_SAFETENSORS_DTYPES[dtype]] += math.prod(source.shapes[name])
    return max(counts, key=counts.get) if counts else "bf16"


def check_out_dir(out: Path, what: str) -> None:
    """Rank 0 checks that the directory ``out`` can be written before anything is gathered; every rank raises its
    ValueError. Collective: call it on every rank; ``what`` names the step in a rank failure's message."""
    check = (lambda: check_output_path(out, name="out_dir", directory=True)) if rank_world()[0] == 0 else None
    on_all_ranks(what, check, error=ValueError, passthrough=(ValueError,))


def _plan_files(entries: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Names grouped into files of at most ``limit`` bytes (a tensor larger than that gets a file of its own)."""
    files: list[list[str]] = [[]]
    size = 0
    for name, nbytes in entries:
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def is_fp8(dtype: Any) -> bool:
    """Whether an export's ``dtype`` is :data:`FP8`."""
    return isinstance(dtype, str) and dtype.lower() == FP8


def _write_config(inner: nn.Module, out: Path, dtype: torch.dtype, written: list[str],
                  quantization: dict[str, Any] | None = None) -> None:
    """config.json (with ``quantization``, the FP8 export's ``quantization_config``; none otherwise, also where the
    model was loaded from a quantized checkpoint) and generation_config.json."""
    config, generation = getattr(inner, "config", None), getattr(inner, "generation_config", None)
    if hasattr(config, "to_json_string"):
        config = copy.deepcopy(config)
        config.architectures = [original_class(inner).__name__]
        config.dtype = dtype
        if quantization is not None:
            config.quantization_config = quantization
        elif hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights written are not quantized
    for name, obj in (("config.json", config), ("generation_config.json", generation)):
        if hasattr(obj, "to_json_string"):
            atomic_write_text(out / name, obj.to_json_string())
            written.append(name)


ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's, for each adapter
ADAPTER_FILES = (ADAPTER_FILE, ADAPTER_CONFIG, "adapter_model.bin")
MODEL_FILES = ("model*.safetensors", INDEX_FILE, RECORD_FILE, *ADAPTER_FILES)
"""The files that make a folder a model to loaders (a Hugging Face model's weights, PEFT's adapters): an export
removes those it did not write."""


def _adapter_folders(out: Path) -> list[Path]:
    """Subfolders holding one PEFT adapter and nothing else (PEFT's place for an adapter other than "default"; a
    trainer's checkpoint folder holds more and is left alone)."""
    alone = (*ADAPTER_FILES, "README.md")  # PEFT writes a model card beside each adapter
    return [sub for sub in sorted(out.iterdir()) if sub.is_dir() and not sub.is_symlink()
            and (sub / ADAPTER_CONFIG).is_file() and all(f.name in alone for f in sub.iterdir())]


def remove_stale(out: Path, written: set[str]) -> None:
    """Remove the model files (:data:`MODEL_FILES`) of an earlier export into ``out`` that this one did not write
    (``written``: names relative to ``out``), and the adapter files of its adapter subfolders: a loader would read
    them with the new ones (transformers applies an ``adapter_config.json`` it finds to the weights beside it). Other
    files stay (a tokenizer). Call it on rank 0, once the export's own files are written."""
    found = [p for pattern in MODEL_FILES for p in out.glob(pattern)]
    found += [sub / name for sub in _adapter_folders(out) for name in ADAPTER_FILES]
    for path in found:
        if path.is_file() and path.relative_to(out).as_posix() not in written:
            path.unlink()
            if path.parent != out and not any(path.parent.iterdir()):
                path.parent.rmdir()


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype | str = torch.bfloat16,
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, fp8_format: str = "compressed-tensors") -> Path:
    """Write ``model`` (as :func:`fp8dist.wrap_model` returned it, or any module) as a Hugging Face directory, its
    tensors under the names and in the layout transformers' own ``save_pretrained`` writes (:func:`hub_layout`).

    Call it on every rank (the parameters are gathered collectively); rank 0 writes each file atomically. A
    failure removes this call's files and raises on every rank. Model files of an earlier export (weights, PEFT
    adapters: :func:`remove_stale`) that this one did not replace are removed; other files stay (a tokenizer).

    Args:
        model: the trained model; FP8 layers are written as their high-precision weights.
        out_dir: the directory (created if needed).
        dtype: torch.bfloat16 (default), torch.float32 or torch.float16; or "fp8": the Linears the plan ran in FP8
            as e4m3 weights with their scales in the layout ``fp8_format``, listed in config.json's
            ``quantization_config``, every other tensor (embeddings, norms, the Linears kept in high precision) in
            bf16; ``fp8_export.json`` records each FP8 layer's cast (training's own where the layout holds it). A
            model with no FP8 layer is written in bf16, with a warning.
        fp8_format: with dtype="fp8": "compressed-tensors" (float-quantized; per-tensor scales for tensorwise
            layers, per-channel for rowwise: training's cast; served by vLLM, loaded by transformers with the
            compressed-tensors package) or "fine-grained" (transformers' FineGrainedFP8, 128x128 block scales;
            transformers dequantizes it on a CPU).
        max_shard_size: largest file, in bytes or as text ("2GB"); larger models are split into shards and
            ``model.safetensors.index.json``. Rank 0 holds at most one file's tensors in CPU memory.

    Returns:
        The directory.

    Raises:
        ValueError: a dtype or fp8_format not among the choices, dtype="fp8" for a model wrap_model did not return,
            ``out_dir`` not writable (before anything is gathered).

    Example::

        fp8dist.save_pretrained(model, "out", dtype=torch.bfloat16)     # after training, on every rank
        AutoModelForCausalLM.from_pretrained("out")                       # anywhere, no fp8dist needed
    """
    fp8 = None
    if is_fp8(dtype):
        from .fp8_export import plan_fp8_export

        fp8, dtype = plan_fp8_export(model, fp8_format), torch.bfloat16
        fp8 = fp8 if fp8.layers else None
    dtype, limit = _dtype(dtype), _shard_bytes(max_shard_size)
    out = Path(out_dir)
    rank = rank_world()[0]
    check_out_dir(out, f"fp8dist.save_pretrained: checking {out}")
    inner = unwrap_model(model)
    buffers = persistent_buffers(inner).items()
    size = torch.tensor([], dtype=dtype).element_size()
    entries = [(p.names[0], math.prod(p.shape) * (1 if fp8 and p.names[0].removesuffix(".weight") in fp8.layers
                                                   else size)) for p in local_params(model)]
    entries += [(name, buf.numel() * (size if buf.is_floating_point() else buf.element_size()))
                for name, buf in buffers]
    files = _plan_files(entries, limit)
    names = [SINGLE_FILE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                                   for i in range(len(files))]
    closes = {group[-1]: names[i] for i, group in enumerate(files)}  # the tensor that completes each file
    writer = _Writer(out, rank)
    writer.run(f"creating {out}", lambda: out.mkdir(parents=True, exist_ok=True) or [])
    pending: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}  # each name written (transformers' checkpoint names) -> its file
    tensors = ((names[0], full) for names, full in gather_full(model))
    held = ((n, buf.detach().cpu() if rank == 0 else None) for n, buf in buffers)
    for name, full in itertools.chain(tensors, held):
        if rank == 0 and fp8 is not None:
            pending.update(fp8.quantize(name, full))
        elif rank == 0:
            pending[name] = (full.to(dtype) if full.is_floating_point() else full).contiguous()
        if name in closes:
            writer.run(f"writing {out / closes[name]}", lambda: _write_file(out / closes[name], pending, inner,
                                                                              weight_map))
            pending = {}

    def finish() -> list[str]:  # what it writes is recorded as it goes: a failure removes it too
        if len(names) > 1:
            index = {"metadata": {"total_size": sum(n for _, n in entries)}, "weight_map": weight_map}
            atomic_write_text(out / INDEX_FILE, json.dumps(index, indent=2, sort_keys=True) + "\n")
            writer.written.append(INDEX_FILE)
        if fp8 is not None:
            write_record(out, fp8)
            writer.written.append(RECORD_FILE)
        _write_config(inner, out, dtype, writer.written, fp8.quantization_config() if fp8 is not None else None)
        remove_stale(out, set(writer.written))
        return []

    writer.run(f"writing {INDEX_FILE} and config.json into {out}", finish)  # every rank returns once it is complete
    return out


class _Writer:
    """Rank 0 writes; every rank learns whether it worked (else the others would wait in the next gather). A failure
    removes this export's files and raises on every rank."""

    def __init__(self, out: Path, rank: int):
        self.out, self.rank = out, rank
        self.written: list[str] = []

    def run(self, what: str, write) -> None:
        try:
            self.written += on_all_ranks(f"fp8dist.save_pretrained: {what}", write if self.rank == 0 else None,
                                         error=OSError, way_out=f"Nothing of this export was kept in {self.out}.") \
                or []
        except OSError:
            if self.rank == 0:
                for name in self.written:
                    (self.out / name).unlink(missing_ok=True)
            raise


def hub_layout(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (entries of ``model``'s state dict, under its names) under the names and in the layout
    transformers' own ``save_pretrained`` writes them: transformers 5 holds some families' weights otherwise than
    their checkpoints do (a Mixtral's experts stacked in 3-D ``mlp.experts.gate_up_proj``, the checkpoints'
    ``block_sparse_moe.experts.E.w1.weight`` per expert) and reverts that on saving (its
    ``revert_weight_conversion``, with the mapping the model was loaded with or its family's); vLLM's own model
    classes read only the checkpoints' names. Each tensor must come with the others its reverted ones are made of
    (transformers reverts its fused tensors one source each). Unchanged where ``model`` is no transformers model,
    or its transformers has no such conversion (before 5)."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    if not isinstance(model, PreTrainedModel):
        return tensors
    return {name: t.contiguous() for name, t in revert_weight_conversion(model, tensors).items()}


def _write_file(path: Path, tensors: dict[str, torch.Tensor], model: nn.Module | None = None,
                weight_map: dict[str, str] | None = None) -> list[str]:
    """Write ``tensors`` (in ``model``'s layout: :func:`hub_layout`; None: as named) into the safetensors file
    ``path`` atomically, each name written added to ``weight_map`` with the file's name."""
    from safetensors.torch import save_file

    tensors = hub_layout(model, tensors) if model is not None else tensors
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    if weight_map is not None:
        weight_map.update(dict.fromkeys(tensors, path.name))
    return [path.name]
