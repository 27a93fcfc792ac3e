"""MoE checkpoints on the Hub with one module per expert (Mixtral's ``block_sparse_moe.experts.E.w1``, Qwen-MoE's
``mlp.experts.E.gate_proj``), read into transformers 5's two fused 3-D parameters per layer (``gate_up_proj``,
``down_proj``) as its own ``conversion_mapping`` does; a rank reads only the rows of each expert it holds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["ExpertsLayout", "FusedExperts", "LAYOUTS", "resolve", "checkpoint_names"]


@dataclass(frozen=True)
class ExpertsLayout:
    """How a family's per-expert checkpoints name what the model holds fused."""

    renames: tuple[tuple[str, str], ...]
    """``(in the model's names, in the checkpoint's)``: tried on every name the checkpoint lacks."""
    fused: tuple[tuple[str, tuple[str, ...]], ...]
    """``(fused parameter's name in the experts module, the per-expert tensors that make it, under the experts
    module, "{e}" the expert)``: experts stacked on dim 0, each expert's tensors concatenated on their dim 0."""


_QWEN_MOE = ExpertsLayout(renames=(), fused=(("gate_up_proj", ("{e}.gate_proj.weight", "{e}.up_proj.weight")),
                                             ("down_proj", ("{e}.down_proj.weight",))))
LAYOUTS = {
    "mixtral": ExpertsLayout(renames=((".mlp.", ".block_sparse_moe."),),
                             fused=(("gate_up_proj", ("{e}.w1.weight", "{e}.w3.weight")),
                                    ("down_proj", ("{e}.w2.weight",)))),
    "qwen2_moe": _QWEN_MOE,
    "qwen3_moe": _QWEN_MOE,
}
"""model_type -> its per-expert checkpoint layout."""


@dataclass(frozen=True)
class FusedExperts:
    """A fused experts tensor as the checkpoint holds it: per expert, the names of its tensors in order."""

    parts: tuple[tuple[str, ...], ...]
    """Per expert, the checkpoint names of the tensors stacked along dim 1, in order."""
    rows: tuple[int, ...]
    """Dim 0 of each of an expert's tensors."""
    shape: tuple[int, ...]
    """The fused tensor's shape: (experts, sum of rows, *the tensors' other dims)."""
    dtype: str
    """The tensors' safetensors dtype ("BF16")."""


def _candidates(name: str, layout: ExpertsLayout) -> list[str]:
    out = [name]
    for ours, theirs in layout.renames:
        out += [n.replace(ours, theirs, 1) for n in out if ours in n]
    return out


def checkpoint_names(name: str, model_type: str | None) -> tuple[str, ...]:
    """``name`` (a dotted name in the model) and its names under the renames of the family ``model_type``'s
    checkpoint layout (:data:`LAYOUTS`), in that order, without repeats; ``(name,)`` for a family with none."""
    layout = LAYOUTS.get(model_type or "")
    return tuple(dict.fromkeys(_candidates(name, layout))) if layout is not None else (name,)


def _fused(name: str, layout: ExpertsLayout, shapes: Mapping[str, tuple[int, ...]],
           dtypes: Mapping[str, str]) -> FusedExperts | None:
    module, _, attr = name.rpartition(".")
    pattern = dict(layout.fused).get(attr)
    if pattern is None:
        return None
    for prefix in _candidates(module + ".", layout):
        parts = []
        while all(prefix + p.format(e=len(parts)) in shapes for p in pattern):
            parts.append(tuple(prefix + p.format(e=len(parts)) for p in pattern))
        if not parts:
            continue
        first = [shapes[n] for n in parts[0]]
        if any([shapes[n] for n in expert] != first for expert in parts) or \
                len({s[1:] for s in first}) != 1 or len({dtypes[n] for e in parts for n in e}) != 1:
            return None  # experts of different shapes or dtypes: not this layout; the mismatch is reported
        rows = tuple(s[0] for s in first)
        return FusedExperts(tuple(parts), rows, (len(parts), sum(rows), *first[0][1:]), dtypes[parts[0][0]])
    return None


def resolve(wanted: Iterable[str], shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str],
            model_type: str | None) -> dict[str, str | FusedExperts]:
    """For each name of ``wanted`` the checkpoint (``shapes``/``dtypes``) lacks: its name there under the family's older
    layout, or the per-expert tensors a fused parameter is made of; names found neither way are left out."""
    layout = LAYOUTS.get(model_type or "")
    if layout is None:
        return {}
    out: dict[str, str | FusedExperts] = {}
    for name in wanted:
        if name in shapes:
            continue
        renamed = next((n for n in _candidates(name, layout)[1:] if n in shapes), None)
        found = renamed or _fused(name, layout, shapes, dtypes)
        if found is not None:
            out[name] = found
    return out
