"""MoE experts in FP8 through torchao's MoE training conversion: ``quantize_`` wraps transformers' fused 3-D expert
parameters (Mixtral's ``gate_up_proj``) so each ``torch._grouped_mm`` runs an FP8 rowwise or MXFP8 grouped GEMM;
FSDP2 shards them on their expert dim. The router stays in high precision, as torchtitan keeps it."""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..config.axis import StrategyFacts
from ..runtime.hardware import Hardware
from .casts import USES, Casts, CastSpec
from .mx_linear import mx_gemm_words, mx_linear_casts, mx_op_config

__all__ = ["is_experts", "moe_routers", "experts_recipe", "experts_reason", "experts_target", "convert_experts",
           "experts_gemm_formats", "torchao_installed", "experts_op_config", "experts_speed_recipe",
           "experts_casts"]


def torchao_installed() -> bool:
    """Whether torchao is installed (its version read from the package metadata, nothing imported)."""
    from ..runtime.packages import package_version

    return package_version("torchao") is not None


MOE_RECIPE_LABELS = {"fp8_rowwise": "FP8 rowwise grouped GEMM", "mxfp8": "MXFP8 grouped GEMM",
           "mxfp8_emulated": "MXFP8 grouped GEMM, emulated"}
"""torchao_moe_recipe -> what the plan calls the converted experts."""


def is_experts(module: nn.Module) -> bool:
    """transformers' fused experts module (``@use_experts_implementation``): 3-D parameters, one row per expert."""
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int) or not hasattr(module, "is_transposed"):  # cheap first: planners ask per module
        return False
    params = list(module.parameters(recurse=False))
    return bool(params) and all(p.dim() == 3 and p.shape[0] == experts for p in params)


def moe_routers(model: nn.Module) -> dict[str, str]:
    """``{fqn: why kept in high precision}`` of the routers beside experts modules: a sibling holding a 2-D weight
    (Mixtral's ``mlp.gate``)."""
    names = []
    for parent_name, parent in model.named_modules():
        children = dict(parent.named_children())
        if any(is_experts(child) for child in children.values()):
            for child_name, child in children.items():
                weight = getattr(child, "weight", None)
                if not is_experts(child) and isinstance(weight, torch.Tensor) and weight.dim() == 2:
                    names.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return dict.fromkeys(names, "MoE router, kept in high precision (as torchtitan keeps it)")


def experts_recipe(cfg, hardware: Hardware) -> tuple[str | None, str | None]:
    """``(recipe, None)`` for the configured ``torchao_moe_recipe`` on ``hardware``, or ``(None, why not)``."""
    recipe = cfg.precision.torchao_moe_recipe
    if recipe == "mxfp8_emulated":
        return recipe, None
    if hardware.type != "cuda":
        return None, (f"no FP8 grouped GEMM on {hardware.type}: torchao's FP8 rowwise grouped GEMM needs CUDA sm_90 "
                      "(and triton), MXFP8 needs sm_100; torchao_moe_recipe='mxfp8_emulated' runs the same "
                      "conversion with emulated GEMMs (checks the wiring, no FP8 speed)")
    capability = hardware.capability
    if recipe == "auto":
        recipe = "mxfp8" if capability >= (10, 0) else "fp8_rowwise"
    needs = (10, 0) if recipe == "mxfp8" else (9, 0)
    if capability < needs:
        return None, f"torchao_moe_recipe={recipe!r} needs sm_{needs[0]}{needs[1]}+, not {hardware}"
    return recipe, None


def experts_reason(module: nn.Module, cfg, hardware: Hardware, facts: StrategyFacts) -> str | None:
    """Why torchao's MoE conversion cannot take these experts on ``hardware`` under ``facts``; None: it can."""
    implementation = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if implementation != "grouped_mm":
        return (f"experts_implementation={implementation!r} runs per-expert slices that torchao's grouped-GEMM "
                "conversion does not reach; call model.set_experts_implementation('grouped_mm') (transformers' "
                "default) before wrap_model")
    # engines tried on 2 gloo ranks, and how they failed
    if facts.flat_params:
        return ("flat parameters (FSDP1) drop torchao's MoE weight wrapper (the grouped GEMM then fails on a shape "
                "mismatch)")
    if facts.engine_owns_params:
        return ("DeepSpeed's parameter handling cannot swap torchao's MoE weight wrapper (_apply(): Couldn't swap "
                "MixtralExperts.gate_up_proj, ZeRO 2 and 3)")
    shards = facts.shard_degree
    if facts.dtensor_shards and shards and module.num_experts % shards:  # FSDP2 asserts on 3 ranks, 4 experts
        return (f"{module.num_experts} experts do not split evenly over {shards} FSDP2 shards, and torchao's MoE "
                "weight wrapper all-gathers only even shards (it does not pad); use a shard group size that divides "
                "the experts")
    if getattr(module, "is_transposed", False):
        return "experts stored transposed (in, out): torchao's MoE conversion is wired for (E, out, in) weights"
    recipe, why = experts_recipe(cfg, hardware)
    if recipe is None:
        return why
    tile = 32 if recipe.startswith("mxfp8") else 16
    bad = sorted({d for p in module.parameters(recurse=False) for d in p.shape[1:] if d % tile})
    if bad:
        return f"expert dims {bad} not divisible by {tile} ({MOE_RECIPE_LABELS[recipe]} tiles)"
    return None


def experts_target(cfg, hardware: Hardware) -> str:
    """What the plan records as the converted experts' form."""
    recipe, _ = experts_recipe(cfg, hardware)
    return f"torchao MoE: {MOE_RECIPE_LABELS.get(recipe or '', 'grouped GEMM')}"


def experts_op_config(recipe: str):
    """torchao's MoE training op config of ``recipe`` ("fp8_rowwise", else an MXFP8 recipe): what its grouped-GEMM
    weight wrapper runs with."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig

    return Float8TrainingOpConfig() if recipe == "fp8_rowwise" else mx_op_config(recipe)


def convert_experts(model: nn.Module, names: set[str], cfg, hardware: Hardware) -> None:
    """torchao's MoE training conversion on exactly the experts modules ``names``. Call before sharding."""
    from torchao.quantization import quantize_

    if not names:
        return
    recipe, why = experts_recipe(cfg, hardware)
    if recipe is None:  # the plan never lists experts as FP8 where no recipe runs
        raise RuntimeError(f"MoE experts planned for FP8 but no recipe runs here: {why}")
    quantize_(model, experts_op_config(recipe), filter_fn=lambda module, fqn: fqn in names)
    for name in names:
        model.get_submodule(name).register_state_dict_post_hook(_plain_state)


def _wrapper(t: torch.Tensor | None):
    """torchao's training weight wrapper holding ``t`` (itself, or a DTensor's local shard), or None."""
    if "torchao.prototype.moe_training" not in sys.modules:  # nothing can have been wrapped
        return None
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor

    local = getattr(t, "_local_tensor", t)
    return local if isinstance(local, TrainingWeightWrapperBaseTensor) else None


def experts_gemm_formats(module: nn.Module) -> str | None:
    """What a converted experts module's grouped GEMMs quantize to, from torchao's op config on its weights (None:
    not wrapped)."""
    wrapped = [w for w in map(_wrapper, module.parameters(recurse=False)) if w is not None]
    if not wrapped:
        return None
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig

    from ..config.dtypes import dtype_name

    config = wrapped[0].config

    if isinstance(config, Float8TrainingOpConfig):
        return f"{dtype_name(config.float8_dtype)} fwd+grads (rowwise scales)"
    return mx_gemm_words(config, "32-element blocks, e8m0 scales")


def _plain(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    wrapped = _wrapper(t)
    if wrapped is None:
        return t
    if wrapped is t:
        return wrapped._data
    return DTensor.from_local(wrapped._data, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def _plain_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State dicts hold the plain tensors, sharing the parameters' storage: a weights-only load refuses torchao's
    wrapper class."""
    for name, _ in module.named_parameters(recurse=False):
        if prefix + name in state_dict:
            state_dict[prefix + name] = _plain(state_dict[prefix + name])


# plan: what the speed model and the numerics probe ask of the experts (both backends run them through torchao)
def experts_speed_recipe(cfg, hardware: Hardware) -> tuple[str | None, str]:
    """The speed model's recipe id of the experts' grouped GEMMs on ``hardware``, or ``(None, why there is none)``."""
    recipe, _ = experts_recipe(cfg, hardware)
    if recipe is None or recipe == "mxfp8_emulated":
        return None, f"no speed model for torchao_moe_recipe {recipe!r}"
    return f"moe_{recipe}", ""


def experts_casts(cfg, hardware: Hardware) -> Casts:
    """torchao's MoE grouped GEMMs: FP8 rowwise (e4m3, power-of-2 scales) or MXFP8, as its op config says."""
    recipe, _ = experts_recipe(cfg, hardware)
    config = experts_op_config(recipe)
    if recipe == "fp8_rowwise":
        return {use: CastSpec(config.float8_dtype, "rowwise", pow2=True) for use in USES}
    return mx_linear_casts(config)
