"""torchao's knobs (:class:`TorchaoConfig`, the torchao backend's ``Config``) and what they resolve to: the API dense
Linears convert by, whether FP8 all-gather runs, the ``Float8LinearConfig`` of a recipe, the recipes that mix. The
knobs are known without importing torch (the CLI's flags): the engine is imported by the functions that need it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..config.axis import StrategyFacts, When

__all__ = ["TorchaoConfig", "torchao_api", "fp8_all_gather", "gathers_fp8", "float8_config", "MIXED"]


@dataclass(kw_only=True, frozen=True)
class TorchaoConfig:
    """torchao's own knobs (flat keys of the config; read only when ``fp8='torchao'``)."""
    keep_first_last_linear: bool = True
    """torchao: keep the first and the last nn.Linear in high precision (they are the most sensitive)."""
    torchao_api: Literal["auto", "module_swap", "weight_wrapper"] = "auto"
    """How torchao converts a dense Linear: module_swap (nn.Linear -> Float8Linear; FP8 all-gather under FSDP2) or
    weight_wrapper (``quantize_``: the weight becomes a tensor subclass whose F.linear runs FP8; bf16 all-gather; not
    under FSDP1 or DeepSpeed). auto: weight_wrapper for MXFP8, else module_swap where the installed torchao ships
    it. Every FP8 layer is checked to run an FP8 GEMM; one the wrapper does not reach (Falcon's ``x @ W.T``) is
    swapped instead (kept out of MXFP8, which has no module swap), and the plan says so."""
    torchao_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "mxfp8_emulated",
                            "nvfp4", "auto"] = "tensorwise"
    """torchao scaling recipe: tensorwise (fastest; FP8 all-gather under FSDP2), rowwise (more accurate),
    rowwise_with_gw_hp (rowwise, weight gradient in high precision), mxfp8 (e4m3 in 1x32 blocks, e8m0 scales, weight
    wrapper only; CUDA sm_100+; dims multiples of 32), mxfp8_emulated (MXFP8 with emulated GEMMs on any device: no
    FP8 speed), nvfp4 (nn.Linear -> NVFP4Linear, FP4 GEMMs; CUDA sm_100+ and Triton; dims multiples of 128). auto:
    per layer, whichever of the first three is predicted fastest on the plan's GPU (the strategy's precision where
    none pays; tensorwise where nothing is predicted, a CPU), each converted by the module swap with a filter per
    recipe. The MXFP8 and NVFP4 recipes run whole-model only (fp8dist plan --compare-recipes)."""
    torchao_moe_recipe: Literal["auto", "fp8_rowwise", "mxfp8", "mxfp8_emulated"] = "auto"
    """MoE experts (transformers' fused 3-D experts) in torchao's grouped GEMMs, under fp8='torchao' and 'te' alike.
    auto: fp8_rowwise on CUDA sm_90, mxfp8 on sm_100+, none on CPU; mxfp8_emulated runs anywhere (no FP8 speed)."""
    fp8_all_gather: bool | None = field(default=None, metadata={"none": "auto, the default",
                                                               "when": When(facts=("dtensor_shards",))})
    """torchao under FSDP2: all-gather weights in FP8 (half the bytes of bf16). none: on for tensorwise (under
    torchao_recipe='auto': its tensorwise layers), off for rowwise recipes and torchao_api='weight_wrapper'."""


def torchao_api(cfg) -> str:
    """The torchao API dense Linears convert by: as configured; "auto": the weight wrapper for MXFP8, else the module
    swap while the installed torchao has it (every measured path rests on it), else the weight wrapper."""
    from .moe import torchao_installed
    from .mx_linear import is_mx

    api = cfg.precision.torchao_api
    if api != "auto":
        return api
    if is_mx(cfg.precision.torchao_recipe) or (torchao_installed() and not _has_module_swap()):
        return "weight_wrapper"
    return "module_swap"


def _has_module_swap() -> bool:
    try:
        import torchao.float8 as float8
    except ImportError:
        return False
    return hasattr(float8, "convert_to_float8_training")


def fp8_all_gather(cfg, facts: StrategyFacts) -> bool:
    """FP8 all-gather runs: FSDP2's DTensor shards, the module swap's tensorwise recipe (or auto), not turned off."""
    p = cfg.precision
    return (facts.dtensor_shards and p.torchao_recipe in ("tensorwise", "auto") and p.fp8_all_gather is not False
            and torchao_api(cfg) == "module_swap")


def gathers_fp8(entry) -> bool:
    """Whether a plan's FP8 entry gathers in FP8 where FP8 all-gather is on: a Linear on tensorwise, never experts,
    nor a layer planned to gather in high precision (``high_precision_gather``: a DoRA base)."""
    return not entry.grouped and entry.recipe in (None, "tensorwise") and entry.high_precision_gather is None


def float8_config(cfg, facts: StrategyFacts) -> Any:
    """The ``Float8LinearConfig`` of ``cfg``'s recipe (a layer's own: ``layer_config``), FP8 all-gather on where it
    applies; None for a recipe it does not configure."""
    from torchao.float8 import Float8LinearConfig

    from .mx_linear import is_mx

    recipe = cfg.precision.torchao_recipe
    if is_mx(recipe) or recipe in ("nvfp4", "auto"):  # MX wrapped, NVFP4 its own, auto: per layer
        return None
    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather(cfg, facts))
    return Float8LinearConfig.from_recipe_name(recipe)


MIXED = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""The recipes torchao_recipe='auto' picks among per layer (``convert_to_float8_training`` once per recipe). MXFP8
and NVFP4 convert by other APIs, whose mix with Float8Linear torchao neither documents nor tests: whole-model only."""
