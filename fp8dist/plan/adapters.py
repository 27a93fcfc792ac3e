"""Which modules of a PEFT model are adapters (any tuner's ``adapter_layer_names``: LoRA's A/B, DoRA's magnitude, ...)
and their rank, so the plan keeps them in the strategy's precision, and which base layers' weights an adapter reads
(DoRA). Duck-typed on PEFT's ``BaseTunerLayer`` (it holds ``base_layer``, which is planned like any Linear): fp8dist
imports no ``peft``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["adapter_reasons", "is_peft_model", "weight_readers", "without_adapters"]

_NO_GEMM = {"lora_magnitude_vector": "DoRA's magnitude, one scale per output feature: it runs no GEMM"}
"""Adapter containers that hold no GEMM weight, and what they hold instead (the others' reason: a rank-r GEMM)."""


def _tuner_layers(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(getattr(module, "base_layer", None), nn.Module) and \
                isinstance(getattr(module, "adapter_layer_names", None), tuple):
            yield name, module


def is_peft_model(model: nn.Module) -> bool:
    return next(_tuner_layers(model), None) is not None


def adapter_reasons(model: nn.Module) -> dict[str, str]:
    """``{fqn: reason}`` of every adapter container and each adapter's module in it, naming the rank where known."""
    reasons = {}
    for name, layer in _tuner_layers(model):
        ranks = getattr(layer, "r", {})
        for attr in layer.adapter_layer_names:
            container = getattr(layer, attr, None)
            if not isinstance(container, nn.Module):
                continue
            prefix = f"{name}.{attr}" if name else attr
            reasons[prefix] = _reason(attr, ranks)
            for adapter, _ in container.named_children():
                reasons[f"{prefix}.{adapter}"] = _reason(attr, ranks, adapter)
    return reasons


def _reason(attr: str, ranks: object, adapter: str | None = None) -> str:
    """An adapter's rank-r GEMMs are too thin for FP8's casts of input and output (as large as the base's) to pay;
    DoRA's magnitudes run no GEMM at all."""
    if attr in _NO_GEMM:
        return f"PEFT adapter ({attr}): {_NO_GEMM[attr]}"
    ranks = ranks if isinstance(ranks, dict) else {}
    rank = ranks.get(adapter) if adapter is not None else next(iter(ranks.values())) if len(ranks) == 1 else None
    rank = f", rank {rank}" if isinstance(rank, int) else ""
    return f"PEFT adapter ({attr}{rank}): a rank-r GEMM is too small to pay for FP8 casts"


def weight_readers(model: nn.Module) -> dict[str, str]:
    """``{fqn: reader}`` of every base layer whose weight an adapter reads outside the base layer's own GEMM (DoRA's
    magnitude: the norm of each output row of the base weight plus the LoRA delta, every forward)."""
    fqns = {id(module): name for name, module in model.named_modules()}
    readers = {}
    for _, layer in _tuner_layers(model):
        magnitudes = getattr(layer, "lora_magnitude_vector", None)
        if isinstance(magnitudes, nn.Module) and len(list(magnitudes.children())):
            base = layer.get_base_layer() if callable(getattr(layer, "get_base_layer", None)) else layer.base_layer
            readers[fqns[id(base)]] = "PEFT's DoRA weight norm (lora_magnitude_vector)"
    return readers


def without_adapters(model: nn.Module, is_gemm: Callable[[nn.Module], bool]) -> Callable[[nn.Module], bool]:
    """``is_gemm`` that never holds for an adapter module: a rule about the first or last Linear means base layers
    (a LoRA on the output head runs its ``lora_B`` last)."""
    adapters = {id(model.get_submodule(name)) for name in adapter_reasons(model)}
    return lambda module: id(module) not in adapters and is_gemm(module)
