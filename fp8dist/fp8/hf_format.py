"""FP8 Hugging Face checkpoints as data: the two layouts fp8dist writes (``save_pretrained(dtype="fp8")``) and reads
(``pretrained=``), the e4m3 weight cast with its scale, and what a checkpoint's ``quantization_config`` says.

- ``compressed-tensors`` (``quant_method: "compressed-tensors"``, format ``float-quantized``): e4m3 ``weight`` and
  an fp32 ``weight_scale`` per tensor, per output channel or per block. vLLM serves it (FP8 W8A8 kernels);
  transformers loads it with the compressed-tensors package (on a CPU it decompresses the weights at the first
  forward). A tensorwise training recipe is written per tensor, a rowwise one per channel: training's own cast.
- ``fine-grained`` (transformers' FineGrainedFP8, ``quant_method: "fp8"``): e4m3 ``weight`` and an fp32
  ``weight_scale_inv`` per 128x128 block. transformers loads it (its FP8 kernels on CUDA sm_89+; on a CPU it
  dequantizes to bf16 at load), and vLLM serves it as a block-quantized FP8 model. The blocks are cast here from the
  master weights, not the bits training multiplied with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["FP8_FORMATS", "FORMAT_LOADERS", "BLOCK", "Granularity", "QuantizedLayout", "read_layout", "READ_KINDS",
           "quantize_weight", "dequantize", "scale_name", "quantization_config", "granularity_of_scale", "SCALE_ATTR",
           "holds_fp8"]

FP8_FORMATS = ("compressed-tensors", "fine-grained")
"""The FP8 checkpoint layouts fp8dist writes (``save_pretrained(..., fp8_format=)``, ``--save-fp8-format``)."""

FORMAT_LOADERS = {"compressed-tensors": "vLLM; transformers with the compressed-tensors package",
                  "fine-grained": "transformers (CPU: dequantized to bf16 at load); vLLM (block FP8)"}
"""Which loaders serve each layout, as the docs and the export's record say it."""

BLOCK = 128
"""The fine-grained layout's block: one scale per 128x128 weights (DeepSeek-V3's, transformers' default)."""

_E4M3 = torch.float8_e4m3fn
_EPS = 1e-12  # torchao's floor on an amax: an all-zero weight gets a finite scale

Granularity = Literal["tensor", "channel", "block"]
"""One scale per weight tensor, per output row, or per :data:`BLOCK` x :data:`BLOCK` block."""

_SCALE = {"compressed-tensors": "weight_scale", "fine-grained": "weight_scale_inv"}
_STRATEGY = {"tensor": "tensor", "channel": "channel", "block": "block"}  # compressed-tensors' names for them
_ACTIVATIONS = {"tensor": "tensor", "channel": "token", "block": "group"}  # the dynamic input cast that goes with it

READ_KINDS = ("fp8 (transformers' FineGrainedFP8: e4m3 weights, weight_scale_inv per block or per tensor, fp32)",
              "compressed-tensors float-quantized (8-bit float weights, weight_scale per tensor, channel or block)",
              "fp8dist's own FP8 export (either of those)")
"""The quantized checkpoints ``pretrained=`` reads, said when it refuses another kind."""


SCALE_ATTR = "fp8_scale"
"""On a weight held as a checkpoint's e4m3 bits (their bytes, uint8: a LoRA base loaded in FP8,
:mod:`fp8dist.pipeline.fp8_base`): their fp32 scale (the factor that dequantizes), as the checkpoint shapes it."""


def holds_fp8(module: Any) -> bool:
    """Whether ``module``'s own weight is held as e4m3 bits (their bytes, uint8: every engine broadcasts those) with
    their scale (a base loaded in FP8; PEFT's layer that wraps it does not hold it)."""
    weight = module._parameters.get("weight")
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.uint8 and hasattr(weight, SCALE_ATTR)


def scale_name(weight: str, fmt: str) -> str:
    """The name of the scale tensor beside ``weight`` ("X.weight") in layout ``fmt``."""
    return weight.removesuffix("weight") + _SCALE[fmt]


def quantize_weight(weight: torch.Tensor, granularity: Granularity, *, pow2: bool = False) -> \
        tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bits, fp32 scale) of a 2-D ``weight`` such that ``bits * scale`` (broadcast per ``granularity``)
    approximates it: torchao's dynamic cast (scale = e4m3 max / amax in fp32, ``pow2``: rounded down to a power of 2,
    values saturated), whose bits are those a tensorwise / rowwise Float8Linear multiplies with. The scale is the
    inverse of torchao's (a checkpoint stores the factor that dequantizes): shape (1,) per tensor (as
    compressed-tensors stores it), (out, 1) per
    channel, (ceil(out/128), ceil(in/128)) per block."""
    w = weight.detach().float()
    top = torch.finfo(_E4M3).max
    if granularity == "block":
        rows, cols = w.shape
        br, bc = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
        padded = w.new_zeros(br * BLOCK, bc * BLOCK)
        padded[:rows, :cols] = w
        amax = padded.view(br, BLOCK, bc, BLOCK).abs().amax(dim=(1, 3))
    else:
        amax = w.abs().amax() if granularity == "tensor" else w.abs().amax(dim=1, keepdim=True)
    scale = (top / amax.double().clamp(min=_EPS)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    bits = (w * _expand(scale, w.shape, granularity)).clamp(-top, top).to(_E4M3)
    return bits, (1.0 / scale).float().reshape(-1) if granularity == "tensor" else (1.0 / scale).float()


def _expand(scale: torch.Tensor, shape: torch.Size | tuple[int, int], granularity: Granularity,
            start: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``scale`` broadcast over a (rows, cols) box of the weight beginning at ``start``."""
    if granularity != "block":
        return scale.reshape(-1, 1) if scale.dim() else scale
    rows = torch.arange(start[0], start[0] + shape[0]) // BLOCK
    cols = torch.arange(start[1], start[1] + shape[1]) // BLOCK
    return scale[rows][:, cols]


def dequantize(bits: torch.Tensor, scale: torch.Tensor, granularity: Granularity,
               start: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """fp32 values of a (rows, cols) box of an FP8 weight beginning at ``start`` (``bits``: e4m3, or their bytes as
    uint8, how a base held in FP8 keeps them), from the whole ``scale`` tensor of its ``granularity``."""
    bits = bits.view(_E4M3) if bits.dtype == torch.uint8 else bits
    if granularity == "channel":
        scale = scale.reshape(-1)[start[0]:start[0] + bits.shape[0]]
    return bits.float() * _expand(scale.float(), bits.shape, granularity, start)


def quantization_config(fmt: str, layers: dict[str, Granularity], kept: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` of config.json for ``layers`` (module name -> its weight's granularity) written in
    layout ``fmt``, ``kept`` the Linears left in high precision (listed as not converted)."""
    if fmt == "fine-grained":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
                "modules_to_not_convert": sorted(kept)}
    groups = {}
    for granularity in ("tensor", "channel"):
        names = sorted(n for n, g in layers.items() if g == granularity)
        if names:
            groups[f"group_{len(groups)}"] = {
                "targets": names,
                "weights": {"num_bits": 8, "type": "float", "strategy": _STRATEGY[granularity], "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": _ACTIVATIONS[granularity],
                                      "symmetric": True, "dynamic": True}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": groups, "ignore": sorted(kept)}


@dataclass(frozen=True)
class QuantizedLayout:
    """How a checkpoint's FP8 weights are stored, read from its ``quantization_config``."""

    fmt: str
    """One of :data:`FP8_FORMATS`."""

    def scale_of(self, weight: str) -> str:
        """The scale tensor's name beside ``weight``."""
        return scale_name(weight, self.fmt)


def granularity_of_scale(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> Granularity:
    """The granularity of a 2-D weight's scale, from the shapes: one element per tensor (also one block covering the
    whole weight), (out, 1) per channel, else :data:`BLOCK` x :data:`BLOCK` blocks."""
    if math.prod(scale_shape) == 1:
        return "tensor"
    if tuple(scale_shape) == (weight_shape[0], 1):
        return "channel"
    return "block"


def read_layout(config: dict[str, Any] | None) -> QuantizedLayout | str | None:
    """The :class:`QuantizedLayout` of a config.json's ``quantization_config`` (``config``: the whole config.json,
    or None), None when it has none, or the refusal (a phrase naming what the checkpoint holds) of a kind fp8dist
    cannot read (int4, int8, GPTQ, AWQ, an unknown ``quant_method``)."""
    quant = (config or {}).get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "fp8":
        if quant.get("scale_fmt", "float") != "float" or quant.get("expert_dtype", "fp8") != "fp8":
            return (f"quant_method 'fp8' with scale_fmt={quant.get('scale_fmt')!r}, "
                    f"expert_dtype={quant.get('expert_dtype')!r} (e8m0 scales or FP4 experts)")
        block = quant.get("weight_block_size")
        if block is not None and list(block) != [BLOCK, BLOCK]:
            return f"quant_method 'fp8' with weight_block_size={list(block)} (fp8dist reads {BLOCK}x{BLOCK} blocks)"
        return QuantizedLayout("fine-grained")
    if method == "compressed-tensors":
        return _compressed_tensors_layout(quant)
    return f"quant_method {method!r}" if method is not None else "a quantization_config with no quant_method"


def _compressed_tensors_layout(quant: dict[str, Any]) -> QuantizedLayout | str:
    fmt = quant.get("format")
    if fmt != "float-quantized":
        return f"compressed-tensors format {fmt!r}"
    for name, group in (quant.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {} if isinstance(group, dict) else {}
        kind = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"))
        if kind[:2] != ("float", 8) or kind[2] not in _STRATEGY:
            return (f"compressed-tensors group {name!r} with weights of type {kind[0]!r}, {kind[1]} bits, "
                    f"strategy {kind[2]!r}")
        if kind[2] == "block" and list(weights.get("block_structure") or []) != [BLOCK, BLOCK]:
            return f"compressed-tensors group {name!r} with block_structure {weights.get('block_structure')}"
    return QuantizedLayout("compressed-tensors")
