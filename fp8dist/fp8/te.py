"""Transformer Engine: nn.Linear -> te.Linear, GPT-2's Conv1D -> TEConv1D, LayerNorm / RMSNorm -> TE's (weights
copied), fused MoE experts through torchao's grouped GEMMs; the forward under TE's FP8 autocast. Written against TE
2.20's sources; it needs CUDA, so here only a stand-in of that API tests the wiring, never proof that TE works."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config.axis import ALWAYS, LEVELS, Rule, StrategyFacts
from ..runtime.hardware import Hardware
from .base import (SELECTION_OPTIONS, FP8Backend, FP8Wiring, HandConverted, dims_reason, fp8_hardware_reason,
                   linear_reason)
from .casts import MXFP8_BYTES, NVFP4_BYTES, NVFP4_NOT_EMULATED, USES, Casts, CastSpec, nvfp4_casts
from .conv1d import conv1d_dims, is_conv1d, te_conv1d_class
from .moe import (convert_experts, experts_casts, experts_reason, experts_speed_recipe, experts_target, is_experts,
                  moe_routers, torchao_installed)
from .te_config import TEConfig
from .te_speed import TE_RECIPES
from .te_recipe import BLOCKWISE_CUDA, GATES, NO_CASTS, QUANTIZED_OPTIMIZER_NOTE, build_recipe, quantized_init_recipe


def _is_rmsnorm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")) and \
        isinstance(weight, torch.Tensor) and weight.dim() == 1


def _rmsnorm_eps(module: nn.Module) -> float:
    eps = getattr(module, "eps", None)
    if eps is None:
        eps = getattr(module, "variance_epsilon", None)
    return float(eps) if eps is not None else torch.finfo(module.weight.dtype).eps


def _te_module(te: Any, module: nn.Module, quantized: Any = None) -> nn.Module:
    """The TE counterpart of ``module``, weights copied; a Linear created under ``te.quantized_model_init(recipe=
    quantized)`` where that is given."""
    if quantized is not None and (isinstance(module, nn.Linear) or is_conv1d(module)):
        with te.quantized_model_init(enabled=True, recipe=quantized):
            return _te_module(te, module)
    weight, bias = module.weight, getattr(module, "bias", None)
    common = {"params_dtype": weight.dtype, "device": weight.device}
    if is_conv1d(module):  # te.Linear holds (out, in): the Conv1D's (in, out) weight goes in transposed
        new, weight = te_conv1d_class(te.Linear)(*conv1d_dims(module), bias=bias is not None, **common), weight.t()
    elif isinstance(module, nn.Linear):  # a plain Linear of any class (the plan converts no other)
        new = te.Linear(module.in_features, module.out_features, bias=bias is not None, **common)
    elif type(module) is nn.LayerNorm:
        new = te.LayerNorm(module.normalized_shape[0], eps=module.eps, **common)
    else:
        new = te.RMSNorm(weight.shape[0], eps=_rmsnorm_eps(module), **common)
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias)
    return new


def apply_fp8_autocast(module: nn.Module, *, fp8_recipe: Any, group: Any, during_eval: bool) -> None:
    """Run ``module``'s forward under TE's FP8 autocast with ``fp8_recipe``, amax reduced over ``group``, while
    training (and in eval if ``during_eval``). Replaces the instance ``forward`` after sharding, so FSDP2's hooks,
    which ``__call__`` runs around it, stay in place."""
    import transformer_engine.pytorch as te

    forward = module.forward
    if hasattr(te, "autocast"):  # TE >= 2.9; its te.fp8_autocast before (since then a deprecated shim)
        autocast = functools.partial(te.autocast, recipe=fp8_recipe, amax_reduction_group=group)
    else:
        autocast = functools.partial(te.fp8_autocast, fp8_recipe=fp8_recipe, fp8_group=group)

    @functools.wraps(forward)
    def fp8_forward(*args, **kwargs):
        with autocast(enabled=module.training or during_eval):
            return forward(*args, **kwargs)

    module.forward = fp8_forward  # type: ignore[method-assign]


_RULES = (
    Rule(("fp8_weights", "strategy"), lambda cfg, facts: cfg.precision.fp8_weights and not facts.dtensor_shards,
         "fp8dist wires Transformer Engine's quantized weights (quantized_model_init) only where each parameter is a "
         "DTensor shard FSDP2 all-gathers, the layout TE 2.10 fixed and its FSDP2 example runs",
         "Use strategy='fsdp', or leave fp8_weights off."),
    Rule(("fp8_weights", "memory"),
         lambda cfg, facts: cfg.precision.fp8_weights and LEVELS[cfg.parallel.memory].builds_optimizer,
         "quantized weights need an optimizer that keeps fp32 master weights (TE's FusedAdam with "
         "master_weights=True), and this memory level builds its own optimizer over the stored weights",
         "Use memory='standard' with fp8_weights, or leave fp8_weights off."),
    Rule(("compile", "fp8"), lambda cfg, facts: cfg.parallel.compile is True,
         "fp8dist has not yet run Transformer Engine's modules inside torch.compile'd blocks on a GPU (TE prepared "
         "te.Linear for compile in v2.16); its fused kernels run uncompiled",
         "Use compile=False (or None: auto decides)."),
    Rule(("activation_checkpointing", "fp8"), lambda cfg, facts: cfg.parallel.activation_checkpointing != "none",
         "torch's activation checkpointing would run Transformer Engine's FP8 forward twice per step and update its "
         "amax history twice; TE's own te.distributed.checkpoint is not wired in yet",
         "Use activation_checkpointing='none'."),
)


class TEBackend(FP8Backend):
    """Transformer Engine (``fp8='te'``): each planned Linear swapped for ``te.Linear`` (and norms for TE's), run
    under ``te.fp8_autocast`` with the configured recipe, its amax reduced over the process group wrap_model is given
    (the world by default)."""
    name = "te"
    package = "transformer_engine"
    options = {"torchao_moe_recipe": ALWAYS, **SELECTION_OPTIONS}  # its MoE experts run torchao's grouped GEMMs
    rules = _RULES
    takes_amax_group = True

    def describe(self, cfg, facts: StrategyFacts) -> str:
        """The recipe (DelayedScaling with its margin and history, current, blockwise, MXFP8, NVFP4) and whether
        weights are held quantized, for the plan header."""
        weights = "; weights held quantized (quantized_model_init)" if cfg.precision.fp8_weights else ""
        return self._recipe_words(cfg) + weights

    def _recipe_words(self, cfg) -> str:
        p = cfg.precision
        if p.te_recipe == "delayed":
            return (f"DelayedScaling {p.fp8_format}, margin {p.margin}, amax_history_len {p.amax_history_len}, "
                    f"amax_compute_algo {p.amax_compute_algo}")
        if p.te_recipe == "blockwise":
            return (f"Float8BlockScaling {p.fp8_format}, 1x128 blocks (activations, gradients) and 128x128 "
                    "(weights), needs sm_90+ and CUDA >= 12.9")
        if p.te_recipe == "nvfp4":
            return ("NVFP4BlockScaling: FP4 e2m1, 1x16 blocks with e4m3 scales (16x16 for weights), random Hadamard "
                    "transform and stochastic rounding on gradients, needs sm_100+")
        return f"{p.te_recipe} scaling {p.fp8_format}"

    def missing_reason(self, cfg) -> str | None:
        """Why TE cannot be used here: not installed, or ``te_recipe='blockwise'`` with a torch built for CUDA < 12.9;
        None when it can."""
        if importlib.util.find_spec("transformer_engine") is None:
            return "Transformer Engine is not installed (pip install 'fp8dist[te]' on a CUDA machine)"
        cuda = torch.version.cuda  # the installed build, not the target: a plan for another machine skips this
        if cfg.precision.te_recipe == "blockwise" and cuda and \
                tuple(int(x) for x in cuda.split(".")[:2]) < BLOCKWISE_CUDA:
            return (f"te_recipe='blockwise' (Float8BlockScaling) needs PyTorch and Transformer Engine built for CUDA "
                    f">= 12.9, this torch is built for CUDA {cuda}: install a CUDA 12.9+ build, or choose "
                    "te_recipe='current'")
        return None

    def hardware_reason(self, cfg, hardware: Hardware) -> str | None:
        """sm_89+ for delayed and current scaling; :data:`GATES` for the block-scaled recipes, refused with those the
        device runs."""
        recipe = cfg.precision.te_recipe
        if recipe not in GATES:
            return fp8_hardware_reason(hardware)
        needs, name, arch = GATES[recipe]
        if fp8_hardware_reason(hardware, min_capability=needs) is None:
            return None
        need, target = f"sm_{needs[0]}{needs[1]}+", "b200" if needs >= (10, 0) else "h100"
        head = f"te_recipe={recipe!r} ({name}) needs a CUDA GPU with {need} ({arch} or newer)"
        if hardware.type != "cuda" or (no_fp8 := fp8_hardware_reason(hardware)) is not None:  # no FP8 recipe runs
            where = f"device is {hardware}" if hardware.type != "cuda" else no_fp8
            return f"{head}; {where}. Plan for a GPU that has it (fp8dist plan --target {target})"
        runs = [f"{r!r} ({GATES[r][1]}, sm_{GATES[r][0][0]}{GATES[r][0][1]}+), " for r in GATES
                if r != recipe and hardware.capability >= GATES[r][0]]
        return (f"{head}, not {hardware}. Choose te_recipe={''.join(runs)}'current' or 'delayed' (sm_89+), or plan "
                f"for a GPU that has it (fp8dist plan --target {target})")

    def supports(self, module: nn.Module) -> bool:  # the FP8 GEMMs and the norms
        """The modules TE swaps: Linears, GPT-2 Conv1Ds and MoE experts (FP8 GEMMs), LayerNorms and RMSNorms (TE's
        norms, no FP8 compute)."""
        return self.computes_in_fp8(module) or type(module) is nn.LayerNorm or _is_rmsnorm(module)

    def converted_class(self, module: nn.Module, cfg, hardware: Hardware) -> str:
        """te.Linear, TEConv1D, the experts' torchao grouped GEMM, or TE's LayerNorm / RMSNorm."""
        if isinstance(module, nn.Linear):
            return "te.Linear"
        if is_conv1d(module):
            return "TEConv1D (te.Linear, checkpoints keep (in, out))"
        if is_experts(module):
            return experts_target(cfg, hardware)
        return "te.LayerNorm" if type(module) is nn.LayerNorm else "te.RMSNorm"

    def computes_in_fp8(self, module: nn.Module) -> bool:
        """True for Linears, Conv1Ds and MoE experts; False for the norms TE swaps."""
        return isinstance(module, nn.Linear) or is_conv1d(module) or is_experts(module)

    def model_exclusions(self, model: nn.Module, cfg) -> dict[str, str]:
        """MoE routers, and every supported module whose weight is tied to another's (TE's module would untie them)."""
        owners: dict[int, list[str]] = {}
        for name, module in model.named_modules():
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), []).append(name)
        out = moe_routers(model)
        for name, module in model.named_modules():
            tied = [n for n in owners.get(id(getattr(module, "weight", None)), ()) if n != name]
            if tied and self.supports(module):
                out[name] = (f"weight tied to {tied[0]}.weight: Transformer Engine's module would hold a weight of its "
                             "own and untie them; kept in high precision")
        return out

    def ineligible_reason(self, module: nn.Module, fqn: str, cfg, hardware: Hardware,
                          facts: StrategyFacts) -> str | None:
        """Why ``module`` cannot run under TE: a Linear's or Conv1D's dims, MoE experts without torchao, a LayerNorm
        over several dims or without affine weight and bias; None when it can."""
        if is_conv1d(module):
            return dims_reason(module)
        if is_experts(module):  # TE's GroupedLinear holds one weight per expert: no drop-in for fused experts
            if not torchao_installed():
                return ("MoE experts (fused 3-D weights): Transformer Engine has no module for them (its GroupedLinear "
                        "holds one weight per expert), and fp8dist runs them through torchao's MoE grouped GEMMs, "
                        "which needs torchao (pip install torchao)")
            return experts_reason(module, cfg, hardware, facts)
        if isinstance(module, nn.Linear):
            return linear_reason(module)
        if type(module) is nn.LayerNorm:
            if len(module.normalized_shape) != 1:
                return f"normalized_shape={tuple(module.normalized_shape)}: te.LayerNorm normalizes one dim"
            if module.weight is None or module.bias is None:
                return "nn.LayerNorm without affine weight and bias: te.LayerNorm always has both"
        return None

    def convert(self, model: nn.Module, plan, cfg) -> None:
        """Swap the plan's converted modules for TE's (weights copied; created under ``quantized_model_init`` with
        ``fp8_weights``), MoE experts for torchao's grouped GEMMs; before sharding (step 6). Raises ValueError for a
        knob the installed TE would drop (before anything changes), ImportError without TE."""
        import transformer_engine.pytorch as te

        recipe = build_recipe(cfg)  # a knob this TE would drop is refused before anything changes
        quantized = quantized_init_recipe(te, recipe) if cfg.precision.fp8_weights else None
        if quantized is not None:
            warnings.warn(QUANTIZED_OPTIMIZER_NOTE, UserWarning, stacklevel=2)
        experts = {e.name for e in plan.converted if e.grouped}
        convert_experts(model, experts, cfg, plan.hardware)  # torchao's MoE grouped GEMMs
        for name in [e.name for e in plan.converted if e.name not in experts]:
            model.set_submodule(name, _te_module(te, model.get_submodule(name), quantized))

    def after_shard(self, model: nn.Module, inner: nn.Module, plan, cfg, group) -> FP8Wiring:
        """Run ``inner``'s forward under TE's FP8 autocast with the configured recipe, amax reduced over ``group``
        (None: the world group); flat parameters (FSDP1) prepared with TE's ``prepare_te_modules_for_fsdp``. Returns
        the recipe and the group."""
        if plan.facts.flat_params:
            import transformer_engine.pytorch as te

            te.distributed.prepare_te_modules_for_fsdp(model)
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        recipe = build_recipe(cfg)
        apply_fp8_autocast(inner, fp8_recipe=recipe, group=group, during_eval=cfg.precision.use_autocast_during_eval)
        return FP8Wiring(autocast_recipe=recipe, amax_group=group)

    speed_recipes = TE_RECIPES

    def speed_recipe(self, cfg, hardware: Hardware, *, grouped: bool = False) -> tuple[str | None, str]:
        """``te_<te_recipe>`` where :attr:`speed_recipes` has it (the experts: torchao's MoE recipe); else no
        prediction and why."""
        if grouped:
            return experts_speed_recipe(cfg, hardware)
        name = f"te_{cfg.precision.te_recipe}"
        if any(recipe.name == name for recipe in self.speed_recipes):
            return name, ""
        return None, (f"the speed model has no recipe {name!r} yet (TEBackend.speed_recipes): no prediction for "
                      f"te_recipe={cfg.precision.te_recipe!r}")

    def numerics_casts(self, cfg, facts: StrategyFacts, hardware: Hardware, *, grouped: bool = False) -> Casts:
        """TE's casts as CastSpecs: delayed (its margin and amax history), current (tensorwise), MXFP8 or NVFP4;
        gradients e5m2 under HYBRID. NotImplementedError for a recipe not modelled (blockwise), with the way out."""
        if grouped:
            return experts_casts(cfg, hardware)
        p = cfg.precision
        if p.te_recipe == "nvfp4":
            return nvfp4_casts()
        if p.te_recipe in NO_CASTS:
            raise NotImplementedError(NO_CASTS[p.te_recipe])
        grad = torch.float8_e5m2 if p.fp8_format == "HYBRID" else torch.float8_e4m3fn
        scaling = {"delayed": "delayed", "mxfp8": "mx"}.get(p.te_recipe, "tensorwise")
        history = {"margin": p.margin, "history_len": p.amax_history_len, "algo": p.amax_compute_algo}
        return {(role, gemm): CastSpec(grad if role == "grad_output" else torch.float8_e4m3fn, scaling,
                                       **(history if scaling == "delayed" else {})) for role, gemm in USES}

    def numerics_note(self, cfg) -> str:
        """That TE's recipe was emulated with torchao's casts, and what the emulation of delayed scaling and NVFP4
        leaves out."""
        return (f"Transformer Engine's {cfg.precision.te_recipe} recipe emulated with torchao's casts (TE needs a GPU)"
                + ("; the amax history starts warmed up (the first batch's own amax; TE starts at scale 1)"
                   if cfg.precision.te_recipe == "delayed" else "")
                + (f"; {NVFP4_NOT_EMULATED}" if cfg.precision.te_recipe == "nvfp4" else ""))

    accelerate_backend = "TE"

    def convert_by_hand(self, model: nn.Module, facts: StrategyFacts) -> HandConverted:
        """TE as its documentation wires a Hugging Face Llama: nn.Linear -> te.Linear, LlamaRMSNorm -> te.RMSNorm,
        the forward under ``te.autocast`` with the default DelayedScaling over the world group."""
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling

        for name, module in list(model.named_modules()):
            if type(module) is nn.Linear or type(module).__name__ == "LlamaRMSNorm":
                model.set_submodule(name, _te_module(te, module))  # the swap TE's docs show, weights copied
        linears = [m for m in model.modules() if isinstance(m, te.Linear)]
        recipe = DelayedScaling()
        return HandConverted(len(linears), sum(m.weight.numel() for m in linears),
                             forward_context=lambda: te.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD))

    extra_state = "Transformer Engine FP8 state (scales and amax history, in `_extra_state`)"

    derived_bytes = True
    saved_weight_bytes = 2

    def saved_input_bytes(self, cfg) -> float:
        """The input's quantized copy TE saves: NVFP4 (4-bit values and block scales), MXFP8 (1 byte and block
        scales) or FP8 (1 byte)."""
        return {"nvfp4": NVFP4_BYTES, "mxfp8": MXFP8_BYTES}.get(cfg.precision.te_recipe, 1.0)

    def state_tensors(self, module: nn.Module) -> list[Any]:
        """The module's buffers and its ``fp8_meta`` (scales and amax history)."""
        return super().state_tensors(module) + [getattr(module, "fp8_meta", None)]  # scales and amax history

    def element_bytes(self, cfg, base, converted: bool, n_states: int):
        """``fp8_weights``: a converted weight in 1 byte (NVFP4's 4 bits and scales counted as 1) and an fp32 master
        copy the optimizer must keep; otherwise unchanged."""
        if not (converted and cfg.precision.fp8_weights):
            return base
        return dataclasses.replace(base, weight=1, master=base.master or 4,
                                   dtypes=("fp8", base.dtypes[1] if base.master else "fp32", *base.dtypes[2:]))

    def fp8_state_bytes(self, cfg, plan) -> int:
        """DelayedScaling keeps, per FP8 ``te.Linear``, an fp32 scale and amax history for each of its 5 FP8 tensors
        (input, weight, output; output and input gradients; TE 2.x keeps no separate scale_inv). Current: none."""
        history = cfg.precision.amax_history_len if cfg.precision.te_recipe == "delayed" else 0
        return sum(not e.grouped for e in plan.fp8) * 5 * 4 * (1 + history) if history else 0

    def gemm_words(self, module: nn.Module, wiring: FP8Wiring) -> str | None:
        """The formats of the autocast recipe (fp8 e4m3 / e5m2 grads, or fp4 e2m1 with e4m3 block scales) and its
        class; None without one."""
        recipe = wiring.autocast_recipe
        if recipe is None:
            return None
        if getattr(recipe, "fp4_format", None) is not None:  # NVFP4: e2m1 values, e4m3 block scales
            return f"fp4 {recipe.fp4_format.name.lower()}, e4m3 block scales ({type(recipe).__name__})"
        fmt = getattr(getattr(recipe, "fp8_format", None), "name", "E4M3")
        formats = "fp8 e4m3 fwd, e5m2 grads" if fmt == "HYBRID" else f"fp8 {fmt.lower()}"
        return f"{formats} ({type(recipe).__name__})"

    Config = TEConfig


BACKEND = TEBackend()
"""The Transformer Engine backend ``fp8='te'`` selects (registered by :func:`fp8dist.fp8.register_builtins`)."""
