"""The one place that knows PEFT's adapters (``peft.get_peft_model``): which modules of a model are adapter layers
(LoRA's ``lora_A`` / ``lora_B``, ``lora_embedding_*``, DoRA's magnitude, any tuner's ``adapter_layer_names``) and
their rank, so the plan keeps them in the strategy's precision with their own reason.

Duck-typed on PEFT's ``BaseTunerLayer`` contract -- a module holding ``base_layer`` and naming its adapter
containers in ``adapter_layer_names`` -- so fp8dist imports no ``peft`` (it stays optional) and a PEFT version that
adds a tuner keeps working. The base layer (``...q_proj.base_layer``) is not an adapter: it is planned like any
Linear.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["adapter_reasons", "is_peft_model", "without_adapters"]


def _tuner_layers(model: nn.Module):
    """``(name, layer)`` of every PEFT tuner layer in ``model`` (a module wrapping ``base_layer`` with adapters)."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "base_layer", None), nn.Module) and \
                isinstance(getattr(module, "adapter_layer_names", None), tuple):
            yield name, module


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` holds PEFT adapter layers."""
    return next(_tuner_layers(model), None) is not None


def adapter_reasons(model: nn.Module) -> dict[str, str]:
    """``{fqn: reason}`` of every module holding an adapter's parameters (the container itself and each adapter's
    module inside it), the reason naming the rank where the layer records one."""
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
    """Why an adapter stays in the strategy's precision: its GEMMs are rank-r thin, too small for FP8's casts of
    input and output (each as large as the base layer's) to pay back."""
    ranks = ranks if isinstance(ranks, dict) else {}
    rank = ranks.get(adapter) if adapter is not None else next(iter(ranks.values())) if len(ranks) == 1 else None
    rank = f", rank {rank}" if isinstance(rank, int) else ""
    return f"PEFT adapter ({attr}{rank}): a rank-r GEMM is too small to pay for FP8 casts"


def without_adapters(model: nn.Module, is_gemm: Callable[[nn.Module], bool]) -> Callable[[nn.Module], bool]:
    """``is_gemm`` that never holds for one of ``model``'s adapter modules: a rule about the model's first or last
    Linear means its base layers (a LoRA on the output head runs its ``lora_B`` last)."""
    adapters = {id(model.get_submodule(name)) for name in adapter_reasons(model)}
    return lambda module: id(module) not in adapters and is_gemm(module)
