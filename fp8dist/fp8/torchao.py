"""torchao float8 training: ``convert_to_float8_training`` on the plan's Linear layers, FP8 all-gather under
FSDP2 with the scale precompute wired to every optimizer step of the model's optimizer."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from . import dims_reason, fp8_hardware_reason

NAME = "torchao"


def _installed() -> bool:
    from ..env import package_version

    return package_version("torchao") is not None


def describe(cfg) -> str:
    return f"recipe {cfg.precision.torchao_recipe}, FP8 all-gather {'on' if fp8_all_gather(cfg) else 'off'}"


def fp8_all_gather(cfg) -> bool:
    """FP8 all-gather is used under FSDP2 with the tensorwise recipe unless the user turned it off."""
    p = cfg.precision
    return cfg.parallel.strategy == "fsdp" and p.torchao_recipe == "tensorwise" and p.fp8_all_gather is not False


def unavailable_reason(cfg, device: torch.device) -> str | None:
    if not _installed():
        return "torchao is not installed (pip install 'fp8dist[torchao]')"
    if device.type == "cuda":  # torch's _scaled_mm also runs on CPU, so only CUDA is gated
        return fp8_hardware_reason(device)
    return None


def supports(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def converted_class(module: nn.Module) -> str:
    return "Float8Linear"


def computes_in_fp8(module: nn.Module) -> bool:
    return True


def model_exclusions(model: nn.Module, cfg) -> dict[str, str]:
    """The first and last nn.Linear stay in high precision when ``keep_first_last_linear`` (the default)."""
    if not cfg.precision.keep_first_last_linear:
        return {}
    linears = [name for name, m in model.named_modules() if supports(m)]
    if not linears:
        return {}
    return {linears[0]: "first Linear, kept in high precision (keep_first_last_linear=True)",
            linears[-1]: "last Linear, kept in high precision (keep_first_last_linear=True)"}


def ineligible_reason(module: nn.Module, fqn: str, cfg) -> str | None:
    return dims_reason(module)


def float8_config(cfg) -> Any:
    """The ``Float8LinearConfig`` for the recipe; FP8 all-gather switched on where it applies."""
    from torchao.float8 import Float8LinearConfig

    if cfg.precision.torchao_recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather(cfg))
    return Float8LinearConfig.from_recipe_name(cfg.precision.torchao_recipe)


def check_plan(plan) -> None:
    """Any plan can be followed: ineligible layers are simply not converted."""


def convert(model: nn.Module, plan, cfg) -> None:
    """Swap exactly the plan's FP8 Linears for torchao ``Float8Linear``. Call before sharding."""
    from torchao.float8 import convert_to_float8_training

    names = {e.name for e in plan.fp8}
    _check_even_shards(model, names, cfg)
    convert_to_float8_training(model, config=float8_config(cfg), module_filter_fn=lambda m, fqn: fqn in names)


def _check_even_shards(model: nn.Module, names: set[str], cfg) -> None:
    """torchao's FP8 all-gather fails on uneven FSDP2 shards (gloo: "Received data size doesn't match";
    pytorch/ao#3982): refuse before converting, with the ways out."""
    if not fp8_all_gather(cfg) or not torch.distributed.is_initialized():
        return
    world = torch.distributed.get_world_size()
    uneven = [f"{n} ({m.out_features} rows)" for n, m in model.named_modules()
              if n in names and m.out_features % world]
    if uneven:
        more = f" and {len(uneven) - 3} more" if len(uneven) > 3 else ""
        raise ValueError(
            f"FP8 all-gather (torchao under FSDP2) needs every FP8 weight's rows divisible by the {world} ranks; "
            f"{', '.join(uneven[:3])}{more} are not, and torchao's FP8 all-gather of uneven shards fails "
            "(pytorch/ao#3982). Pass fp8_all_gather=False (bf16 all-gather, FP8 GEMMs kept), keep these layers "
            "out of FP8 with fp8_exclude, or use a world size that divides their rows.")


def after_shard(model: nn.Module, plan, cfg, env, group) -> None:
    """With FP8 all-gather, recompute the FP8 weight scales after each step of any optimizer that holds this
    model's parameters (one all-reduce, as ``precompute_float8_dynamic_scale_for_fsdp`` documents)."""
    if plan.fp8 and fp8_all_gather(cfg):
        register_scale_precompute(model)


def register_scale_precompute(model: nn.Module):
    """Hook ``precompute_float8_dynamic_scale_for_fsdp(model)`` after every ``optimizer.step()`` of an optimizer
    that holds ``model``'s parameters; returns the hook handle. The user never has to call it."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    model_ref = weakref.ref(model)
    param_ids = {id(p) for p in model.parameters()}
    owns: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        target = model_ref()
        if target is None:
            handle.remove()
            return
        if optimizer not in owns:
            owns[optimizer] = any(id(p) in param_ids for g in optimizer.param_groups for p in g["params"])
        if owns[optimizer]:
            precompute_float8_dynamic_scale_for_fsdp(target)

    handle = register_optimizer_step_post_hook(hook)
    return handle
