"""What ``wrap_model`` planned stays what trains: a parameter added to the model it returned (``peft.get_peft_model``
on the wrapped model) is neither planned nor sharded, and each rank would train its own copy of it. Checked once, in
the first forward, before anything trains; nothing after it."""

from __future__ import annotations

from torch import nn

from ..config.text import listing, plural
from ..runtime.adapters import is_peft_model

__all__ = ["UnplannedParametersError", "refuse_later_parameters"]


class UnplannedParametersError(RuntimeError):
    """The model ``wrap_model`` returned holds parameters added after it (the message names them and the order)."""


def refuse_later_parameters(model: nn.Module) -> None:
    """Make the first forward of ``model`` (what ``wrap_model`` returns, as it returns it) raise
    :class:`UnplannedParametersError` where it holds a parameter neither named nor held at this call, e.g. PEFT
    adapters added to it; the check then removes itself. Call last in ``wrap_model``."""
    names = {name for name, _ in model.named_parameters()}
    held = {id(p) for p in model.parameters()}  # a parameter PEFT only moved (merge_and_unload) is still planned

    def check(module: nn.Module, args: tuple) -> None:
        added = [n for n, p in module.named_parameters() if n not in names and id(p) not in held]
        if added:
            raise UnplannedParametersError(_words(module, added))
        handle.remove()

    handle = model.register_forward_pre_hook(check, prepend=True)  # before FSDP's all-gather swaps parameters


def _words(model: nn.Module, added: list[str]) -> str:
    head = (f"{type(model).__name__} holds {plural(len(added), 'parameter')} added after fp8dist.wrap_model planned "
            f"and sharded it ({listing([repr(n) for n in added], 3)}): wrap_model neither planned nor sharded them, "
            "and each rank would train its own copy.")
    if is_peft_model(model):
        return (f"{head} PEFT adapters go on the model before wrap_model: apply PEFT first, then wrap_model, e.g. "
                "model = wrap_model(get_peft_model(model, lora_config), ...), not get_peft_model on the model "
                "wrap_model returned.")
    return f"{head} Add every module to the model before wrap_model, then wrap it."
