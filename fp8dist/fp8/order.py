"""The first and last GEMM a model runs (``keep_first_last_linear``), in execution order, not registration order
(Phi-3 registers ``o_proj`` before ``qkv_proj``): a Hugging Face causal LM's forward is traced on a bf16 meta copy
(0.1-0.2 s, nothing allocated); any other model, or a failed trace, falls back to the declared order and says so."""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["GemmOrder", "gemm_order", "model_structure", "per_structure"]


@dataclass(frozen=True)
class GemmOrder:
    """The GEMM modules of a model in the order they run."""

    names: tuple[str, ...]
    """Every GEMM module, by the first time it runs (those that never ran, after them in declared order)."""
    last: str | None
    """The GEMM module that runs last (usually the output head)."""
    traced: bool
    """True when the order comes from a traced forward; False: the declared (registration) order."""
    why_declared: str = ""
    """Why the declared order was used (not a Hugging Face causal LM, or the trace failed and how)."""

    @property
    def first(self) -> str | None:
        """The first GEMM module to run, by name (None: the model has none)."""
        return self.names[0] if self.names else None


def _meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s modules with every tensor a meta tensor, bf16 if floating (torch's grouped GEMMs of MoE experts
    take nothing else); ties stay tied."""
    memo: dict[int, object] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in memo:
            continue
        dtype = torch.bfloat16 if tensor.is_floating_point() else tensor.dtype
        meta = torch.empty(tensor.shape, dtype=dtype, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) \
            if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def model_structure(model: nn.Module) -> tuple:
    """Every module's name and type, and its parameters by identity, shape and requires_grad: what the planner's
    caches of one model are keyed by."""
    return tuple((name, type(module), tuple((n, id(p), tuple(p.shape), p.requires_grad)
                                            for n, p in module._parameters.items() if p is not None))
                 for name, module in model.named_modules())


_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> (its structure, {key: value}): one structure kept per model; a changed (converted) one drops the rest.
A value must not hold the model (its weak key): a module of it, an exception's frames."""


def per_structure(model: nn.Module, key: Hashable, compute: Callable[[], Any], structure: tuple | None = None) -> Any:
    """``compute()``, remembered for ``model`` under ``key`` while its structure (:func:`model_structure`, or the
    one given) stays the same: a planner asks several rules of one model, and re-plans it per way out and rank
    count."""
    structure = model_structure(model) if structure is None else structure
    found = _MEMO.get(model)
    if found is None or found[0] != structure:
        found = (structure, {})
        _MEMO[model] = found
    if key not in found[1]:
        found[1][key] = compute()
    return found[1][key]


def _calls(model: nn.Module, is_gemm: Callable[[nn.Module], bool]) -> list[str]:
    """The names of ``model``'s modules for which ``is_gemm`` holds, each time one runs."""
    gemms = {name for name, module in model.named_modules() if is_gemm(module)}
    return [name for name in _traced(model) if name in gemms]


def _traced(model: nn.Module) -> list[str]:
    """Every module's forward, by name, as a meta copy of ``model`` runs: one trace per structure of the model."""
    found = per_structure(model, "trace", lambda: _trace_or_error(model))
    if isinstance(found, Exception):
        raise copy.copy(found)  # raising the kept one would attach this call's frames (and the model) to it
    return found


def _trace_or_error(model: nn.Module) -> list[str] | Exception:
    """:func:`_trace`, or the exception it raised without its frames (they would hold the model alive in the memo):
    any model code may refuse the meta device, said by each caller alike."""
    try:
        return _trace(model)
    except Exception as error:
        error.__traceback__ = None
        error.__cause__ = None
        error.__context__ = None
        return error


def _trace(model: nn.Module) -> list[str]:
    shadow = _meta_copy(model)
    calls: list[str] = []
    for name, module in shadow.named_modules():
        module.register_forward_pre_hook(lambda m, args, name=name: calls.append(name))
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")  # any number of tokens runs every layer once
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shadow(input_ids=ids)
    return calls


def gemm_order(model: nn.Module, is_gemm: Callable[[nn.Module], bool]) -> GemmOrder:
    """The modules of ``model`` (real or meta; neither changed nor run) for which ``is_gemm`` holds, in execution
    order."""
    declared = [name for name, module in model.named_modules() if is_gemm(module)]
    if not declared:
        return GemmOrder((), None, traced=False, why_declared="no GEMM module")
    calls, why = [], "not a Hugging Face causal LM: no input to trace it with"
    if getattr(model, "config", None) is not None and getattr(model, "main_input_name", None) == "input_ids":
        try:
            calls, why = _calls(model, is_gemm), "the traced forward ran none of them"
        except Exception as err:  # any model code may refuse the meta device; the declared order then stands
            why = f"a meta-device forward failed: {type(err).__name__}: {err}"
    if not calls:
        return GemmOrder(tuple(declared), declared[-1], traced=False, why_declared=f"declared order ({why})")
    ran = list(dict.fromkeys(calls))
    return GemmOrder(tuple(ran + [n for n in declared if n not in ran]), calls[-1], traced=True)
