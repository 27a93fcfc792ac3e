"""Which engine wrapped a model, read from the engine's own objects, and where a model was already wrapped. Each
strategy declares how its engine shows (:meth:`~fp8dist.strategies.base.Strategy.is_engine`, ``engine_words``,
``holds_param``): a registered strategy's engine is recognized as the built-ins' are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from ..config.axis import STRATEGIES

if TYPE_CHECKING:
    from .base import Strategy

__all__ = ["engine_of", "Wrapping", "find_wrapping", "mark_wrapped"]

_WRAPPED_ATTR = "_fp8dist_wrapped_by"  # the strategy's name, on every module of what wrap_model returned
_DTENSOR = "a DTensor (sharded by hand: fully_shard or tensor parallel)"  # torch's, not one strategy's


def _strategies() -> list[tuple[str, Strategy]]:
    return list(STRATEGIES.items())


def engine_of(module: object) -> str | None:
    """The strategy whose engine wrapped or sharded ``module`` itself (its :meth:`Strategy.is_engine`): "deepspeed",
    "fsdp1", "fsdp", "ddp" or a registered strategy's name; None: none."""
    return next((name for name, strategy in _strategies() if strategy.is_engine(module)), None)


@dataclass(frozen=True)
class Wrapping:
    """Where a model was already wrapped or sharded, and by what (:func:`find_wrapping`)."""

    where: str  # the module's (or parameter's) name in the model given; "" for the model itself
    engine: str
    """An :func:`engine_of` name, "dtensor" (a parameter sharded by hand), ``"<strategy>_param"`` (a parameter an
    engine holds without its wrapper: "deepspeed_param"), or "fp8dist" (returned by wrap_model, with its
    ``strategy``)."""
    strategy: str | None = None
    held: str = ""
    """How the parameter is held, in words (``"dtensor"`` and ``"*_param"``)."""

    def describe(self, model: nn.Module) -> str:
        """E.g. "model.layers.0 (FSDPLlamaDecoderLayer) of LlamaForCausalLM is already sharded by fully_shard"."""
        if self.held:
            return f"parameter {self.where!r} of {type(model).__name__} is already {self.held}"
        what = (f"the model given ({type(model).__name__})" if not self.where else
                f"{self.where} ({type(model.get_submodule(self.where)).__name__}) of {type(model).__name__}")
        if self.engine == "fp8dist":
            return f"{what} is already wrapped by fp8dist.wrap_model (strategy={self.strategy!r})"
        return f"{what} is already {STRATEGIES[self.engine].engine_words}"


def mark_wrapped(model: nn.Module, strategy: str) -> None:
    """Mark every module of what ``wrap_model`` returned as wrapped by ``strategy``: a DDP or DeepSpeed model's
    inner module carries no engine state, yet wrapping it again would put a second engine over its parameters."""
    for module in model.modules():
        setattr(module, _WRAPPED_ATTR, strategy)


def find_wrapping(model: nn.Module) -> Wrapping | None:
    """The first module of ``model`` (itself included) that an engine or ``wrap_model`` already wrapped or sharded,
    else the first parameter sharded or held by hand; None: ``model`` is as built."""
    strategies = _strategies()
    for name, module in model.named_modules():
        strategy = getattr(module, _WRAPPED_ATTR, None)
        if strategy is not None:
            return Wrapping(name, "fp8dist", strategy)
        engine = next((key for key, value in strategies if value.is_engine(module)), None)
        if engine is not None:
            return Wrapping(name, engine)
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            return Wrapping(name, "dtensor", held=_DTENSOR)
        held = next(((key, words) for key, value in strategies if (words := value.holds_param(param))), None)
        if held is not None:
            return Wrapping(name, f"{held[0]}_param", held=held[1])
    return None
