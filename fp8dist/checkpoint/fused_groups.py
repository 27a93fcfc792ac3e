"""The Linears a server runs as one fused layer, per model family: vLLM loads q/k/v into one ``qkv_proj`` and
gate/up into one ``gate_up_proj`` (each model's ``packed_modules_mapping``) and refuses a fused layer whose members
were written in different schemes, so an FP8 export writes each such group in one (:mod:`.fp8_export`)."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["FUSED_GROUPS", "DEFAULT_GROUPS", "fused_groups"]

_QKV = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
_GATE_UP = {"gate_up_proj": ("gate_proj", "up_proj")}

FUSED_GROUPS: dict[str, dict[str, tuple[str, ...]]] = {
    "llama": {**_QKV, **_GATE_UP},
    "mixtral": _QKV,  # its experts' gate/up are one 3-D tensor already, no Linear
    "gpt_neox": {},  # query_key_value is one Linear in the checkpoint
    "gpt2": {},  # c_attn likewise (a Conv1D)
}
"""Per ``config.model_type``: the fused layer's name -> the suffixes of the Linears it packs, as vLLM's model class
for that family packs them."""

DEFAULT_GROUPS: dict[str, tuple[str, ...]] = {**_QKV, **_GATE_UP}
"""A family not in :data:`FUSED_GROUPS` (or a model with no ``config.model_type``): Llama's groups, which the
decoders that name their Linears so (Mistral, Qwen2/3, Gemma, ...) share in vLLM; a family without these names has
no group."""


def fused_groups(model_type: str | None, names: Iterable[str]) -> dict[str, list[str]]:
    """The fused groups among the Linear ``names`` (dotted module names) of a model of family ``model_type``: the
    fused layer's name (its members' parent and the fused name, e.g. ``model.layers.0.self_attn.qkv_proj``) -> the
    member names present, in the family's order. A group with one member present is still a group."""
    table = FUSED_GROUPS.get(model_type or "", DEFAULT_GROUPS)
    suffix_of = {suffix: (fused, i) for fused, suffixes in table.items() for i, suffix in enumerate(suffixes)}
    found: dict[str, list[tuple[int, str]]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        if leaf in suffix_of:
            fused, order = suffix_of[leaf]
            found.setdefault(f"{parent}.{fused}" if parent else fused, []).append((order, name))
    return {group: [name for _, name in sorted(members)] for group, members in found.items()}
