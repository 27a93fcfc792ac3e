"""torchao's knobs (:class:`TorchaoConfig`, the torchao backend's ``Config``) and what they resolve to: the API dense
Linears convert by, whether FP8 all-gather runs, the ``Float8LinearConfig`` of a recipe, the recipes that mix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ..config.axis import StrategyFacts, When
from .moe import torchao_installed
from .mx_linear import is_mx

__all__ = ["TorchaoConfig", "torchao_api", "fp8_all_gather", "gathers_fp8", "float8_config", "MIXED"]


@dataclass(kw_only=True, frozen=True)
class TorchaoConfig:
    """torchao's knobs (:attr:`FP8Backend.Config`)."""

    keep_first_last_linear: bool = True
    """torchao: keep the first and the last nn.Linear in high precision (they are the most sensitive)."""
    torchao_api: Literal["auto", "module_swap", "weight_wrapper"] = "auto"
    """How torchao converts a dense Linear: module_swap (``convert_to_float8_training``: nn.Linear -> Float8Linear;
    FP8 all-gather under FSDP2) or weight_wrapper (``quantize_`` with ``Float8TrainingOpConfig``: the weight becomes
    a tensor subclass whose F.linear runs FP8; the module keeps its class; bf16 all-gather; not under FSDP1 or
    DeepSpeed). auto: weight_wrapper for the MXFP8 recipes (their only API here), else module_swap while the
    installed torchao ships it (0.18 does), else weight_wrapper. Either way each planned FP8 layer is checked to
    run an FP8 GEMM (an MX GEMM for MXFP8); one the wrapper does not reach (Falcon's ``x @ W.T``) is swapped for
    Float8Linear instead (kept out of MXFP8, which has no module swap), and the plan says so."""
    torchao_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "mxfp8_emulated",
                            "nvfp4", "auto"] = "tensorwise"
    """torchao scaling recipe: tensorwise (fastest; FP8 all-gather under FSDP2), rowwise (more accurate),
    rowwise_with_gw_hp (rowwise, weight gradient in high precision), mxfp8 (MXFP8: e4m3 in 1x32 blocks with e8m0
    scales; CUDA sm_100+; Linear dims multiples of 32) or mxfp8_emulated (MXFP8's quantization with emulated GEMMs,
    on any device: numerics and tests, no FP8 speed). MXFP8 runs through the weight wrapper only
    (``MXFP8TrainingOpConfig``). nvfp4: torchao's NVFP4 training (nn.Linear -> NVFP4Linear, FP4 GEMMs; CUDA sm_100+
    and Triton only; dims multiples of 128). auto: per layer, the one of tensorwise, rowwise and rowwise_with_gw_hp
    predicted fastest on the plan's GPU (the strategy's precision where none pays; tensorwise for every layer where
    nothing is predicted, a CPU), each converted by the module swap with a filter per recipe (FP8 all-gather for
    the tensorwise layers). The MXFP8 and NVFP4 recipes run whole-model only (fp8dist plan --compare-recipes)."""
    torchao_moe_recipe: Literal["auto", "fp8_rowwise", "mxfp8", "mxfp8_emulated"] = "auto"
    """MoE experts (transformers' fused 3-D experts, e.g. Mixtral's): grouped GEMMs through
    torchao.prototype.moe_training, under fp8='torchao' and fp8='te' alike (TE has no module for fused experts).
    auto: fp8_rowwise on CUDA sm_90, mxfp8 on sm_100+, none on CPU (the plan says why); mxfp8_emulated runs MXFP8's
    quantization with emulated GEMMs anywhere (checks the wiring; no FP8 speed)."""
    fp8_all_gather: bool | None = field(default=None, metadata={"none": "auto, the default",
                                                               "when": When(facts=("dtensor_shards",))})
    """torchao under FSDP2: all-gather weights in FP8 (half the bytes of bf16). none: on for tensorwise,
    off for rowwise recipes (torchao supports it for tensorwise only) and under torchao_api='weight_wrapper';
    under torchao_recipe='auto', on for the layers the plan puts on tensorwise."""


def torchao_api(cfg) -> str:
    """The torchao API dense Linears convert by: as configured; "auto": the weight wrapper for the MXFP8 recipes
    (the only API fp8dist runs them by), else the module swap while the installed torchao has it (torchao 0.18:
    its FP8 all-gather and every measured path rest on it), else the weight wrapper."""
    api = cfg.precision.torchao_api
    if api != "auto":
        return api
    if is_mx(cfg.precision.torchao_recipe):  # torchao trains MXFP8 Linears through the weight wrapper
        return "weight_wrapper"
    return "weight_wrapper" if torchao_installed() and not _has_module_swap() else "module_swap"


def _has_module_swap() -> bool:
    try:
        import torchao.float8 as float8
    except ImportError:
        return False
    return hasattr(float8, "convert_to_float8_training")


def fp8_all_gather(cfg, facts: StrategyFacts) -> bool:
    """FP8 all-gather runs on per-parameter DTensor shards (FSDP2) with the module swap's tensorwise recipe (under
    torchao_recipe='auto': on the layers the plan puts on tensorwise), unless turned off."""
    p = cfg.precision
    return (facts.dtensor_shards and p.torchao_recipe in ("tensorwise", "auto") and p.fp8_all_gather is not False
            and torchao_api(cfg) == "module_swap")


def gathers_fp8(entry) -> bool:
    """Whether a plan's FP8 entry is all-gathered in FP8 where FP8 all-gather is on: a Linear on tensorwise (the
    configured recipe, or its own under auto), never MoE experts."""
    return not entry.grouped and entry.recipe in (None, "tensorwise")


def float8_config(cfg, facts: StrategyFacts) -> Any:
    """The ``Float8LinearConfig`` of ``cfg``'s recipe (a layer's own under torchao_recipe='auto': the backend's
    ``layer_config``); FP8 all-gather switched on where it applies."""
    from torchao.float8 import Float8LinearConfig

    recipe = cfg.precision.torchao_recipe
    if is_mx(recipe) or recipe in ("nvfp4", "auto"):  # MX wrapped, NVFP4 its own, auto: per layer
        return None
    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather(cfg, facts))
    return Float8LinearConfig.from_recipe_name(recipe)


MIXED = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""The recipes torchao_recipe='auto' picks among per layer: each a ``Float8LinearConfig`` of the module swap, so
one model holds several (``convert_to_float8_training`` once per recipe, its filter naming that recipe's layers).
MXFP8 (the weight wrapper's ``MXFP8TrainingOpConfig``) and NVFP4 (``NVFP4Linear``) convert by other APIs, whose mix
with Float8Linear in one sharded model torchao neither documents nor tests, and nothing here (no sm_100) could
prove it runs: they stay whole-model recipes."""
