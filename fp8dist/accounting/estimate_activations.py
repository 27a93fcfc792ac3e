"""Activation memory of one micro-batch on one rank, an estimate: the family's layer formulas
(:mod:`fp8dist.accounting.activation_families`), then the final norm, the logits, autocast's weight casts, the FP8
backend's weight copies and what the strategy keeps gathered; checked against autograd's saves (test_estimate.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from ..strategies import get_strategy
from ..strategies.state_bytes import ROOT_WEIGHTS_ITEM
from .activation_families import FAMILIES, Family, Saves, activation_note, dims, kept_by_selective
from ..fp8 import get_backend
from ..fp8.speed_recipe import Recipe

__all__ = ["Activations", "activation_items", "ROOT_WEIGHTS_ITEM", "RECOMPUTE_ITEM"]

_NAMES = {2: "16-bit", 4: "fp32"}  # bytes per converted weight element held from forward to backward
RECOMPUTE_ITEM = "one decoder layer's activations, recomputed in backward"
"""The label of the transient item in :attr:`MemoryEstimate.activations` under full or selective activation
checkpointing (one layer's activations alive while its backward recomputes them); compare an item's label with it to
tell the transient from what is kept between forward and backward."""


_CHECKPOINTING_NOTES = {
    "none": "activations assume no activation checkpointing, ",
    "full": "activations with full checkpointing: each layer's input, and one layer's saves while backward "
            "recomputes it; ",
    "selective": "activations with selective checkpointing (torchtitan's op mode): each layer's input, attention "
                 "outputs and every other GEMM output, and the rest of one layer's saves while backward recomputes "
                 "it; "}


@dataclass(frozen=True)
class Activations:
    """``(item, bytes)`` rows and notes; ``modelled`` False (``items`` empty) where no formula covers the model
    or the setting (selective checkpointing of a family without its GEMM list)."""

    items: list[tuple[str, int]]
    """(what is kept, bytes) for one micro-batch on one rank."""
    notes: list[str]
    """What the formula assumes or leaves out, said with the estimate."""
    modelled: bool
    """Whether a formula covers the model and setting."""


def _unmodelled(config: Any) -> Activations:
    kinds = ", ".join(FAMILIES)
    if config is None or dims(config) is None:
        why = ("the model has no Hugging Face config with hidden_size, num_hidden_layers, num_attention_heads and "
               "vocab_size")
    else:
        why = f"model_type {getattr(config, 'model_type', None)!r} has no formula"
    return Activations([], [f"activations not estimated: {why} (families modelled: {kinds}); the model-state "
                            "figures hold for any model"], modelled=False)


def activation_items(model: nn.Module, plan: Any, cfg: Any, blocks: list[str], *, micro_batch_size: int,
                     seq_len: int, stored_bytes: int, c: int, selective_gemms: Sequence[str], loss_chunks: int = 1,
                     hardware: Any = None) -> Activations:
    """The activations one rank keeps for ``micro_batch_size`` sequences of ``seq_len`` tokens under ``cfg``'s
    checkpointing, item by item, from the model family's formula (:data:`~.activation_families.FAMILIES`) and the
    plan's precisions; ``blocks``: the checkpointed blocks, ``stored_bytes``: the bytes of an element of the
    parameters as built (read where autocast computes from them), ``c``: of one in the compute dtype;
    ``selective_gemms``: the ops a selective policy counts (every other one's output kept), each converted GEMM's
    op from its recipe (:attr:`~fp8dist.fp8.speed_recipe.Recipe.checkpoint_gemm`); ``loss_chunks``: the loss
    computes the logits that many chunks of the sequence at a time (1: all at once, as Hugging Face's); ``hardware``:
    the target the plan was made for (None: none). A family without a formula gets no items and a note saying so."""
    config = getattr(model, "config", None)
    family = FAMILIES.get(getattr(config, "model_type", None))
    d = dims(config) if config is not None else None
    if family is None or d is None:
        return _unmodelled(config)
    checkpointing = cfg.parallel.activation_checkpointing
    if checkpointing == "selective" and family.gemms is None:
        return Activations([], [f"activations not estimated with activation_checkpointing='selective' for "
                                f"model_type {config.model_type!r} (its GEMM list is not modelled: the experts' GEMMs "
                                "depend on the routing): between 'full' and 'none', whose figures are the bounds"],
                           modelled=False)
    T, backend = micro_batch_size * seq_len, get_backend(cfg.precision.fp8)
    r = stored_bytes if plan.facts.autocast_forward else c  # autocast keeps the weights as stored
    autocast = plan.facts.autocast_forward and c != 4
    decisions = {e.name: e.precision for e in plan}
    s = Saves(T=T, c=c, r=r, n=4 if autocast and family.final_norm == "layer" else r, decisions=decisions,
              fp8_input=backend.saved_input_bytes(cfg),
              swapped_norms=any(e.converted_to and e.precision != "fp8" for e in plan),  # swapped, not FP8: norms
              kv_cache=bool(getattr(config, "use_cache", False)) and cfg.parallel.compile is not True
              and checkpointing == "none")
    prefixes = [f"{b}." for b in blocks] or [""] * d["layers"]  # summed, or the largest: any order
    weights = _autograd_weights(plan, backend.autograd_weight_bytes(cfg), blocks, d["layers"])
    layers = [family.layer(s, d, p, config) + weights(p) for p in prefixes]
    if checkpointing == "full":  # a block keeps only its input; backward recomputes one block at a time
        items = [(f"{len(prefixes)} decoder layers' inputs (activation checkpointing: full)",
                  len(prefixes) * r * T * d["h"]),
                 (RECOMPUTE_ITEM, max(layers))]
    elif checkpointing == "selective":  # and what the policy keeps; backward recomputes the rest, a block at a time
        ops = [_gemm_ops(model, plan, cfg, family, p, hardware) for p in prefixes]
        kept = [kept_by_selective(family, s, d, config, [op in selective_gemms for op in layer]) for layer in ops]
        items = [(f"{len(prefixes)} decoder layers' inputs (activation checkpointing: selective)",
                  len(prefixes) * r * T * d["h"]),
                 (f"{len(prefixes)} decoder layers' attention outputs and every other GEMM output (selective)",
                  sum(kept)),
                 (RECOMPUTE_ITEM, max(0, *(total - k for total, k in zip(layers, kept))))]
        uncounted = sorted({op or "outside PyTorch's dispatcher" for layer in ops for op in layer
                            if op not in selective_gemms})
    else:
        items = [(f"{len(prefixes)} decoder layers", sum(layers))]
    if family.embeddings is not None and (mask := family.embeddings(s, d, config)):
        items.append(("embedding dropout mask", mask))
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = next((n for n, m in model.named_modules() if m is out), None) if out is not None else None
    norm = s.rms_norm(d["h"]) if family.final_norm == "rms" else s.layer_norm(d["h"])
    items.append(("final norm + lm_head input", norm + s.inputs([head or "lm_head"], T * d["h"], s.n)))
    chunk = micro_batch_size * -(-seq_len // loss_chunks)  # tokens whose logits the loss holds at once
    items.append(("logits (compute dtype) + fp32 log-softmax" if loss_chunks == 1 else
                  f"logits of one loss chunk of {chunk:,} tokens (compute dtype) + fp32 log-softmax "
                  f"(loss_chunks={loss_chunks})", (c + 4) * chunk * d["V"]))
    items += _kept_weights(model, plan, cfg, family.cast_types, blocks, r, c)
    notes = [f"activations: the {config.model_type} formula (fp8dist/accounting/activation_families.py)",
             _CHECKPOINTING_NOTES[checkpointing]
             + "flash-style attention (no seq x seq scores); "
             "dropout masks at 1 byte per element, as CUDA keeps them",
             f"the forward's peak also holds an fp32 copy of the logits ({4 * chunk * d['V'] / 2**20:,.1f} MiB) while "
             "the loss is computed"]
    if checkpointing == "selective" and uncounted:
        notes.append(f"selective checkpointing counts {', '.join(selective_gemms)}: GEMMs running "
                     f"{', '.join(uncounted)} are not counted, their outputs recomputed in backward")
    if cfg.parallel.compile:
        notes.append("compile=True: counted as the eager forward without the KV cache wrap_model turns off; "
                     "inductor may save fewer tensors")
    elif cfg.parallel.compile is None:
        notes.append("compile auto turns on with FP8 on CUDA: then wrap_model turns the KV cache off and inductor "
                     "may save fewer tensors than this eager count")
    if plan.fp8:
        notes.append(_saves_note(backend, cfg, s.fp8_input, backend.autograd_weight_bytes(cfg)))
    extra = activation_note(family, config)
    return Activations(items, notes + ([extra] if extra else []), modelled=True)


_SUBCLASS_GEMM = next(f.default for f in fields(Recipe) if f.name == "checkpoint_gemm")


def _gemm_ops(model: nn.Module, plan: Any, cfg: Any, family: Family, prefix: str, hardware: Any) -> list[str]:
    """The op each GEMM of the decoder layer ``prefix`` shows a checkpoint's dispatch mode: a converted one's from
    its recipe (:attr:`~fp8dist.fp8.speed_recipe.Recipe.checkpoint_gemm`; a recipe the speed model lacks counts as
    a tensor subclass's ``aten.mm``), another one ``aten.addmm`` with a bias, else ``aten.mm``."""
    backend, entries = get_backend(cfg.precision.fp8), {e.name: e for e in plan}
    recipes = {recipe.name: recipe for recipe in backend.speed_recipes if not recipe.grouped}
    default = backend.speed_recipe(cfg, hardware)[0] if plan.fp8 else None
    ops = []
    for name in family.gemm_names:
        entry = entries.get(prefix + name)
        if entry is not None and entry.precision == "fp8":
            recipe = recipes.get(entry.recipe or default)
            ops.append(recipe.checkpoint_gemm if recipe is not None else _SUBCLASS_GEMM)
        else:
            module = model.get_submodule(prefix + name) if entry is not None else None
            ops.append("aten.addmm.default" if getattr(module, "bias", None) is not None else "aten.mm.default")
    return ops


def _saves_note(backend: Any, cfg: Any, input_bytes: float, weight_bytes: float) -> str:
    """What the FP8 layers keep for backward under this backend and recipe, as the figures count it."""
    variant = getattr(cfg.precision, backend.variant_option, None) if backend.variant_option else None
    recipe = f"{backend.name}{f' {variant}' if variant else ''}"
    if not input_bytes:
        return (f"{recipe}: each FP8 Linear keeps its high-precision input for backward (shared with the tensor's "
                "other readers) and quantizes it again there")
    weights = f" and of its weight's transpose ({_bytes(weight_bytes)} per element)" if weight_bytes else ""
    return f"{recipe}: each FP8 Linear keeps a quantized copy of its input ({_bytes(input_bytes)} per element){weights}"


def _bytes(n: float) -> str:
    return f"{n:g} byte{'' if n == 1 else 's'}"


def _autograd_weights(plan: Any, per_element: float, blocks: list[str], layers: int) -> Any:
    """``prefix -> bytes`` of the quantized weight copies autograd saves in the block ``prefix`` (NVFP4's); without
    named blocks, an even share of every FP8 layer's per decoder layer."""
    if not per_element:
        return lambda prefix: 0
    fp8 = [(e.name, e.params) for e in plan.fp8]
    if not blocks:
        return lambda prefix: round(per_element * sum(params for _, params in fp8) / layers)
    return lambda prefix: round(per_element * sum(params for name, params in fp8 if name.startswith(prefix)))


def _kept_weights(model: nn.Module, plan: Any, cfg: Any, cast_types: tuple[str, ...], blocks: list[str], r: int,
                  c: int) -> list[tuple[str, int]]:
    """Weights held from forward to backward: autocast's casts, the FP8 backend's copies, the strategy's gathered."""
    items, backend = [], get_backend(cfg.precision.fp8)
    if r != c:
        copies = sum(e.params for e in plan if e.module_type in cast_types and e.precision != "fp8")
        items.append((f"autocast's copies of the GEMM weights ({_NAMES.get(c, c)})", copies * c))
    if backend.saved_weight_bytes:
        items.append(("FP8 weight copies kept for backward",
                      sum(e.params for e in plan.fp8) * backend.saved_weight_bytes))
    kept = get_strategy(cfg.parallel.strategy).kept_for_backward(model, cfg, blocks)
    return items + [(item, elements * c) for item, elements in kept]
