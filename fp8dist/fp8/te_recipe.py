"""Transformer Engine's recipes as fp8dist builds them (:func:`build_recipe`), what each block-scaled one needs of the
GPU (:data:`GATES`), the DelayedScaling knobs TE 2.x dropped, the recipes the numerics probe does not model. Read from
TE 2.20.2's sources (transformer_engine/common/recipe, transformer_engine/pytorch/quantization.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

GATES = {"mxfp8": ((10, 0), "MXFP8BlockScaling", "Blackwell"),
         "blockwise": ((9, 0), "Float8BlockScaling", "Hopper"),
         "nvfp4": ((10, 0), "NVFP4BlockScaling", "Blackwell")}
"""Recipes that need more than sm_89: the capability TE 2.20 checks (``_compute_*_support``), class, architecture."""

BLOCKWISE_CUDA = (12, 9)
"""Float8BlockScaling's block-scaled GEMMs need a CUDA build >= 12.9 as well as sm_90 (TE 2.20's check)."""


_RETIRED_KNOBS = {
    "override_linear_precision": ("TE 2.x's nearest is Float8CurrentScaling(backward_override='high_precision'), "
                                  "backward GEMMs from high-precision operands, which fp8dist does not offer yet"),
    "interval": "TE 2.x updates the scales after every step; nothing replaced it",
}
"""DelayedScaling knobs that TE 2.x dropped (its recipes silently ignore them), and what, if anything, replaced them."""


def _te_version(unknown: str = "unknown") -> str:
    import transformer_engine

    return getattr(transformer_engine, "__version__", unknown)


def _delayed_knobs(recipe_cls: type, precision: Any) -> dict[str, Any]:
    """The retired knobs the installed ``DelayedScaling`` still has, with their values; others must be defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(type(precision))}
    have = {f.name for f in dataclasses.fields(recipe_cls)}
    out = {}
    for name, replaced in _RETIRED_KNOBS.items():
        value = getattr(precision, name)
        value = tuple(value) if isinstance(value, (list, tuple)) else value
        if name in have:
            out[name] = value
        elif value != defaults[name]:
            raise ValueError(f"{name}={value!r}: Transformer Engine {_te_version()}'s DelayedScaling has no {name} and "
                             f"would drop it without a word ({replaced}). Leave {name} at its default "
                             f"{defaults[name]!r}, or install a Transformer Engine whose DelayedScaling takes it.")
    return out


def build_recipe(cfg) -> Any:
    """The TE recipe object for the config (TE's defaults but the format and DelayedScaling's knobs). Raises
    ValueError for a recipe the installed TE lacks, or a knob it lacks set to a non-default value."""
    from transformer_engine.common import recipe

    p = cfg.precision.knobs("te")  # TEConfig: its defaults tell a retired knob's non-default value
    fmt = getattr(recipe.Format, p.fp8_format)
    if p.te_recipe == "current":
        return recipe.Float8CurrentScaling(fp8_format=fmt)
    if p.te_recipe == "mxfp8":
        return recipe.MXFP8BlockScaling(fp8_format=fmt)
    if p.te_recipe in ("blockwise", "nvfp4"):
        name = GATES[p.te_recipe][1]
        if not hasattr(recipe, name):
            raise ValueError(f"te_recipe={p.te_recipe!r}: Transformer Engine {_te_version()} has no recipe.{name}. "
                             "Install a newer Transformer Engine (2.20 has it), or choose te_recipe='current'.")
        # NVFP4's fp8_format is its block scales' (E4M3, the only one TE accepts): fp8_format is not passed
        return getattr(recipe, name)() if p.te_recipe == "nvfp4" else getattr(recipe, name)(fp8_format=fmt)
    return recipe.DelayedScaling(margin=p.margin, fp8_format=fmt, amax_history_len=p.amax_history_len,
                                 amax_compute_algo=p.amax_compute_algo, **_delayed_knobs(recipe.DelayedScaling, p))


NO_CASTS = {
    "blockwise": ("te_recipe='blockwise': the numerics probe has no model of Float8BlockScaling's casts (1x128 blocks "
                  "for activations and gradients, 128x128 for weights, power-of-2 scales; fp8dist.fp8.casts models "
                  "tensorwise, rowwise, MX 1x32, NVFP4 and delayed scaling). Probe with te_recipe='current' (one "
                  "scale per tensor: coarser blocks, so usually larger errors than blockwise's), or run without a "
                  "probe."),
}
"""Why the probe refuses the recipes whose casts it does not model, and what to do."""


QUANTIZED_INIT_TE = (2, 10)
"""TE's first release whose ``quantized_model_init`` works under FSDP2 (TE issue #1688)."""


QUANTIZED_OPTIMIZER_NOTE = (
    "fp8_weights=True: Transformer Engine holds the converted weights quantized, so the optimizer must keep fp32 "
    "master weights: build it as te.optimizers.FusedAdam(model.parameters(), master_weights=True, "
    "master_weight_dtype=torch.float32) (TE's FSDP2 example). A plain torch optimizer would step the quantized "
    "weights themselves and lose every update smaller than their resolution; fp8dist does not build it for you yet.")
"""Warned once per ``wrap_model`` with ``fp8_weights``."""


def quantized_init_recipe(te: Any, recipe: Any) -> Any:
    """``recipe``, once the installed TE is one whose quantized weights work under FSDP2 (>= 2.10)."""
    version = _te_version("0")
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())
    if release < QUANTIZED_INIT_TE or not hasattr(te, "quantized_model_init"):
        raise ValueError(f"fp8_weights=True: Transformer Engine {version} is older than 2.10, whose "
                         "quantized_model_init first works under FSDP2 (TE issue #1688). Install Transformer Engine "
                         ">= 2.10, or leave fp8_weights off.")
    return recipe
