"""torchao's weight wrapper (``quantize_`` with ``Float8TrainingOpConfig``): F.linear / mm / matmul / addmm called on
the wrapped weight run FP8, but a forward that transforms it first (Falcon's ``x @ self.weight.T``) silently runs in
high precision: each layer's own forward is run on a small wrapped copy and its FP8 GEMMs counted, before and after."""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..config.text import listing

__all__ = ["FP8Gemms", "linear_op_config", "wrapped_weight_config", "float8_gemm_config", "weight_data",
           "fp8_gemms_in_forward", "wrapper_reaches",
           "wrap_linears", "unproven_fp8", "WRAPPED", "BYPASSED", "say_bypassed", "check_fp8_ran"]

_PROBE_DIMS = (32, 48)  # (in, out) of the small copy: FP8 GEMM tiles need multiples of 16
_PROBE_ROWS = (2, 16)  # (batch, sequence) of the probe input


class FP8Gemms(TorchDispatchMode):
    """Counts torchao's FP8 GEMMs (module swap and weight wrapper alike): ``aten.mm`` on two ``Float8TrainingTensor``
    operands (the ``_scaled_mm`` inside torchao's dispatch runs below the mode) or two ``MXTensor`` ones (MXFP8,
    real or emulated; ``mx`` counts those alone)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.mx = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            kinds = {type(a).__name__ for a in args[:2]}
            if kinds in ({"Float8TrainingTensor"}, {"MXTensor"}):
                self.count += 1
                self.mx += kinds == {"MXTensor"}
        return func(*args, **(kwargs or {}))


def linear_op_config(recipe: str):
    """torchao's op config for the dense Linear ``recipe`` (``Float8TrainingOpConfig`` or MXFP8's)."""
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig

    from .mx_linear import is_mx, mx_op_config

    if is_mx(recipe):
        return mx_op_config(recipe)
    return Float8TrainingOpConfig(float8_linear_recipe=recipe)


def _wrapped(t: torch.Tensor, config) -> nn.Parameter:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.moe_training.tensor import (Float8TrainingWeightWrapperTensor,
                                                       MXFP8TrainingWeightWrapperTensor)

    cls = MXFP8TrainingWeightWrapperTensor if isinstance(config, MXFP8TrainingOpConfig) else \
        Float8TrainingWeightWrapperTensor
    return nn.Parameter(cls(t, config), requires_grad=t.requires_grad)


def wrapped_weight_config(module: nn.Module):
    """The op config of torchao's weight wrapper on ``module.weight``, or None when it is not wrapped."""
    from .moe import _wrapper

    wrapper = _wrapper(getattr(module, "weight", None))
    return None if wrapper is None else wrapper.config


def float8_gemm_config(module: nn.Module):
    """The torchao ``Float8LinearConfig`` that casts ``module``'s GEMMs: a ``Float8Linear``'s own, or the one torchao's
    Float8 weight wrapper builds from its op config's recipe; None for any other module (an MXFP8 wrapper included)."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from .moe import _wrapper

    if isinstance(module, Float8Linear):
        return module.config
    wrapper = _wrapper(module._parameters.get("weight"))  # its own: a PEFT LoRA layer's .weight is its base layer's
    recipe = getattr(getattr(wrapper, "config", None), "float8_linear_recipe", None)  # MXFP8's op config has none
    return Float8LinearConfig.from_recipe_name(recipe) if recipe is not None else None


def weight_data(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a torchao weight wrapper (the training wrapper or the FP8 all-gather one); else ``t``."""
    from .moe import _wrapper

    wrapper = _wrapper(t)
    return wrapper._data if wrapper is not None else getattr(t, "_tensor", t)


def fp8_gemms_in_forward(module: nn.Module, wrap_config=None) -> int:
    """torchao FP8 GEMMs (MX ones only, for an MXFP8 op config) that ``module``'s own forward runs on a small copy
    of it (its weight wrapped with ``wrap_config`` when given; otherwise as converted), meta modules too."""
    from .linear import _small_copy
    from .mx_linear import probe_config

    wrap_config = wrap_config if wrap_config is not None else wrapped_weight_config(module)
    subject = _small_copy(module, dims=_PROBE_DIMS)
    if wrap_config is not None:  # MXFP8's GEMMs emulated: the copy runs on the CPU
        wrap_config = probe_config(wrap_config)
        for name, param in list(subject._parameters.items()):
            if param is not None:
                subject._parameters[name] = _wrapped(param.detach(), wrap_config)
    weight = subject.weight
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(*_PROBE_ROWS, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad(), FP8Gemms() as gemms:
        try:
            subject.forward(x)
        except Exception:  # a forward that refuses the wrapped weight runs no FP8 GEMM either
            return 0
    return gemms.mx if type(wrap_config).__name__ == "MXFP8TrainingOpConfig" else gemms.count


def wrapper_reaches(module: nn.Module, recipe: str) -> bool:
    """Whether torchao's weight wrapper turns ``module``'s GEMM into FP8 (False for Falcon's ``x @ self.weight.T``)."""
    return fp8_gemms_in_forward(module, linear_op_config(recipe)) > 0


def wrap_linears(model: nn.Module, names: set[str], recipe: str) -> None:
    """torchao's ``quantize_`` on exactly the Linears ``names``; a tied parameter stays tied and state dicts hold
    plain tensors. Call before sharding."""
    from torchao.quantization import quantize_

    from .moe import _plain_state

    if not names:
        return
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # every holder of each parameter (a tied output head)
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, pname))
    before = {name: dict(model.get_submodule(name).named_parameters(recurse=False)) for name in names}
    quantize_(model, linear_op_config(recipe), filter_fn=lambda module, fqn: fqn in names)
    for name in names:
        module = model.get_submodule(name)
        for pname, old in before[name].items():  # quantize_ sets a new Parameter on this module only: re-tie
            for holder, attr in holders[id(old)]:
                setattr(holder, attr, getattr(module, pname))
        module.register_state_dict_post_hook(_plain_state)


def unproven_fp8(model: nn.Module, names: list[str]) -> list[str]:
    """The converted Linears among ``names`` whose forward ran no FP8 GEMM."""
    return [name for name in names if fp8_gemms_in_forward(model.get_submodule(name)) == 0]


WRAPPED = "Float8 weight wrapper"
"""What the plan records for a Linear converted by torchao's weight wrapper (the module keeps its class)."""
BYPASSED = "Float8Linear (its forward bypasses the weight wrapper)"
"""What it records for a Linear the wrapper does not reach (its forward unwraps the weight): swapped instead."""


def say_bypassed(plan) -> None:
    """A warning naming the Linears swapped because torchao's weight wrapper would not have reached their GEMM."""
    bypassed = [f"{e.name} ({e.module_type})" for e in plan.fp8 if e.converted_to == BYPASSED]
    if bypassed:
        warnings.warn(f"torchao_api='weight_wrapper': the forward of {listing(bypassed)} unwraps "
                      "torchao's weight wrapper (e.g. x @ self.weight.T), so its GEMM would run in high precision; "
                      "fp8dist swaps these for Float8Linear (torchao's module swap, same recipe) instead, as the "
                      "plan says", stacklevel=3)


def check_fp8_ran(model: nn.Module, names: list[str]) -> None:
    """Raise ``RuntimeError`` unless every converted Linear among ``names`` runs an FP8 GEMM."""
    unproven = unproven_fp8(model, names)
    if unproven:
        raise RuntimeError(
            f"torchao conversion: {', '.join(unproven[:3])}{' ...' if len(unproven) > 3 else ''} ran no FP8 GEMM "
            "after conversion although the plan calls them FP8; fp8dist will not report them FP8. Keep them out "
            "with fp8_exclude, or try torchao_api='module_swap' / 'weight_wrapper' (the other API).")
