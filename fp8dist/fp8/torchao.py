"""torchao float8 training: ``convert_to_float8_training`` on the plan's Linear layers, FP8 all-gather under
FSDP2 with the scale precompute wired to every optimizer step of the model's optimizer."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..optim import ProcessStepHook, param_count
from ..hardware import Hardware
from . import FP8Backend, FP8Wiring, dims_reason, fp8_hardware_reason
from .conv1d import conv1d_dims_reason, is_conv1d, to_float8_conv1d
from .order import gemm_order
from .moe import (ROUTER_REASON, convert_experts, experts_reason, experts_target, is_experts,
                  moe_routers, torchao_installed)


def fp8_all_gather(cfg) -> bool:
    """FP8 all-gather is used under FSDP2 with the tensorwise recipe unless the user turned it off."""
    p = cfg.precision
    return cfg.parallel.strategy == "fsdp" and p.torchao_recipe == "tensorwise" and p.fp8_all_gather is not False


def float8_config(cfg) -> Any:
    """The ``Float8LinearConfig`` for the recipe; FP8 all-gather switched on where it applies."""
    from torchao.float8 import Float8LinearConfig

    if cfg.precision.torchao_recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather(cfg))
    return Float8LinearConfig.from_recipe_name(cfg.precision.torchao_recipe)


def _linear_like(module: nn.Module) -> bool:
    return type(module) is nn.Linear or is_conv1d(module)


class TorchaoBackend(FP8Backend):
    name = "torchao"

    def describe(self, cfg) -> str:
        return f"recipe {cfg.precision.torchao_recipe}, FP8 all-gather {'on' if fp8_all_gather(cfg) else 'off'}"

    def missing_reason(self, cfg) -> str | None:
        if not torchao_installed():
            from ..env import supported_range

            return f"torchao is not installed (pip install 'torchao{supported_range('torchao') or ''}')"
        return None

    def hardware_reason(self, cfg, hardware: Hardware) -> str | None:
        if hardware.type == "cuda":  # torch's _scaled_mm also runs on CPU, so only CUDA is gated
            return fp8_hardware_reason(hardware)
        return None

    def supports(self, module: nn.Module) -> bool:
        return _linear_like(module) or is_experts(module)

    def converted_class(self, module: nn.Module, cfg, hardware: Hardware) -> str:
        if is_experts(module):
            return experts_target(cfg, hardware)
        return "Float8Conv1D" if is_conv1d(module) else "Float8Linear"

    def ineligible_reason(self, module: nn.Module, fqn: str, cfg, hardware: Hardware) -> str | None:
        if is_experts(module):
            return experts_reason(module, cfg, hardware)
        return conv1d_dims_reason(module) if is_conv1d(module) else dims_reason(module)

    def model_exclusions(self, model: nn.Module, cfg) -> dict[str, str]:
        """The first and last Linear (nn.Linear or GPT-2's Conv1D) stay in high precision when
        ``keep_first_last_linear`` (the default)."""
        routers = dict.fromkeys(moe_routers(model), ROUTER_REASON)
        if not cfg.precision.keep_first_last_linear:
            return routers
        order = gemm_order(model, _linear_like)  # execution order: Phi-3 runs qkv_proj before o_proj; MoE experts
        if order.first is None:                  # are not linear-like
            return routers

        def kind(m: nn.Module) -> str:
            return "Linear (a Conv1D)" if is_conv1d(m) else "Linear"

        first, last = order.first, order.last
        m_first, m_last = model.get_submodule(first), model.get_submodule(last)
        return {**routers, first: f"first {kind(m_first)}, kept in high precision (keep_first_last_linear=True)",
                last: f"last {kind(m_last)}, kept in high precision (keep_first_last_linear=True)"}

    def convert(self, model: nn.Module, plan, cfg) -> None:
        """Swap exactly the plan's FP8 Linears for torchao ``Float8Linear``, its FP8 Conv1Ds for ``Float8Conv1D``
        (same parameters) and its MoE experts for torchao's MoE training form. Call before sharding."""
        from torchao.float8 import convert_to_float8_training

        experts = {e.name for e in plan.fp8 if e.grouped}
        names = {e.name for e in plan.fp8} - experts
        _check_even_shards(model, names, cfg)
        convert_experts(model, experts, cfg, plan.hardware)
        config = float8_config(cfg)
        conv1ds = {n for n in names if is_conv1d(model.get_submodule(n))}
        linears = names - conv1ds  # Float8Conv1D is an nn.Linear subclass: never handed to torchao's converter
        for name in sorted(conv1ds):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, to_float8_conv1d(model.get_submodule(name), config))
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in linears)

    def after_shard(self, model: nn.Module, inner: nn.Module, plan, cfg, group) -> FP8Wiring:
        """With FP8 all-gather, recompute the FP8 weight scales after each step of any optimizer that holds this
        model's parameters (one all-reduce, as ``precompute_float8_dynamic_scale_for_fsdp`` documents)."""
        if plan.fp8 and fp8_all_gather(cfg):
            register_scale_precompute(inner)
            return FP8Wiring(scale_precompute=True)
        return FP8Wiring()


BACKEND = TorchaoBackend()


def _check_even_shards(model: nn.Module, names: set[str], cfg) -> None:
    """torchao's FP8 all-gather fails on uneven FSDP2 shards (gloo: "Received data size doesn't match";
    pytorch/ao#3982): refuse before converting, with the ways out."""
    if not fp8_all_gather(cfg) or not torch.distributed.is_initialized():
        return
    world = torch.distributed.get_world_size()
    uneven = [f"{n} ({m.weight.shape[0]} rows)" for n, m in model.named_modules()  # Conv1D: (in, out)
              if n in names and m.weight.shape[0] % world]
    if uneven:
        more = f" and {len(uneven) - 3} more" if len(uneven) > 3 else ""
        raise ValueError(
            f"FP8 all-gather (torchao under FSDP2) needs every FP8 weight's rows divisible by the {world} ranks; "
            f"{', '.join(uneven[:3])}{more} are not, and torchao's FP8 all-gather of uneven shards fails "
            "(pytorch/ao#3982). Pass fp8_all_gather=False (bf16 all-gather, FP8 GEMMs kept), keep these layers "
            "out of FP8 with fp8_exclude, or use a world size that divides their rows.")


# models whose FP8 weight scales are recomputed after their optimizer's step; a model leaves with its last reference
_PRECOMPUTE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
# per optimizer: its parameter count when checked, and which of the models it steps over
_OWNERS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, weakref.WeakKeyDictionary]]" = \
    weakref.WeakKeyDictionary()


def _owns(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    count = param_count(optimizer)
    known = _OWNERS.get(optimizer)
    if known is None or known[0] != count:
        known = (count, weakref.WeakKeyDictionary())
        _OWNERS[optimizer] = known
    if model not in known[1]:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        known[1][model] = any(id(p) in ids for p in model.parameters())
    return known[1][model]


def _precompute_after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for model in list(_PRECOMPUTE):
        if _owns(optimizer, model):
            precompute_float8_dynamic_scale_for_fsdp(model)


_HOOK = ProcessStepHook(_precompute_after_step, pre=False)


def register_scale_precompute(model: nn.Module) -> None:
    """Run ``precompute_float8_dynamic_scale_for_fsdp(model)`` after every ``optimizer.step()`` of an optimizer
    that holds ``model``'s parameters, for as long as ``model`` lives. The user never has to call it."""
    _PRECOMPUTE.add(model)
    _HOOK.ensure_registered()
