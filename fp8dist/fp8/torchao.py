"""torchao float8 training on the plan's layers, by the module swap (``convert_to_float8_training``; FP8 all-gather
under FSDP2, its scales precomputed after every optimizer step) or the weight wrapper (:mod:`.weight_wrapper`)."""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..config.axis import Rule, StrategyFacts
from ..config.dtypes import dtype_name
from ..config.text import listing
from ..runtime.hardware import Hardware
from ..runtime.optim import STEP_HOOKS
from .base import (SELECTION_OPTIONS, FP8Backend, FP8Wiring, FrozenWeights, HandConverted, HealthCasts,
                   dims_reason, fp8_hardware_reason, linear_reason)
from .casts import NVFP4_BYTES, NVFP4_NOT_EMULATED, Casts, float8_linear_casts, nvfp4_casts
from .conv1d import is_conv1d, to_float8_conv1d
from .linear import own_output as _own_output, plain_linear_like
from .order import gemm_order
from ..runtime.adapters import without_adapters
from .mx_linear import (MX_BYPASSED, MX_WRAPPED, NVFP4_SWAPPED, convert_nvfp4, is_mx, mx_hardware_reason,
                        mx_gemm_words, mx_linear_casts, mx_linear_reason, mx_op_config, nvfp4_hardware_reason,
                        nvfp4_linear_reason)
from .weight_wrapper import (BYPASSED, WRAPPED, check_fp8_ran as _check_fp8_ran, say_bypassed as _say_bypassed,
                             wrap_linears, wrapped_weight_config, wrapper_reaches)
from .torchao_speed import TORCHAO_RECIPES
from .torchao_config import (MIXED, TorchaoConfig, float8_config, fp8_all_gather, gathers_fp8 as _gathers_fp8,
                             torchao_api)
from .moe import (convert_experts, experts_casts, experts_reason, experts_speed_recipe, experts_target, is_experts,
                  moe_routers, torchao_installed)


_WRAPPER = "torchao's weight wrapper"


def _autocast_low(cfg, facts: StrategyFacts) -> bool:
    """Autocast runs the forward in a low dtype: MXFP8 and rowwise_with_gw_hp's weight-gradient GEMM fail there."""
    return facts.autocast_forward and cfg.parallel.param_dtype != "fp32"


_RULES = (
    Rule(("torchao_api", "torchao_recipe"),
         lambda cfg, facts: torchao_api(cfg) == "module_swap" and is_mx(cfg.precision.torchao_recipe),
         "fp8dist runs torchao's MXFP8 recipes through the weight wrapper (MXFP8TrainingOpConfig) only; the module "
         "swap's Float8Linear has no MXFP8 recipe",
         "Use torchao_api='weight_wrapper' (or 'auto', which picks it for MXFP8), or a tensorwise / rowwise recipe "
         "with the module swap."),
    Rule(("torchao_api", "torchao_recipe"),
         lambda cfg, facts: torchao_api(cfg) == "weight_wrapper" and cfg.precision.torchao_recipe == "nvfp4",
         "torchao's NVFP4 training swaps nn.Linear for NVFP4Linear (NVFP4TrainingConfig); it has no weight wrapper",
         "Use torchao_api='module_swap' (or 'auto') with torchao_recipe='nvfp4'."),
    Rule(("torchao_api", "fp8_all_gather"),
         lambda cfg, facts: bool(cfg.precision.fp8_all_gather) and torchao_api(cfg) == "weight_wrapper",
         f"{_WRAPPER} all-gathers the weight in the param dtype (its fsdp_pre_all_gather casts before gathering); "
         "FP8 all-gather is the module swap's, with the tensorwise recipe (torchao 0.18)",
         "Use torchao_api='module_swap' with torchao_recipe='tensorwise', or leave fp8_all_gather unset."),
    Rule(("torchao_api", "strategy"),
         lambda cfg, facts: torchao_api(cfg) == "weight_wrapper" and facts.flat_params,
         f"flat parameters (FSDP1) drop {_WRAPPER}: its Linears then run in high precision without an error "
         "(measured on 2 gloo ranks, use_orig_params=True: no FP8 GEMM ran)",
         "Use torchao_api='module_swap' under strategy='fsdp1', or strategy='fsdp' (FSDP2) with the wrapper."),
    Rule(("torchao_api", "strategy"),
         lambda cfg, facts: torchao_api(cfg) == "weight_wrapper" and facts.engine_owns_params,
         f"DeepSpeed's parameter handling cannot swap {_WRAPPER} in (measured on 2 gloo ranks: "
         "deepspeed.initialize raises \"_apply(): Couldn't swap Linear.weight\" under ZeRO 1, 2 and 3)",
         "Use torchao_api='module_swap' under strategy='deepspeed', or strategy='fsdp' / 'ddp' with the wrapper."),
    Rule(("fp8_all_gather", "torchao_recipe"),
         lambda cfg, facts: bool(cfg.precision.fp8_all_gather)
         and cfg.precision.torchao_recipe not in ("tensorwise", "auto"),  # auto: its tensorwise layers
         "torchao all-gathers in FP8 only with the tensorwise recipe",
         "Use torchao_recipe='tensorwise' or leave fp8_all_gather unset."),
    Rule(("torchao_recipe", "strategy", "param_dtype"),
         lambda cfg, facts: is_mx(cfg.precision.torchao_recipe) and _autocast_low(cfg, facts),
         "torchao's MXFP8 Linear (mx_mm) does not follow autocast: it meets the autocast dtype's input with the fp32 "
         "weight and fails (\"expected m1 and m2 to have the same dtype\", torchao 0.18, measured on CPU with the "
         "emulated GEMMs)",
         "Use strategy='fsdp' (FSDP2 casts the weights to param_dtype), or param_dtype='fp32'. Real MXFP8 "
         "(torchao_recipe='mxfp8') also needs MXFP8 tensor cores, a CUDA sm_100+ GPU (Blackwell, e.g. B200); "
         "elsewhere (a CPU, an H100) torchao_recipe='mxfp8_emulated' runs MXFP8's quantization with emulated GEMMs "
         "(no FP8 speed)."),
    Rule(("torchao_api", "torchao_recipe"),  # issue 42 item 6: auto mixes by the module swap only
         lambda cfg, facts: cfg.precision.torchao_recipe == "auto" and torchao_api(cfg) == "weight_wrapper",
         "torchao_recipe='auto' mixes recipes through torchao's module swap (convert_to_float8_training once per "
         "recipe, each with its layers' filter); fp8dist does not mix them through the weight wrapper",
         "Use torchao_api='module_swap' (or 'auto') with torchao_recipe='auto', or one recipe with the weight "
         "wrapper."),
    Rule(("torchao_recipe", "strategy", "param_dtype"),
         lambda cfg, facts: cfg.precision.torchao_recipe == "rowwise_with_gw_hp" and _autocast_low(cfg, facts),
         "its high-precision weight-gradient GEMM mixes the autocast dtype with fp32 and fails (torchao 0.18)"),
)


class TorchaoBackend(FP8Backend):
    """torchao float8 (``fp8='torchao'``): planned Linears converted by module swap (``Float8Linear``) or weight
    wrapper, in the configured recipe (tensorwise, rowwise, MXFP8, NVFP4), FP8 all-gather under FSDP2 where the
    recipe allows, MoE experts through its grouped GEMMs."""
    name = "torchao"
    package = "torchao"
    options = SELECTION_OPTIONS
    rules = _RULES

    def describe(self, cfg, facts: StrategyFacts) -> str:
        """The recipe, the API (module swap or weight wrapper, "(auto)" where the installed torchao chose) and
        whether FP8 all-gather is on, for the plan header."""
        on = "off" if not fp8_all_gather(cfg, facts) else "on" + (" (tensorwise layers)" if
                                                                    cfg.precision.torchao_recipe == "auto" else "")
        auto = " (auto)" if cfg.precision.torchao_api == "auto" else ""  # auto: chosen by the installed torchao
        return f"recipe {cfg.precision.torchao_recipe}, {torchao_api(cfg)}{auto}, FP8 all-gather {on}"

    def missing_reason(self, cfg) -> str | None:
        """Why torchao cannot be used here (not installed, with the supported pip range); None when it can."""
        if not torchao_installed():
            from ..runtime.packages import supported_range

            return f"torchao is not installed (pip install 'torchao{supported_range('torchao') or ''}')"

    def hardware_reason(self, cfg, hardware: Hardware) -> str | None:
        """MXFP8 and NVFP4 gated to their GPUs; the float8 recipes to sm_89+ on CUDA (a CPU runs torch's
        ``_scaled_mm``; emulated MXFP8 runs anywhere). ``cfg`` None: the default recipe."""
        recipe = cfg.precision.torchao_recipe if cfg is not None else None  # None: asked of the backend's default
        if recipe == "mxfp8":
            return mx_hardware_reason(hardware)
        if recipe == "nvfp4":
            return nvfp4_hardware_reason(hardware)
        # torch's _scaled_mm also runs on CPU, so only CUDA is gated; emulated MXFP8 runs anywhere
        return fp8_hardware_reason(hardware) if hardware.type == "cuda" and recipe != "mxfp8_emulated" else None

    def supports(self, module: nn.Module) -> bool:
        """Linears, GPT-2 Conv1Ds and MoE experts (fused 3-D weights)."""
        return isinstance(module, nn.Linear) or is_conv1d(module) or is_experts(module)

    def converted_class(self, module: nn.Module, cfg, hardware: Hardware) -> str:
        """Float8Linear, Float8Conv1D, the weight wrapper (or "bypassed" where it would not reach the GEMM), MXFP8's
        or NVFP4's module, or the experts' grouped GEMM."""
        if is_experts(module):
            return experts_target(cfg, hardware)
        if cfg.precision.torchao_recipe == "nvfp4":
            return NVFP4_SWAPPED
        if is_mx(cfg.precision.torchao_recipe):  # eligible MXFP8 Linears are reached by the wrapper
            return MX_WRAPPED[cfg.precision.torchao_recipe]
        if is_conv1d(module):
            return "Float8Conv1D"  # its addmm(bias, x, W) is not a call the wrapper overrides: always swapped
        if torchao_api(cfg) != "weight_wrapper":
            return "Float8Linear"
        return WRAPPED if _reaches(module, cfg) else BYPASSED

    def ineligible_reason(self, module: nn.Module, fqn: str, cfg, hardware: Hardware,
                          facts: StrategyFacts) -> str | None:
        """Why ``module`` cannot run the configured recipe: dims, math, the weight wrapper not reaching its GEMM,
        the experts' own checks; None when it can."""
        if is_experts(module):
            return experts_reason(module, cfg, hardware, facts)
        if cfg.precision.torchao_recipe == "nvfp4":
            return nvfp4_linear_reason(module)
        if is_mx(cfg.precision.torchao_recipe):
            return mx_linear_reason(module) or (None if _reaches(module, cfg) else MX_BYPASSED)
        return dims_reason(module) if is_conv1d(module) else linear_reason(module)

    def model_exclusions(self, model: nn.Module, cfg) -> dict[str, str]:
        """MoE routers, and with ``keep_first_last_linear`` the first and the last Linear in execution order
        (PEFT's adapters aside)."""
        routers = moe_routers(model)
        if not cfg.precision.keep_first_last_linear:
            return routers
        order = gemm_order(model, without_adapters(model, plain_linear_like))  # lora: base layers only
        if order.first is None:
            return routers
        return {**routers, **{name: f"{which} Linear{' (a Conv1D)' if is_conv1d(model.get_submodule(name)) else ''}, "
                              "kept in high precision (keep_first_last_linear=True)"
                              for which, name in (("first", order.first), ("last", order.last))}}

    def convert(self, model: nn.Module, plan, cfg) -> None:
        """Convert exactly the plan's FP8 layers in place, each by its own recipe where the plan picked one per
        layer, then check that every converted Linear runs an FP8 GEMM.

        What changes: each planned ``nn.Linear`` (and GPT-2 ``Conv1D``) becomes torchao's ``Float8Linear`` (the
        tensorwise and rowwise recipes; NVFP4 swaps in its own module), or keeps its class with its weight wrapped
        (MXFP8, ``torchao_api="weight_wrapper"``); MoE experts get torchao's grouped-GEMM weight wrapper. Call it
        before sharding (wrap_model's step 6): FSDP must shard the converted modules' weights, and FP8 all-gather
        needs torchao's weight subclass in place when ``fully_shard`` runs. ``plan``: the model's
        :class:`~fp8dist.plan.precision.PrecisionPlan`; ``cfg``: the resolved Config. Raises ValueError where a
        layer's weight cannot shard evenly for FP8 all-gather, RuntimeError where a converted layer ran no FP8 GEMM."""
        experts = {e.name for e in plan.fp8 if e.grouped}
        names = {e.name for e in plan.fp8} - experts
        _check_even_shards(model, {e.name for e in plan.fp8 if _gathers_fp8(e)}, cfg, plan.facts)
        convert_experts(model, experts, cfg, plan.hardware)
        if cfg.precision.torchao_recipe == "nvfp4":
            return convert_nvfp4(model, names)
        _say_bypassed(plan)
        dense = [e for e in plan.fp8 if not e.grouped]
        swaps, wrapped = [], set()
        groups: dict[tuple, list] = {}  # one conversion per recipe, and per all-gather (a DoRA base's own)
        for e in dense:
            groups.setdefault((e.recipe, e.high_precision_gather is not None), []).append(e)
        for group in groups.values():
            layer = self.layer_config(cfg, group[0])  # these layers as their entries configure them
            swapped, wrapped_now = self._convert_dense(model, group, layer, plan.facts)
            swaps.append((layer, swapped))
            wrapped |= wrapped_now
        _check_fp8_ran(model, sorted(set().union(*(linears for _, linears in swaps)) | wrapped))
        for layer, linears in swaps:  # frozen weights (a LoRA base): cast once where they can be
            from .frozen import freeze_float8_linears

            frozen = self.frozen_weights(layer, plan.facts)  # per entry config, as the estimate asks it
            if linears and not frozen.grad_weight_gemm:  # FP8 all-gather keeps the shard's cast, not the weight's
                cached = frozen.cached_bytes and not fp8_all_gather(layer, plan.facts)
                freeze_float8_linears(model, linears, cache_weight=bool(cached))
        if plan.facts.dtensor_shards:  # a base held in FP8: FSDP2 all-gathers its bits, its scales stay whole
            from .frozen import hold_for_sharding

            hold_for_sharding(model)

    def _convert_dense(self, model: nn.Module, entries: list, layer, facts: StrategyFacts) -> tuple[set[str], set[str]]:
        """Convert ``entries``, all of the recipe in ``layer``; returns the Linears swapped and those wrapped."""
        from torchao.float8 import convert_to_float8_training

        names = {e.name for e in entries}
        config = float8_config(layer, facts)
        conv1ds = {n for n in names if is_conv1d(model.get_submodule(n))}
        wrapped = {e.name for e in entries if e.converted_to in (WRAPPED, *MX_WRAPPED.values())}
        linears = names - conv1ds - wrapped  # Float8Conv1D is an nn.Linear subclass: never handed to the converter
        wrap_linears(model, wrapped, layer.precision.torchao_recipe)
        for name in sorted(conv1ds):
            model.set_submodule(name, to_float8_conv1d(model.get_submodule(name), config))
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in linears)
        for name in linears:
            if model.get_submodule(name).bias is None:  # with a bias, the output is already its own (+ bias)
                model.get_submodule(name).register_forward_hook(_own_output)
        return linears, wrapped

    def after_shard(self, model: nn.Module, inner: nn.Module, plan, cfg, group) -> FP8Wiring:
        """With FP8 all-gather, recompute the FP8 weight scales after each step of any optimizer over this model."""
        from .frozen import cache_frozen_shards, rescale_held_shards

        rescale_held_shards(inner)  # a base held in FP8 under FSDP2: each sharded weight's scale, whole
        precompute = any(_gathers_fp8(e) for e in plan.fp8) and fp8_all_gather(cfg, plan.facts)
        if precompute:  # for as long as ``inner`` lives: the user never has to call it
            cache_frozen_shards(inner)  # a frozen weight's FP8 shard: cast at the first all-gather, then kept
            STEP_HOOKS.add(inner, post=_precompute)
        return FP8Wiring(scale_precompute=precompute)

    def layer_config(self, cfg, entry):
        """As any backend's, and without FP8 all-gather for an entry planned to gather in high precision."""
        layer = super().layer_config(cfg, entry)
        if entry.high_precision_gather is None:
            return layer
        return replace(layer, precision=replace(layer.precision, fp8_all_gather=False))

    def read_weight_gather(self, reader: str, cfg, facts: StrategyFacts) -> str | None:
        """Under FP8 all-gather, a layer whose weight ``reader`` reads is all-gathered in the param dtype: FP8
        all-gather hands the forward a Float8TrainingTensor, which PEFT's DoRA fails to dequantize (peft 0.21,
        torchao 0.18: "attempting to run aten.dequantize.self"); its GEMMs stay FP8."""
        if not fp8_all_gather(cfg, facts):
            return None
        return (f"all-gathered in {cfg.parallel.param_dtype}, not FP8: {reader} reads the gathered weight and cannot "
                "dequantize torchao's FP8 all-gather tensor")

    speed_recipes = TORCHAO_RECIPES

    def speed_recipe(self, cfg, hardware: Hardware, *, grouped: bool = False) -> tuple[str | None, str]:
        """The configured ``torchao_recipe`` (the experts: their MoE recipe); no prediction for emulated MXFP8 or
        under ``torchao_recipe='auto'`` (:meth:`mixed_recipes` then)."""
        if grouped:
            return experts_speed_recipe(cfg, hardware)
        if cfg.precision.torchao_recipe == "mxfp8_emulated":
            return None, "emulated: no speed model"
        if cfg.precision.torchao_recipe == "auto":
            return None, "torchao_recipe='auto': a recipe per layer (mixed_recipes)"
        return cfg.precision.torchao_recipe, ""

    def mixed_recipes(self, cfg, hardware: Hardware, facts: StrategyFacts) -> tuple[str, ...]:
        """Under torchao_recipe='auto', :data:`MIXED` but rowwise_with_gw_hp where :func:`_autocast_low`."""
        if cfg.precision.torchao_recipe != "auto":
            return ()
        return tuple(r for r in MIXED if not (_autocast_low(cfg, facts) and r == "rowwise_with_gw_hp"))

    def numerics_casts(self, cfg, facts: StrategyFacts, hardware: Hardware, *, grouped: bool = False) -> Casts:
        """The casts of the configured recipe: its ``Float8LinearConfig``'s (tensorwise, rowwise), MXFP8's op
        config, NVFP4, or the experts' grouped GEMM casts."""
        if grouped:
            return experts_casts(cfg, hardware)
        if cfg.precision.torchao_recipe == "nvfp4":
            return nvfp4_casts()
        if is_mx(cfg.precision.torchao_recipe):
            return mx_linear_casts(mx_op_config(cfg.precision.torchao_recipe))
        return float8_linear_casts(float8_config(cfg, facts))

    def numerics_note(self, cfg) -> str:
        """What the NVFP4 emulation leaves out, under ``torchao_recipe='nvfp4'``; else empty."""
        return NVFP4_NOT_EMULATED if cfg.precision.torchao_recipe == "nvfp4" else ""

    accelerate_backend = "AO"

    variant_option = "torchao_recipe"

    def saved_input_bytes(self, cfg) -> float:
        """NVFP4Linear saves its input quantized (columnwise NVFP4 codes and scales for the weight-gradient GEMM:
        torchao's ``nvfp4_mm_triton``); the float8 and MXFP8 recipes save the bf16 input (``mx_mm`` saves
        ``input_hp``) and quantize it again in backward."""
        return NVFP4_BYTES if cfg.precision.torchao_recipe == "nvfp4" else 0.0

    def autograd_weight_bytes(self, cfg) -> float:
        """NVFP4Linear saves its weight's transpose quantized for the input-gradient GEMM; the other recipes save the
        weight as gathered (under FSDP2 its storage is freed after forward all the same)."""
        return NVFP4_BYTES if cfg.precision.torchao_recipe == "nvfp4" else 0.0

    def convert_by_hand(self, model: nn.Module, facts: StrategyFacts) -> HandConverted:
        """``convert_to_float8_training`` as torchao documents it: tensorwise, every nn.Linear but the first and the
        last, dims multiples of 16; under DTensor shards FP8 all-gather, its scales precomputed after each step."""
        from torchao.float8 import (Float8LinearConfig, convert_to_float8_training,
                                    precompute_float8_dynamic_scale_for_fsdp as precompute)

        linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
        keep = {linears[0], linears[-1]}
        convert_to_float8_training(
            model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=facts.dtensor_shards),
            module_filter_fn=lambda m, fqn: fqn not in keep and m.in_features % 16 == 0 and m.out_features % 16 == 0)
        fp8 = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
        after_step = (lambda: precompute(model)) if facts.dtensor_shards else (lambda: None)
        return HandConverted(len(fp8), sum(m.weight.numel() for m in fp8), after_step)

    def after_load(self, model: nn.Module, wiring: FP8Wiring) -> None:
        """Recompute the FP8 weight scales (and kept frozen casts) after a load, where ``after_shard`` set up their
        precompute."""
        if wiring.scale_precompute:
            _precompute(model, None)

    rank_imports = ("torchao.float8",)
    commands_default = True

    def health_casts(self, module: nn.Module) -> HealthCasts | None:
        """A ``Float8Linear`` (or ``Float8Conv1D``) or a Linear under torchao's Float8 weight wrapper: the casts of
        its ``Float8LinearConfig`` (the wrapper's built from its recipe), the input cast after autocast where the
        module swap's forward casts it so; None for any other module (an MXFP8 wrapper's included)."""
        from torchao.float8.float8_linear import Float8Linear

        from .weight_wrapper import float8_gemm_config

        config = float8_gemm_config(module)
        if config is None:
            return None
        casts = float8_linear_casts(config)
        return HealthCasts(input=casts[("input", "output")], weight=casts[("weight", "output")],
                           grad_output=casts[("grad_output", "grad_input")],
                           autocast_input=isinstance(module, Float8Linear))  # the wrapper casts its input as it comes
    weight_scale_names = ("_precomputed_scale",)  # the FP8 all-gather's scale, on the weight's local tensor

    def state_tensors(self, module: nn.Module) -> list[Any]:
        """The module's buffers, the FP8 all-gather's precomputed weight scales and the kept casts of frozen weights."""
        from .frozen import kept_casts

        scales = [getattr(getattr(p, "_local_tensor", p), name, None)  # a DTensor's local tensor holds the scale
                  for p in module.parameters(recurse=False) for name in self.weight_scale_names]
        return super().state_tensors(module) + scales + kept_casts(module)

    def runs_held_fp8(self, cfg) -> bool:
        """The module swap's frozen Float8Linear (:class:`~fp8dist.fp8.frozen.FrozenFloat8Linear`) does; the weight
        wrapper, MXFP8 and NVFP4 do not."""
        recipe = cfg.precision.torchao_recipe
        return torchao_api(cfg) == "module_swap" and not is_mx(recipe) and recipe != "nvfp4"

    def frozen_weights(self, cfg, facts: StrategyFacts) -> FrozenWeights:
        """What a frozen weight costs: cast once and kept (tensorwise: the weight, or its FP8 shard under FP8
        all-gather), or recast every step where the recipe, the API or the engine's parameters prevent keeping it."""
        p, skip = cfg.precision, "; no weight-gradient GEMM"
        if torchao_api(cfg) != "module_swap" or is_mx(p.torchao_recipe):
            return FrozenWeights(how=f"{_WRAPPER} casts a frozen weight every step, as a trainable one")
        if facts.flat_params:  # measured: FSDP1's flat parameter requires a gradient as a whole, so do its views
            return FrozenWeights(how="cast every step, its weight gradient computed and dropped: the weight is a view "
                                 "of a flat parameter that needs a gradient")
        if p.torchao_recipe != "tensorwise":
            return FrozenWeights(grad_weight_gemm=False, how=f"recast every step ({p.torchao_recipe}: the forward "
                                 f"and input-gradient GEMMs take the weight in two layouts){skip}")
        if fp8_all_gather(cfg, facts):
            return FrozenWeights(1, 4, False, f"FP8 shard cast once, sent by every all-gather{skip}")
        if facts.shards_params or facts.engine_owns_params:  # the engine's weight at compute time is not kept
            why = "gathered whole in high precision" if facts.shards_params else "the engine manages the parameters"
            return FrozenWeights(grad_weight_gemm=False, how=f"recast every step ({why}: a kept cast would be an "
                                 f"unsharded FP8 copy on every rank){skip}")
        return FrozenWeights(1, 4, False, f"FP8 weight cast once, for the forward and input-gradient GEMMs{skip}")

    def fp8_state_bytes(self, cfg, plan) -> int:
        """The fp32 weight scale FP8 all-gather precomputes, per FP8 Linear (MoE experts' scales live in the GEMM)."""
        return 4 * sum(_gathers_fp8(e) for e in plan.fp8) if fp8_all_gather(cfg, plan.facts) else 0

    def all_gather_words(self, shards: list[torch.Tensor]) -> str | None:
        """"fp8 e4m3 (FP8 all-gather...)" where the shards are torchao's FP8 all-gather weights (and how many of
        them); None otherwise."""
        if "torchao" not in sys.modules:  # no such weights exist before torchao is imported
            return None
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        fp8 = sum(isinstance(t, WeightWithDynamicFloat8CastTensor) for t in shards)
        if not fp8:
            return None
        some = "" if fp8 == len(shards) else f" of {fp8} of {len(shards)} weights, the others in the param dtype"
        return f"fp8 e4m3 (FP8 all-gather{some})"  # some: torchao_recipe='auto', its tensorwise layers

    def gemm_words(self, module: nn.Module, wiring: FP8Wiring) -> str | None:
        """The formats of the module's ``Float8LinearConfig`` (forward, gradients, granularity; the weight wrapper's
        too) or MXFP8's; None for a module without one."""
        wrapper = wrapped_weight_config(module)
        if wrapper is not None and not hasattr(wrapper, "_float8_linear_config"):  # MXFP8's op config
            return mx_gemm_words(wrapper)
        config = wrapper._float8_linear_config if wrapper is not None else getattr(module, "config", None)
        if config is None or not hasattr(config, "cast_config_input"):
            return None
        fwd = dtype_name(config.cast_config_input.target_dtype)
        bwd = dtype_name(config.cast_config_grad_output.target_dtype)
        how = config.cast_config_input.scaling_granularity.value + (", weight wrapper" if wrapper is not None else "")
        return f"{fwd} fwd, {bwd.removeprefix('fp8 ')} grads ({how})"

    Config = TorchaoConfig
    more_variant_options = ("torchao_api",)


BACKEND = TorchaoBackend()
"""The torchao backend ``fp8='torchao'`` selects (registered by :func:`fp8dist.fp8.register_builtins`)."""


def _reaches(module: nn.Module, cfg) -> bool:
    """Whether torchao's weight wrapper reaches ``module``'s GEMM; without torchao (planning for another machine)
    only nn.Linear's own forward is sure to."""
    plain = type(module).forward is nn.Linear.forward and "forward" not in vars(module)
    if not torchao_installed():
        return plain
    if plain:  # nn.Linear's own forward: one probe per bias, dtype and recipe, not one per layer (a 70B has 560)
        return _plain_linear_reaches(module.bias is not None, module.weight.dtype, cfg.precision.torchao_recipe)
    return wrapper_reaches(module, cfg.precision.torchao_recipe)


@functools.lru_cache(maxsize=None)
def _plain_linear_reaches(bias: bool, dtype: torch.dtype, recipe: str) -> bool:
    return wrapper_reaches(nn.Linear(64, 64, bias=bias, dtype=dtype), recipe)


def _check_even_shards(model: nn.Module, names: set[str], cfg, facts: StrategyFacts) -> None:
    """Refuse uneven FSDP2 shards before converting: torchao's FP8 all-gather fails on them (pytorch/ao#3982)."""
    shards = facts.shard_degree
    if not fp8_all_gather(cfg, facts) or not shards or shards == 1:
        return
    uneven = [f"{n} ({m.weight.shape[0]} rows)" for n, m in model.named_modules()  # Conv1D: (in, out)
              if n in names and m.weight.shape[0] % shards]
    if uneven:
        raise ValueError(
            f"FP8 all-gather (torchao under FSDP2) needs every FP8 weight's rows divisible by the {shards} ranks; "
            f"{listing(uneven)} are not, and torchao's FP8 all-gather of uneven shards fails "
            "(pytorch/ao#3982). Pass fp8_all_gather=False (bf16 all-gather, FP8 GEMMs kept), keep these layers "
            "out of FP8 with fp8_exclude, or use a shard group size that divides their rows.")


def _precompute(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    from .frozen import cache_frozen_shards, precompute_trainable

    cache_frozen_shards(model)
    precompute_trainable(model)
