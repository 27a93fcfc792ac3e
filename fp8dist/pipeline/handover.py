"""What other people's trainers read of a model to take it as already distributed, set on what ``wrap_model``
returns: Accelerate's ``prepare`` (and so the Hugging Face ``Trainer``) passes it through untouched where it would
wrap it in DDP again, and ``Trainer`` keeps the dataset columns the model's own forward takes.

Accelerate reads its marker once, in ``prepare``, before it would wrap the model: the marker checks there that the
Accelerate run can drive this model, and refuses it in fp8dist's words where it cannot."""

from __future__ import annotations

import functools
import inspect
from collections import OrderedDict
from typing import Any

from torch import nn

from ..config.axis import StrategyFacts
from ..strategies import unwrap_model

__all__ = ["ACCELERATE_PREPARED", "SEEN_THROUGH", "EngineConfig", "HandOver", "HandOverError", "mark_distributed"]

ACCELERATE_PREPARED = "_is_accelerate_prepared"
"""Accelerate's own guard against wrapping a model twice: ``prepare`` returns a model whose marker is true as it
is (Accelerate 1.x, ``Accelerator.prepare_model``)."""
SEEN_THROUGH = ("config", "loss_type", "main_input_name")
"""The model's own attributes ``Trainer`` reads of the model it is given (its loss arithmetic, ``num_items_in_batch``
counting shifted labels, the input it logs tokens of), shown on a wrapper (DDP) by reference."""

_OWN_LOOP = "train it in your own loop (README: \"Hugging Face Trainer and Accelerate\")"


class HandOverError(ValueError):
    """A model returned by ``wrap_model`` was handed to Accelerate (or ``Trainer``) in a way it cannot train."""


class HandOver:
    """The value of the Accelerate marker on a wrapped model: true where Accelerate may take the model as it is;
    reading it (``bool``) raises :class:`HandOverError` naming the way out where the model or the Accelerate run
    cannot (an engine that steps itself, FSDP1's flat shards, Accelerate set to shard, cast or convert again)."""

    def __init__(self, strategy: str, facts: StrategyFacts):
        self.strategy, self.facts = strategy, facts

    def __bool__(self) -> bool:
        refusal = self.refusal()
        if refusal:
            raise HandOverError(refusal)
        return True

    def refusal(self) -> str | None:
        """Why Accelerate cannot take this model now; None: it can."""
        return _model_refusal(self.strategy, self.facts) or _accelerate_refusal(_what(self.strategy))


class EngineConfig(dict):
    """An engine's own config dict (DeepSpeed's ``engine.config``, written into its checkpoints) on an engine
    ``Trainer`` cannot take: ``Trainer``'s constructor sets ``use_cache`` on its model's ``config``, taking the dict
    for a model config, which a plain dict refuses with an ``AttributeError`` from inside transformers. Setting any
    attribute on this one raises :class:`HandOverError` with the refusal instead; as a dict it is the engine's
    config as it was, and it pickles and copies as an ``OrderedDict`` (a checkpoint holding it still loads with
    ``torch.load(weights_only=True)``, which refuses a dict subclass and rebuilding a plain dict alike)."""

    def __init__(self, config: dict, refusal: str):
        super().__init__(config)
        object.__setattr__(self, "refusal", refusal)

    def __setattr__(self, name: str, value: Any) -> None:
        raise HandOverError(f"{self.refusal} (config.{name} was set on it as on a model's config, as the Hugging "
                            "Face Trainer does: its config is DeepSpeed's dict.)")

    def __reduce__(self) -> tuple:
        return OrderedDict, (list(self.items()),)


def _what(strategy: str) -> str:
    return f"a model wrapped by fp8dist.wrap_model (strategy={strategy!r})"


def _model_refusal(strategy: str, facts: StrategyFacts) -> str | None:
    """Why no Accelerate run can drive a model of a strategy with ``facts``; None: one can."""
    if facts.engine_builds_optimizer:
        return (f"{_what(strategy)} cannot be handed to Accelerate or the Hugging Face Trainer: its engine steps, "
                "scales and clips the optimizer itself, and they would step their own optimizer over it; use "
                f"strategy='fsdp' or 'ddp', or {_OWN_LOOP}.")
    if facts.flat_params:
        return (f"{_what(strategy)} cannot be handed to Accelerate or the Hugging Face Trainer: they would clip "
                "gradients over each rank's flat FSDP1 shards one rank at a time (a different norm on every rank); "
                f"use strategy='fsdp' (FSDP2), or {_OWN_LOOP} with fp8dist.clip_grad_norm_.")
    return None


def _accelerate_refusal(what: str) -> str | None:
    """Why the current Accelerate run would change a model fp8dist already sharded and cast; None: it would not."""
    from accelerate.state import AcceleratorState  # only Accelerate reads the marker
    from accelerate.utils import DistributedType

    state = AcceleratorState()
    sharding = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
    if state.distributed_type in sharding:
        return (f"{what} is already distributed, and Accelerate is set to distribute it again "
                f"(distributed_type={state.distributed_type.value}): launch without --use_fsdp/--use_deepspeed or "
                "an accelerate config that shards, and without fsdp=/deepspeed= in TrainingArguments; fp8dist's "
                "strategy shards it.")
    precision = str(state.mixed_precision)
    if precision != "no":
        return (f"{what} trains in the precision fp8dist planned (fp8dist.get_plan(model)), and Accelerate is set "
                f"to mixed_precision={precision!r}, which it would not apply to a model it passes through: "
                "drop bf16=/fp16= from TrainingArguments and --mixed_precision (Accelerator(mixed_precision='no')); "
                "choose precision with wrap_model's param_dtype= and fp8=.")
    return None


def mark_distributed(model: nn.Module, strategy: str, facts: StrategyFacts) -> None:
    """Set Accelerate's marker on ``model`` (what ``wrap_model`` returns, of ``strategy`` with ``facts``) to a
    :class:`HandOver`; on a wrapper (DDP) another trainer can drive, give its forward the signature of the model's
    own forward (``Trainer`` keeps the dataset columns it names) and show the model's :data:`SEEN_THROUGH`
    attributes; make the model's ``save_pretrained`` refuse what Trainer's rank-0 ``save_model`` would write wrong,
    and the own config dict of an engine no trainer can drive refuse being set as a model's (:class:`EngineConfig`).
    Call once, last in ``wrap_model``."""
    setattr(model, ACCELERATE_PREPARED, HandOver(strategy, facts))
    refusal = _model_refusal(strategy, facts)
    if refusal and type(model.__dict__.get("config")) is dict:  # DeepSpeed's engine: its own config, no model's
        model.config = EngineConfig(model.config, refusal)
    inner = unwrap_model(model)
    if callable(getattr(type(inner), "save_pretrained", None)):
        inner.save_pretrained = functools.partial(_checked_save, inner, strategy, facts)
    if inner is not model and refusal is None:
        forward: Any = functools.partial(type(model).forward, model)
        forward.__signature__ = inspect.signature(inner.forward)
        model.forward = forward
        for name in SEEN_THROUGH:
            if hasattr(inner, name) and not hasattr(model, name):
                setattr(model, name, getattr(inner, name))


_SAVE_WAY = ("call fp8dist.save_pretrained(model, dir) on every rank, or train with "
             "fp8dist.integrations.transformers.FP8DistTrainer (its save_model and checkpoints do)")


def _checked_save(module: nn.Module, strategy: str, facts: StrategyFacts, *args: Any, **kwargs: Any) -> Any:
    """``module``'s class ``save_pretrained``, refusing the two calls that would write it wrong: any call on FSDP2's
    shards (one rank cannot gather them; transformers fails on their storage), and a wrapper's state dict (every
    key ``module.*``: ``from_pretrained`` would find no weight) — both what ``Trainer.save_model`` does on rank 0.
    Bound with ``functools.partial``, so that a deep copy of the model saves the copy."""
    if facts.dtensor_shards:
        raise HandOverError(f"save_pretrained cannot write {_what(strategy)}: its weights are shards spread over "
                            f"the ranks; {_SAVE_WAY}.")
    state = kwargs.get("state_dict")
    if state and all(key.startswith("module.") for key in state):
        raise HandOverError(f"save_pretrained was given the state dict of the wrapper of {_what(strategy)} (every "
                            f"name module.*, which from_pretrained would not find); {_SAVE_WAY}.")
    return type(module).save_pretrained(module, *args, **kwargs)
