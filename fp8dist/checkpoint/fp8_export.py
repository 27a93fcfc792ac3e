"""What an FP8 export (``save_pretrained(..., dtype="fp8")``) writes for each Linear: the layers the plan ran in FP8
as e4m3 weights with their scales (:mod:`fp8dist.fp8.hf_format`), in training's own weight cast where the layout
can hold it, every other tensor in bf16; and the record of what it did (``fp8_export.json`` beside the weights).

A group of Linears a server fuses into one layer (:mod:`.fused_groups`: q/k/v, gate/up) is written in one scheme, as
vLLM requires: where the plan kept one member in high precision, the whole group is written in bf16 (a layer training
ran in bf16 is never quantized: the served FP8 bits are those training multiplied with), each such layer recorded
with its group and the member kept; where the members' casts differ in granularity (per tensor and per channel under
``torchao_recipe="auto"``), the group is written per channel, a per-tensor cast keeping its bits, its one scale
repeated per row.

A module other than a Linear that a loader quantizes by its own rule (:mod:`.loader_quantized`: a model's experts) is
written in bf16 and listed as not converted, under the name each loader matches, with the reason in the record."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..config.text import listing
from ..fp8.hf_format import BLOCK, FORMAT_LOADERS, FP8_FORMATS, Granularity, quantization_config, quantize_weight, \
    scale_name
from .fused_groups import fused_groups
from ..pipeline.hf_layouts import checkpoint_names
from .loader_quantized import ModuleBf16, loader_quantized

if TYPE_CHECKING:
    from ..plan.precision import PlanEntry

__all__ = ["FP8Layer", "FusedBf16", "FP8Export", "plan_fp8_export", "check_fp8_format", "fp8_summary", "RECORD_FILE"]

RECORD_FILE = "fp8_export.json"
"""The export's record: per FP8 layer its cast and whether it is training's, and (LoRA) the merge's error; the Linears
written in bf16, and those of them written so for their fused group; the other modules listed as not converted
(experts), with their names in the list and why they are bf16."""

_GRANULARITY = {"tensorwise": "tensor", "rowwise": "channel"}  # a training weight cast a layout holds exactly


@dataclass(frozen=True)
class FP8Layer:
    """How one Linear's weight is written in FP8."""

    granularity: Granularity
    """What one scale covers: the tensor, an output channel (a row), or a 128x128 block."""
    pow2: bool
    """Scales rounded down to a power of 2 (torchao's rowwise recipes)."""
    cast: str
    """What the bits are: "training's tensorwise cast", or a cast made for the export (and why)."""
    merge_error: float | None = None
    """LoRA merged: ||W_fp8 - W|| / ||W|| of the merged weight W; None: no adapter merged."""
    cast_granularity: Granularity | None = None
    """What the cast's one scale covers where it differs from ``granularity`` (the scale written): "tensor" for a
    per-tensor cast written per channel (its fused group is); None: the same."""


@dataclass(frozen=True)
class FusedBf16:
    """A Linear the plan ran in FP8, written in bf16 because the plan kept another member of its fused group in high
    precision (a server runs the group as one layer in one scheme)."""

    group: str
    """The fused layer a server loads it into, e.g. "model.layers.0.self_attn.qkv_proj"."""
    kept_by_plan: tuple[str, ...]
    """The group's members the plan ran in high precision."""
    trained: str
    """How it would have been written in FP8 (:attr:`FP8Layer.cast`, which names training's cast)."""


def check_fp8_format(fp8_format: str) -> None:
    """ValueError naming ``fp8_format`` and the layouts when it is not one of :data:`FP8_FORMATS`."""
    if fp8_format not in FP8_FORMATS:
        raise ValueError(f"fp8_format={fp8_format!r} is not an FP8 checkpoint layout; choose one of "
                         + ", ".join(f"{f!r} (read by {FORMAT_LOADERS[f]})" for f in FP8_FORMATS) + ".")


def _layer(spec: Any, fmt: str) -> FP8Layer:
    """The write of a layer whose training cast its weight with ``spec`` (a CastSpec, or None: not modelled)."""
    scaling = getattr(spec, "scaling", None)
    if fmt == "fine-grained":
        return FP8Layer("block", False, f"128x128 blocks cast for the export (training's: {scaling or 'unknown'})")
    if scaling in _GRANULARITY:
        return FP8Layer(_GRANULARITY[scaling], spec.pow2, f"training's {scaling} cast"
                        + (" (power-of-2 scales)" if spec.pow2 else ""))
    return FP8Layer("channel", False, f"per-channel cast for the export (training's {scaling or 'unknown'} cast "
                                      "has no compressed-tensors form)")


@dataclass
class FP8Export:
    """The plan of an FP8 export: which module names are written in FP8 and how, which Linears stay bf16."""

    fmt: str
    """The layout written (:data:`FP8_FORMATS`: "compressed-tensors" or "fine-grained")."""
    layers: dict[str, FP8Layer]
    """The Linears written in FP8, by module name (as the exported model names them), with how."""
    kept: list[str]
    """Linears written in bf16: the plan kept them in high precision, or their fused group (:attr:`fused_bf16`)."""
    fused_bf16: dict[str, FusedBf16] = field(default_factory=dict)
    """The Linears of :attr:`kept` the plan ran in FP8, written in bf16 for their fused group, by module name."""
    modules_bf16: dict[str, ModuleBf16] = field(default_factory=dict)
    """Modules other than Linears that loaders quantize by their own rule (experts), written in bf16 and listed as not
    converted, by module name."""

    def quantize(self, name: str, tensor: torch.Tensor, reference: torch.Tensor | None = None) \
            -> dict[str, torch.Tensor]:
        """The tensors written for state-dict entry ``name``: an FP8 layer's weight as its bits and scale, anything
        else as itself in bf16 (integers as they are). ``reference``: the merged weight's high-precision value,
        whose relative error is recorded (LoRA)."""
        module = name.removesuffix(".weight")
        layer = self.layers.get(module) if name.endswith(".weight") else None
        if layer is None:
            return {name: (tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor).contiguous()}
        bits, scale = quantize_weight(tensor, layer.cast_granularity or layer.granularity, pow2=layer.pow2)
        if layer.cast_granularity == "tensor" and layer.granularity == "channel":
            scale = scale.expand(bits.shape[0]).reshape(-1, 1)  # the tensor's one scale, once per output row
        if reference is not None:
            from ..fp8.hf_format import dequantize

            err = (dequantize(bits, scale, layer.granularity) - reference.float()).norm() / reference.float().norm()
            self.layers[module] = FP8Layer(layer.granularity, layer.pow2, layer.cast, float(err))
        return {name: bits.contiguous(), scale_name(name, self.fmt): scale.contiguous()}

    def quantization_config(self) -> dict[str, Any]:
        """config.json's ``quantization_config`` of this export."""
        listed = [name for module in self.modules_bf16.values() for name in module.listed_as]
        return quantization_config(self.fmt, {n: layer.granularity for n, layer in self.layers.items()},
                                   [*self.kept, *listed])

    def record(self) -> str:
        """The text of :data:`RECORD_FILE`."""
        return json.dumps({"format": self.fmt, "loaders": FORMAT_LOADERS[self.fmt],
                           "layers": {n: asdict(layer) for n, layer in sorted(self.layers.items())},
                           "kept_bf16": sorted(self.kept),
                           "fused_bf16": {n: asdict(f) for n, f in sorted(self.fused_bf16.items())},
                           "modules_bf16": {n: asdict(m) for n, m in sorted(self.modules_bf16.items())}},
                          indent=2) + "\n"


def plan_fp8_export(model: nn.Module, fmt: str, *, prefix: str = "") -> FP8Export:
    """The :class:`FP8Export` of ``model`` (as :func:`fp8dist.wrap_model` returned it): each nn.Linear its plan ran
    in FP8 (``PlanEntry.precision == "fp8"``), under its name less ``prefix`` and PEFT's ``.base_layer``, with the
    weight cast its recipe used where the layout holds it (tensorwise -> per tensor, rowwise -> per channel). Warns
    when no layer ran in FP8 (the export is bf16). The modules other than Linears that loaders quantize by their own
    rule (:func:`.loader_quantized.loader_quantized`: experts) are written in bf16 and listed as not converted under
    each loader's name (:attr:`FP8Export.modules_bf16`). Raises ValueError for a model fp8dist did not wrap."""
    from ..fp8 import get_backend
    from ..pipeline.api import get_wrap_info
    from ..strategies import unwrap_model
    from ..runtime.names import plain_name

    check_fp8_format(fmt)
    try:
        info = get_wrap_info(model)
    except ValueError:
        raise ValueError(f"dtype='fp8' writes the Linears fp8dist's plan ran in FP8, and {type(model).__name__} was "
                         "not returned by fp8dist.wrap_model (it has no plan). Wrap and train it with fp8dist, or "
                         "export it with dtype='bf16'.") from None
    plan, backend = info.plan, get_backend(info.plan.backend)
    shapes = {plain_name(n): tuple(m.weight.shape) for n, m in unwrap_model(model).named_modules() if _is_linear(m)}
    linears = set(shapes)

    def short(name: str) -> str:  # the name the export writes it under (PEFT's wrappers dropped)
        return plain_name(name).removeprefix(prefix).removesuffix(".base_layer").replace(".modules_to_save.default", "")

    layers, shape_of = {}, {}
    for entry in plan:
        name = plain_name(entry.name)
        if entry.precision != "fp8" or not entry.runs or entry.grouped or name not in linears:
            continue
        try:
            spec = backend.numerics_casts(backend.layer_config(info.config, entry), plan.facts,
                                          plan.hardware)[("weight", "output")]
        except NotImplementedError:
            spec = None
        layers[short(name)], shape_of[short(name)] = _layer(spec, fmt), shapes[name]
    kept = sorted({short(n) for n in linears if short(n) not in layers and ".lora_" not in n
                   and ".original_module" not in n})
    model_type = getattr(getattr(unwrap_model(model), "config", None), "model_type", None)
    layers, kept, fused = _one_scheme_per_group(layers, kept, fused_groups(model_type, [*layers, *kept]), fmt)
    odd = [n for n in layers if any(d > BLOCK and d % BLOCK for d in shape_of[n])]
    if fmt == "fine-grained" and odd:  # transformers' CPU dequantization takes each block's size from the scale grid
        warnings.warn(f"save_pretrained(dtype='fp8', fp8_format='fine-grained'): {listing(odd, 3)} "
                      f"{'has' if len(odd) == 1 else 'have'} a dim over {BLOCK} that is no multiple of {BLOCK}: "
                      "transformers' dequantization on a CPU (no FP8 GPU) reads its blocks wrong (it derives their "
                      "size from the scale grid); its FP8 GPU kernels and fp8dist read them right. Use "
                      "fp8_format='compressed-tensors' for such a model on a CPU.", UserWarning, stacklevel=3)
    if not layers:
        warnings.warn(f"save_pretrained(dtype='fp8'): the plan ran no layer in FP8 (backend {plan.backend!r}), so the "
                      "export is written in bf16 with no quantization_config. Train with an FP8 backend "
                      "(fp8='torchao') to export FP8 weights.", UserWarning, stacklevel=3)
    entries = {short(e.name): e for e in plan}
    held = {name: ModuleBf16(checkpoint_names(name, model_type), _why_bf16(entries.get(name)))
            for name in loader_quantized(((short(n), m) for n, m in unwrap_model(model).named_modules()), layers)}
    return FP8Export(fmt, layers, kept, fused, held)


def _why_bf16(entry: PlanEntry | None) -> str:
    """Why a module the plan entry ``entry`` (None: none) is about is written in bf16."""
    if entry is None:
        return "not in the plan (not converted)"
    if entry.precision == "fp8" and entry.runs:
        return (f"ran FP8 in training ({entry.converted_to}); written bf16: fp8dist's FP8 layouts hold Linear weights "
                "only")
    return f"kept in {entry.precision} by the plan: {entry.reason}"


def _one_scheme_per_group(layers: dict[str, FP8Layer], kept: list[str], groups: dict[str, list[str]], fmt: str) \
        -> tuple[dict[str, FP8Layer], list[str], dict[str, FusedBf16]]:
    """(layers, kept, fused_bf16) with each fused group of ``groups`` (fused name -> member names) in one scheme: a
    group with a member in ``kept`` wholly in bf16; in compressed-tensors, a group whose FP8 members' scales differ
    per channel, a per-tensor member written with its scale repeated per row (the same bits)."""
    layers, kept_now, fused = dict(layers), set(kept), {}
    for group, members in groups.items():
        by_plan = tuple(m for m in members if m in kept_now)
        if by_plan and len(by_plan) < len(members):
            fused.update({m: FusedBf16(group, by_plan, layers.pop(m).cast) for m in members if m in layers})
            kept_now.update(members)
        elif not by_plan and fmt == "compressed-tensors" and len({layers[m].granularity for m in members}) > 1:
            for m in (m for m in members if layers[m].granularity == "tensor"):
                layers[m] = FP8Layer("channel", layers[m].pow2, f"{layers[m].cast}, its one scale written on every "
                                     "row (its fused group is per channel)", cast_granularity="tensor")
    return layers, sorted(kept_now), fused


def _is_linear(module: nn.Module) -> bool:
    """An nn.Linear, also once converted (torchao's Float8Linear subclasses it; a PEFT LoRA layer is not one)."""
    return isinstance(module, nn.Linear)


def write_record(out: Path, export: FP8Export) -> None:
    """Write :data:`RECORD_FILE` (``export``'s per-layer record, :meth:`FP8Export.record`) into the directory ``out``
    atomically; on rank 0 only, after the weights. OSError where it cannot be written."""
    from ..runtime.files import atomic_write_text

    atomic_write_text(out / RECORD_FILE, export.record())


def fp8_summary(out: Path) -> str:
    """What the FP8 export in ``out`` holds, for a log line: its layout, layers and casts (from its record), or that
    it is bf16 (no record: no layer ran in FP8)."""
    path = Path(out) / RECORD_FILE
    if not path.is_file():
        return "bf16: no layer ran in FP8"
    record = json.loads(path.read_text())
    casts: dict[str, int] = {}
    for layer in record["layers"].values():
        casts[layer["cast"]] = casts.get(layer["cast"], 0) + 1
    errors = [layer["merge_error"] for layer in record["layers"].values() if layer["merge_error"] is not None]
    merged = f"; LoRA merged, then quantized: relative error per layer up to {max(errors):.2e}" if errors else ""
    fused = len(record.get("fused_bf16", {}))
    grouped = f" ({fused} of them ran FP8, written bf16 as their fused group is: vLLM serves one scheme per group)" \
        if fused else ""
    held = record.get("modules_bf16", {})
    kinds = "/".join(sorted({n.rpartition(".")[2] for n in held}))
    others = f"; {len(held)} {kinds} modules bf16, listed as not converted (a loader would quantize them)" \
        if held else ""
    return (f"fp8 {record['format']}: {len(record['layers'])} Linears e4m3 ("
            + ", ".join(f"{n} {c}" for c, n in casts.items()) + f"), {len(record['kept_bf16'])} kept bf16{grouped}"
            + others + merged)
