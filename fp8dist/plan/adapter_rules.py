"""Which layers may carry a PEFT adapter, and how large its rank may be: one rule for ``fp8dist train --lora-rank``
(checked before PEFT builds a single adapter) and for a PEFT model given to :func:`fp8dist.wrap_model`."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ..config.text import plural
from ..fp8.conv1d import is_conv1d
from ..runtime.adapters import tuner_layers

__all__ = ["ADAPTABLE_KINDS", "KINDS_TEXT", "adaptable_kind", "rank_limit", "lowest_rank_limit", "rank_refusal",
           "check_peft_adapters"]

ADAPTABLE_KINDS = ("Linear", "Conv1D", "Embedding")
"""Layer kinds an adapter may sit on: each trains under fsdp, fsdp1, ddp, none and deepspeed (an Embedding's adapter,
out of FP8 with the embedding itself: under fsdp + torchao equal to PEFT wired by hand, tests/test_lora_inputs.py)."""


KINDS_TEXT = f"{', '.join(ADAPTABLE_KINDS[:-1])} or {ADAPTABLE_KINDS[-1]}"
""":data:`ADAPTABLE_KINDS` as the messages say them."""


def adaptable_kind(module: nn.Module) -> str | None:
    """The entry of :data:`ADAPTABLE_KINDS` that ``module`` is (transformers' GPT-2 ``Conv1D`` included), or None."""
    if isinstance(module, nn.Linear):
        return "Linear"
    if is_conv1d(module):
        return "Conv1D"
    if isinstance(module, nn.Embedding):
        return "Embedding"
    return None


def rank_limit(module: nn.Module) -> int:
    """The largest rank an adapter's update ``B @ A`` of ``module``'s weight can have: the smaller of the weight's two
    dims (a Linear's in and out features, an Embedding's rows and width; meta weights too)."""
    shape = module.weight.shape
    return min(shape[0], module.weight[0].numel() if len(shape) > 1 else 1)


def lowest_rank_limit(layers: Iterable[tuple[str, nn.Module]]) -> tuple[str, nn.Module, int] | None:
    """``(name, module, limit)`` of the layer among ``layers`` whose :func:`rank_limit` is the smallest (the first
    one on a tie); None when there is none."""
    best = None
    for name, module in layers:
        limit = rank_limit(module)
        if best is None or limit < best[2]:
            best = (name, module, limit)
    return best


def rank_refusal(rank: int, name: str, module: nn.Module) -> str | None:
    """Why ``rank`` is too large for an adapter on ``module`` (its name ``name``), or None when it fits: past the
    weight's own rank an adapter adds parameters (counted in the text) and nothing it can learn."""
    limit = rank_limit(module)
    if rank <= limit:
        return None
    shape = "x".join(str(d) for d in module.weight.shape)
    extra = (rank - limit) * (module.weight.shape[0] + module.weight[0].numel())
    return (f"rank {rank:,} is larger than {name}'s weight ({shape}) can use: an adapter's update B @ A has rank at "
            f"most {limit:,}, the smaller of its dims, so the {plural(rank - limit, 'rank')} above it would add "
            f"{plural(extra, 'parameter')} there and nothing they can learn. The largest rank allowed is {limit:,}")


def check_peft_adapters(model: nn.Module) -> None:
    """ValueError, before anything changes, naming the first PEFT adapter of ``model`` on a layer kind outside
    :data:`ADAPTABLE_KINDS` or, for LoRA's kind (an update ``B @ A``: LoRA, DoRA, AdaLoRA), of a rank past its
    weight's (:func:`rank_refusal`), with the way out. Call it on the model given to ``wrap_model``; a model without
    adapters passes."""
    for name, layer in tuner_layers(model):
        base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer.base_layer
        kind = adaptable_kind(base)
        if kind is None:
            raise ValueError(f"wrap_model: {name} holds a PEFT adapter on a {type(base).__name__}; fp8dist trains "
                             f"adapters on {KINDS_TEXT} layers only. Leave {name.rsplit('.', 1)[-1]!r} "
                             "out of the LoraConfig's target_modules.")
        ranks = getattr(layer, "r", {}) if "lora_A" in layer.adapter_layer_names else {}  # B @ A: LoRA's kind
        for adapter, rank in (ranks.items() if isinstance(ranks, dict) else ()):
            refusal = rank_refusal(rank, name, base) if isinstance(rank, int) else None
            if refusal:
                raise ValueError(f"wrap_model: PEFT adapter {adapter!r}: {refusal}. Build the PEFT model with "
                                 f"LoraConfig(r={rank_limit(base)}) or less (or rank_pattern={{"
                                 f"{name.rsplit('.', 1)[-1]!r}: ...}} for this layer).")
