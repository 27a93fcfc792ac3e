"""torchao's weight-wrapper training API on dense Linears, and the proof that a layer's FP8 GEMM runs.

torchao 0.18 ships, beside the module swap (``convert_to_float8_training``), a tensor subclass for weights:
``quantize_(model, Float8TrainingOpConfig(float8_linear_recipe=...))`` wraps each weight, and the wrapped weight
turns ``F.linear`` / ``mm`` / ``matmul`` / ``addmm`` *called on it* into torchao's FP8 GEMM. The module keeps its
class and its forward. The catch: a forward that transforms the weight first (Falcon's ``x @ self.weight.T``)
unwraps it, and its GEMM runs in high precision without an error. So fp8dist never takes the wrapper on trust: it
runs each layer's own forward on a small copy holding a wrapped weight and counts torchao's FP8 GEMMs
(:class:`FP8Gemms`); a layer the wrapper does not reach is swapped for ``Float8Linear`` instead (the plan says so),
and after conversion every planned FP8 Linear is checked the same way.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FP8Gemms", "op_config", "wrapped_weight_config", "fp8_gemms_in_forward", "wrapper_reaches",
           "wrap_linears", "unproven_fp8", "WRAPPED", "BYPASSED", "say_bypassed", "check_fp8_ran"]

_PROBE_DIMS = (32, 48)  # (in, out) of the small copy: FP8 GEMM tiles need multiples of 16
_PROBE_ROWS = (2, 16)  # (batch, sequence) of the probe input


class FP8Gemms(TorchDispatchMode):
    """Counts torchao's FP8 GEMMs: ``aten.mm`` on two ``Float8TrainingTensor`` operands, which torchao runs as
    ``torch._scaled_mm`` (the mode sees the mm; the ``_scaled_mm`` inside torchao's dispatch runs below it). The
    module swap (``Float8Linear``) and the weight wrapper both end there (torchao.float8's
    ``matmul_with_hp_or_float8_args``). MXFP8 GEMMs count too: ``aten.mm`` on two ``MXTensor`` operands (torchao's
    ``mx_mm``, whose MXTensor dispatch runs the MXFP8 GEMM or, emulated, its high-precision equivalent); ``mx``
    counts those alone."""

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


def op_config(recipe: str):
    """torchao's op config for the dense Linear ``recipe``: ``Float8TrainingOpConfig`` (tensorwise, rowwise,
    rowwise_with_gw_hp) or ``MXFP8TrainingOpConfig`` (mxfp8, mxfp8_emulated)."""
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
    """The op config of torchao's weight wrapper on ``module.weight`` (itself or a DTensor's local shard), or
    None when the weight is not wrapped (or torchao was never imported: nothing can be wrapped)."""
    import sys

    if "torchao.prototype.moe_training" not in sys.modules:
        return None
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor

    weight = getattr(module, "weight", None)
    local = getattr(weight, "_local_tensor", weight)
    return local.config if isinstance(local, TrainingWeightWrapperBaseTensor) else None


def fp8_gemms_in_forward(module: nn.Module, wrap_config=None) -> int:
    """torchao FP8 GEMMs that ``module``'s own forward runs on a small random input, on a small copy of it (its
    weight wrapped with ``wrap_config`` when given; otherwise as converted); MXFP8 GEMMs only, for an MXFP8 op
    config. Works on meta modules (the copy is
    on the CPU); the module itself is untouched. Returns the count (0: no FP8 GEMM ran)."""
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
    return gemms.mx if _is_mx_config(wrap_config) else gemms.count  # an MXFP8 layer counts MX GEMMs only


def _is_mx_config(config) -> bool:
    return type(config).__name__ == "MXFP8TrainingOpConfig"


def wrapper_reaches(module: nn.Module, recipe: str) -> bool:
    """Whether torchao's weight wrapper turns ``module``'s GEMM into FP8: its own forward, run on a small copy with
    a wrapped weight, ran an FP8 GEMM. False for Falcon's ``x @ self.weight.T`` (the transpose unwraps it)."""
    return fp8_gemms_in_forward(module, op_config(recipe)) > 0


def wrap_linears(model: nn.Module, names: set[str], recipe: str) -> None:
    """``quantize_(model, Float8TrainingOpConfig(float8_linear_recipe=recipe))`` on exactly the Linears ``names``
    (their weight and bias wrapped: torchao's own conversion). A parameter shared with another module (a tied
    output head and embedding) stays shared: the wrapped one replaces it everywhere. Call before sharding. State
    dicts keep holding plain tensors (as for MoE experts), so checkpoints and exports load anywhere."""
    from torchao.quantization import quantize_

    from .moe import _plain_state

    if not names:
        return
    holders: dict[int, list[tuple[nn.Module, str]]] = {}  # every holder of each parameter (a tied output head)
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, pname))
    before = {name: dict(model.get_submodule(name).named_parameters(recurse=False)) for name in names}
    quantize_(model, op_config(recipe), filter_fn=lambda module, fqn: fqn in names)
    for name in names:
        module = model.get_submodule(name)
        for pname, old in before[name].items():  # quantize_ sets a new Parameter on this module only: re-tie
            for holder, attr in holders[id(old)]:
                setattr(holder, attr, getattr(module, pname))
        module.register_state_dict_post_hook(_plain_state)


def unproven_fp8(model: nn.Module, names: list[str]) -> list[str]:
    """The converted Linears among ``names`` whose forward, run on a small copy as converted, ran no FP8 GEMM."""
    return [name for name in names if fp8_gemms_in_forward(model.get_submodule(name)) == 0]


WRAPPED = "Float8 weight wrapper"
"""What the plan records for a Linear converted by torchao's weight wrapper (the module keeps its class)."""
BYPASSED = "Float8Linear (its forward bypasses the weight wrapper)"
"""What it records for a Linear the wrapper does not reach (its forward unwraps the weight): swapped instead."""


def say_bypassed(plan) -> None:
    """A warning naming the Linears swapped because torchao's weight wrapper would not have reached their GEMM."""
    bypassed = [f"{e.name} ({e.module_type})" for e in plan.fp8 if e.converted_to == BYPASSED]
    if bypassed:
        more = f" and {len(bypassed) - 3} more" if len(bypassed) > 3 else ""
        warnings.warn(f"torchao_api='weight_wrapper': the forward of {', '.join(bypassed[:3])}{more} unwraps "
                      "torchao's weight wrapper (e.g. x @ self.weight.T), so its GEMM would run in high precision; "
                      "fp8dist swaps these for Float8Linear (torchao's module swap, same recipe) instead, as the "
                      "plan says", stacklevel=3)


def check_fp8_ran(model: nn.Module, names: list[str]) -> None:
    """Every converted Linear runs an FP8 GEMM (its forward, on a small copy as converted): no FP8 promise unproven."""
    unproven = unproven_fp8(model, names)
    if unproven:
        raise RuntimeError(
            f"torchao conversion: {', '.join(unproven[:3])}{' ...' if len(unproven) > 3 else ''} ran no FP8 GEMM "
            "after conversion although the plan calls them FP8; fp8dist will not report them FP8. Keep them out "
            "with fp8_exclude, or try torchao_api='module_swap' / 'weight_wrapper' (the other API).")
