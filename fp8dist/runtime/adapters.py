"""Which modules of a PEFT model are adapters (any tuner's ``adapter_layer_names``: LoRA's A/B, DoRA's magnitude, ...)
and their rank, so the plan keeps them in the strategy's precision, and which base layers' weights an adapter reads
(DoRA). Duck-typed on PEFT's ``BaseTunerLayer`` (it holds ``base_layer``, which is planned like any Linear): fp8dist
imports no ``peft``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["adapter_reasons", "is_peft_model", "tuner_layers", "weight_readers", "without_adapters", "idle_copies",
           "SUPPORTED_PEFT_TYPES", "unsupported_peft"]

_NO_GEMM = {"lora_magnitude_vector": "DoRA's magnitude, one scale per output feature: it runs no GEMM"}
"""Adapter containers that hold no GEMM weight, and what they hold instead (the others' reason: a rank-r GEMM)."""


def tuner_layers(model: nn.Module):
    """``(fqn, layer)`` of every PEFT tuner layer in ``model`` (it holds a ``base_layer`` and names its adapter
    containers in ``adapter_layer_names``), in ``named_modules`` order; none for a model without PEFT."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "base_layer", None), nn.Module) and \
                isinstance(getattr(module, "adapter_layer_names", None), tuple):
            yield name, module


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` holds PEFT tuner layers (LoRA, DoRA, ...), injected or wrapped by a PeftModel."""
    return next(tuner_layers(model), None) is not None


def adapter_reasons(model: nn.Module) -> dict[str, str]:
    """``{fqn: reason}`` of every PEFT adapter container in ``model`` and each adapter's module in it, naming the
    rank where known: the reasons the plan gives for keeping them out of FP8."""
    reasons = {}
    for name, layer in tuner_layers(model):
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
    for _, layer in tuner_layers(model):
        magnitudes = getattr(layer, "lora_magnitude_vector", None)
        if isinstance(magnitudes, nn.Module) and len(list(magnitudes.children())):
            base = layer.get_base_layer() if callable(getattr(layer, "get_base_layer", None)) else layer.base_layer
            readers[fqns[id(base)]] = "PEFT's DoRA weight norm (lora_magnitude_vector)"
    return readers


def without_adapters(model: nn.Module, is_gemm: Callable[[nn.Module], bool]) -> Callable[[nn.Module], bool]:
    """``is_gemm`` that never holds for an adapter module nor an idle copy (:func:`idle_copies`): a rule about the
    first or last Linear means base layers that run (a LoRA on the output head runs its ``lora_B`` last)."""
    adapters = {id(model.get_submodule(name)) for name in (*adapter_reasons(model), *idle_copies(model))}
    return lambda module: id(module) not in adapters and is_gemm(module)


def _prefixed(name: str, attr: str) -> str:
    return f"{name}.{attr}" if name else attr


def _copy_wrappers(model: nn.Module):
    """PEFT's ``modules_to_save`` wrappers: a frozen ``original_module`` and a trainable copy per adapter."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "original_module", None), nn.Module) and \
                isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict):
            yield name, module


def _with_submodules(model: nn.Module, name: str, reason: str) -> dict[str, str]:
    return {_prefixed(name, sub) if sub else name: reason for sub, _ in model.get_submodule(name).named_modules()}


def idle_copies(model: nn.Module) -> dict[str, str]:
    """``{fqn: reason}`` of every module PEFT holds that does not run with the adapters as they are set, and of its
    submodules: a ``modules_to_save`` wrapper's frozen ``original_module`` where the active adapter runs its own
    copy (the copies where it does not), and every module of an adapter that is not active. Plan them as not
    running: not converted, not counted in the FP8 share. Empty for a model without PEFT."""
    idle: dict[str, str] = {}
    for name, wrapper in _copy_wrappers(model):
        active, copies = list(getattr(wrapper, "active_adapters", ())), wrapper.modules_to_save
        off = getattr(wrapper, "disable_adapters", False) is True
        runs = None if off or not active or any(a not in copies for a in active) else active[0]
        where = _prefixed(name, "modules_to_save")
        if runs is not None:
            idle.update(_with_submodules(model, _prefixed(name, "original_module"), (
                f"PEFT's frozen original of {name} (modules_to_save): adapter {runs!r} runs its copy {where}.{runs}, "
                "so this one does not run while it is active; not converted, not counted in the FP8 share")))
        for adapter in copies:
            if adapter != runs:
                idle.update(_with_submodules(model, f"{where}.{adapter}", (
                    f"PEFT's copy of {name} for adapter {adapter!r}, which is not active: it does not run; not "
                    "converted, not counted in the FP8 share")))
    for name, layer in tuner_layers(model):
        off = getattr(layer, "disable_adapters", False) is True
        active = set() if off else set(getattr(layer, "active_adapters", ()))
        for attr in layer.adapter_layer_names:
            container = getattr(layer, attr, None)
            for adapter, _ in container.named_children() if isinstance(container, nn.Module) else ():
                if adapter not in active:
                    idle.update(_with_submodules(model, f"{_prefixed(name, attr)}.{adapter}", (
                        f"PEFT adapter {adapter!r} ({attr}), not active: it does not run; not counted in the FP8 "
                        "share")))
    return idle


SUPPORTED_PEFT_TYPES: dict[str, str] = {"LORA": "LoRA, with DoRA, rsLoRA, bias and modules_to_save"}
"""The PEFT types ``wrap_model`` plans and trains, each tested equal to the same engines wired by hand: ``{peft_type:
what of it, in words}``."""


def _peft_types(model: nn.Module) -> dict[str, str]:
    """``{peft_type: in words}`` from the PEFT configs in ``model``: ``get_peft_model``'s PeftModel and tuner model,
    ``inject_adapter_in_model`` and transformers' ``add_adapter`` each set ``peft_config``."""
    found = {}
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        for adapter, config in configs.items() if isinstance(configs, dict) else ():
            kind = getattr(config, "peft_type", None)
            kind = str(getattr(kind, "value", kind))
            found.setdefault(kind, f"of peft_type {kind!r} (adapter {adapter!r})")
    return found


def unsupported_peft(model: nn.Module) -> str | None:
    """Why ``wrap_model`` refuses ``model``'s PEFT adapters (a type not in :data:`SUPPORTED_PEFT_TYPES`, in
    words naming the supported ones and the way out), or None."""
    found = [words for kind, words in _peft_types(model).items() if kind not in SUPPORTED_PEFT_TYPES]
    if not found:
        return None
    supported = "; ".join(f"{kind!r} ({words})" for kind, words in SUPPORTED_PEFT_TYPES.items())
    return (f"{type(model).__name__} holds PEFT adapters {', '.join(found)}; wrap_model plans and trains only "
            f"peft_type {supported}, each tested equal to the engines wired by hand. Other types are not planned as "
            "what they compute (IA3's scaling vectors and LoHa's or LoKr's full-size delta weights are no rank-r "
            "GEMMs; AdaLoRA reallocates ranks from the gradients in your loop, update_and_allocate). Use "
            "peft.LoraConfig (use_dora=True for DoRA), or train this model without wrap_model")
