"""The modules other than Linears that loaders quantize by a rule of their own (not the config's targets), which an FP8
export that writes them in bf16 must list as not converted: a model's experts (the module named ``experts``: in
transformers 5 one module holding the experts' stacked 3-D weights). transformers' FineGrainedFP8 swaps every module
whose name ends in ``.experts`` for its FP8Experts when an FP8 GPU is present (bf16 weights would load into e4m3
parameters with no scales), and vLLM runs each as a FusedMoE layer that its ``fp8`` method quantizes unless the list
names it. Each is listed under the model's name (transformers; vLLM's Transformers backend) and under the family's
checkpoint name (:func:`fp8dist.pipeline.hf_layouts.checkpoint_names`: vLLM's own Mixtral names the layer
``block_sparse_moe.experts``). A router that is no Linear (Mixtral's) is quantized by no loader, so it is not listed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

__all__ = ["LOADER_QUANTIZED", "ModuleBf16", "loader_quantized"]

LOADER_QUANTIZED = ("experts",)
"""The last name component of the modules (other than Linears) that loaders quantize by their own rule."""


@dataclass(frozen=True)
class ModuleBf16:
    """A module other than a Linear that the export writes in bf16 and lists as not converted."""

    listed_as: tuple[str, ...]
    """Its names in the config's list of modules not converted: the model's, then the family's checkpoint names."""
    reason: str
    """Why it is written in bf16: the plan kept it in high precision (its reason), or it ran FP8 in a cast that
    fp8dist does not write."""


def loader_quantized(named_modules: Iterable[tuple[str, nn.Module]], written_fp8: Iterable[str]) -> list[str]:
    """The names, among ``named_modules`` (``(name, module)`` pairs, as ``nn.Module.named_modules`` yields them, under
    the names the export writes), of the modules a loader quantizes by its own rule (:data:`LOADER_QUANTIZED`) that
    hold parameters and none of whose weights is in ``written_fp8`` (the module names written in FP8), sorted."""
    fp8 = tuple(written_fp8)
    return sorted({name for name, module in named_modules
                   if name.rpartition(".")[2] in LOADER_QUANTIZED and next(module.parameters(), None) is not None
                   and not any(n == name or n.startswith(name + ".") for n in fp8)})
