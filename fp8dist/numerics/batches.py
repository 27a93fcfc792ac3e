"""The probe's batches, checked against the model before anything runs: a batch the model cannot read is named
with what is wrong and the way out, instead of failing inside torch halfway through the probe."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["checked_batches", "IGNORE_INDEX"]

IGNORE_INDEX = -100
"""The label a Hugging Face loss skips (padding, prompt tokens)."""
_TOKEN_KEYS = ("input_ids", "labels", "shift_labels")  # a mapping batch's token ids (labels may hold IGNORE_INDEX)

_EXAMPLE = "e.g. [ids] with ids a torch.long tensor of shape (batch, sequence), or [{'input_ids': ids, 'labels': ids}]"


def checked_batches(model: nn.Module, batches: Iterable[Any]) -> list[Any]:
    """``batches`` as a list, each checked against the vocabulary and positions of a model with an input
    embedding. TypeError: not a collection of tensors or mappings; ValueError: none, or one the model cannot read."""
    if isinstance(batches, (torch.Tensor, Mapping, str, bytes)) or not isinstance(batches, Iterable):
        what = "one tensor" if isinstance(batches, torch.Tensor) else f"a {type(batches).__name__}"
        raise TypeError(f"batches is {what}: pass a list (or any iterable) of batches, {_EXAMPLE}.")
    taken = list(batches)
    if not taken:
        raise ValueError(f"batches is empty: pass at least one batch, {_EXAMPLE}.")
    vocab, positions = _vocab_size(model), _positions(model)
    for i, batch in enumerate(taken):
        if not isinstance(batch, (torch.Tensor, Mapping)):
            raise TypeError(f"batch {i} is a {type(batch).__name__}: pass token id tensors or dicts of model inputs, "
                            f"{_EXAMPLE}.")
        if vocab is not None and isinstance(batch, torch.Tensor):
            _check_ids(f"batch {i}", batch, vocab, positions, labels=False)
        elif vocab is not None:
            _check_mapping(i, batch, vocab, positions)
    return taken


def _check_mapping(i: int, batch: Mapping, vocab: int, positions: int | None) -> None:
    ids = batch.get("input_ids")
    for key in _TOKEN_KEYS:
        value = batch.get(key)
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"batch {i}[{key!r}] is a {type(value).__name__}: pass a tensor of token ids "
                            "(torch.tensor(...) of shape (batch, sequence)).")
        if isinstance(value, torch.Tensor) and (key == "input_ids" or _is_token_labels(value, ids)):
            _check_ids(f"batch {i}[{key!r}]", value, vocab, positions, labels=key != "input_ids")
    label = batch.get("labels")
    if isinstance(ids, torch.Tensor) and _is_token_labels(label, ids) and label.shape != ids.shape:
        raise ValueError(f"batch {i}: labels of shape {tuple(label.shape)} and input_ids of shape {tuple(ids.shape)}: "
                         "a causal LM's labels are its input ids (shifted inside the model): pass labels of the "
                         "same shape.")


def _is_token_labels(value: Any, ids: Any) -> bool:
    """Labels of one token each (2-D integers beside 2-D ids), not a classifier's or a regression's target."""
    return (isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point()
            and isinstance(ids, torch.Tensor) and ids.dim() == 2)


def _check_ids(name: str, ids: torch.Tensor, vocab: int, positions: int | None, *, labels: bool) -> None:
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} holds {ids.dtype} values: token ids are integers (torch.long); pass ids.long() "
                         "if they are whole numbers, or the tokenizer's ids.")
    if ids.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(ids.shape)}: pass token ids shaped (batch, sequence)"
                         + (", e.g. ids.unsqueeze(0) for one sequence." if ids.dim() == 1 else "."))
    if ids.numel() == 0:
        raise ValueError(f"{name} has shape {tuple(ids.shape)}, no tokens: pass at least one sequence of at least "
                         "one token.")
    if positions is not None and ids.shape[1] > positions:
        raise ValueError(f"{name} holds sequences of {ids.shape[1]} tokens and the model holds {positions} positions "
                         f"(max_position_embeddings): pass sequences of {positions} tokens or less.")
    valid = (ids >= 0) & (ids < vocab)
    if labels:
        valid |= ids == IGNORE_INDEX
    if not bool(valid.all()):
        bad = int(ids[~valid].flatten()[0])
        also = f", or {IGNORE_INDEX} to ignore a label" if labels else ""
        raise ValueError(f"{name} holds token id {bad}: the model reads ids 0 to {vocab - 1} (vocab_size={vocab})"
                         f"{also}. Pass ids the model's tokenizer made, or a model whose vocabulary holds them.")


def _vocab_size(model: nn.Module) -> int | None:
    """Rows of the model's input embedding (None: a model without one, e.g. a bare stack of Linears)."""
    try:
        embedding = model.get_input_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError, TypeError):  # not a transformers model, or one without
        return None
    return embedding.num_embeddings if isinstance(embedding, nn.Embedding) else None


def _positions(model: nn.Module) -> int | None:
    """Positions the model was built for, where its config says (a learned position table raises past them)."""
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return positions if isinstance(positions, int) and not isinstance(positions, bool) else None
