"""torchao's block-scaled recipes for dense Linears: MXFP8 through the weight wrapper (``quantize_`` with
``MXFP8TrainingOpConfig``: e4m3 in 1x32 blocks, e8m0 scales; emulated GEMMs on any device), and NVFP4 through
``NVFP4TrainingConfig``'s swap to ``NVFP4Linear`` (Triton only: planned for a GPU, probed with emulated casts)."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .base import dims_reason, fp8_hardware_reason
from .casts import MX_BLOCK, USES, Casts, CastSpec
from .conv1d import is_conv1d
from .linear import plain_linear_reason

__all__ = ["MX_RECIPES", "MX_WRAPPED", "MX_BYPASSED", "MXFP8_CAPABILITY", "is_mx", "mx_hardware_reason",
           "mx_op_config", "probe_config", "mx_linear_reason", "mx_linear_casts", "mx_gemm_words", "NVFP4_SWAPPED",
           "nvfp4_hardware_reason", "nvfp4_linear_reason", "convert_nvfp4"]

MX_RECIPES = ("mxfp8", "mxfp8_emulated")
"""torchao_recipe values that run MXFP8 (the second with emulated GEMMs)."""

MX_WRAPPED = {"mxfp8": "MXFP8 weight wrapper", "mxfp8_emulated": "MXFP8 weight wrapper (emulated GEMMs)"}
"""What the plan records for a Linear converted to MXFP8 by torchao's weight wrapper (the module keeps its class)."""

MXFP8_CAPABILITY = (10, 0)
"""MXFP8 tensor cores: Blackwell, sm_100+."""


def is_mx(recipe: str) -> bool:
    """Whether ``recipe`` is one of torchao's MX block-scaled recipes (:data:`MX_RECIPES`)."""
    return recipe in MX_RECIPES


def mx_hardware_reason(hardware) -> str | None:
    """Why ``torchao_recipe='mxfp8'`` cannot run on ``hardware`` (sm_100+ only), with the ways out; None: it can."""
    where = _not_sm100(hardware)
    return where and (f"torchao_recipe='mxfp8' needs MXFP8 tensor cores (CUDA sm_100+), not {where}: a Blackwell "
                      "GPU (e.g. B200) has them; "
                      "torchao_recipe='mxfp8_emulated' runs MXFP8's quantization with emulated GEMMs on any device "
                      "(numerics and tests, no FP8 speed), or plan for it with --target b200")


def _not_sm100(hardware) -> str | None:
    """None on sm_100+; else the hardware as a refusal names it."""
    if fp8_hardware_reason(hardware, min_capability=MXFP8_CAPABILITY) is None:
        return None
    return str(hardware) if hardware.type == "cuda" else f"device {hardware.type}"


def mx_op_config(recipe: str):
    """torchao's ``MXFP8TrainingOpConfig`` for ``recipe`` (dense Linears and MoE experts alike)."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    name = "MXFP8_EMULATED_RCEIL" if recipe == "mxfp8_emulated" else "MXFP8_RCEIL"
    return MXFP8TrainingOpConfig.from_recipe(getattr(MXFP8TrainingRecipe, name))


def probe_config(config):
    """``config`` as the CPU probe runs it: an MXFP8 op config with its GEMMs emulated (the same quantization and
    wrapper dispatch); others unchanged."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.quantization.quantize_.common import KernelPreference

    if isinstance(config, MXFP8TrainingOpConfig) and config.kernel_preference != KernelPreference.EMULATED:
        return dataclasses.replace(config, kernel_preference=KernelPreference.EMULATED)
    return config


MX_BYPASSED = ("its forward bypasses torchao's weight wrapper (e.g. x @ self.weight.T unwraps it), so its GEMM "
               "would run in high precision, and MXFP8 has no module swap; use a tensorwise / rowwise recipe to run "
               "it FP8")
"""Why a Linear whose forward the MXFP8 weight wrapper does not reach stays out of MXFP8."""


def mx_linear_reason(module: nn.Module) -> str | None:
    """Why ``module``'s kind or dims keep it from MXFP8 through the weight wrapper (whether its forward reaches the
    wrapper is asked apart: :data:`MX_BYPASSED`); None when they do not."""
    if is_conv1d(module):
        return ("a Conv1D's addmm(bias, x, W) is not a call torchao's weight wrapper overrides, and MXFP8 runs "
                "through the wrapper only; use a tensorwise / rowwise recipe to run it FP8")
    return plain_linear_reason(module) or dims_reason(module, MX_BLOCK, f"MXFP8 scales blocks of {MX_BLOCK} elements")


def mx_linear_casts(config) -> Casts:
    """The casts of torchao's ``MXFP8TrainingOpConfig`` ``config`` (a Linear's or MoE experts')."""
    hp_wgrad = bool(config.wgrad_with_hp)
    return {use: None if hp_wgrad and use[1] == "grad_weight" else CastSpec(torch.float8_e4m3fn, "mx")
            for use in USES}


def mx_gemm_words(config, blocks: str = f"1x{MX_BLOCK} blocks, e8m0 scales, weight wrapper") -> str:
    """What MXFP8 GEMMs quantize to, from their op config (a wrapped Linear's; MoE experts' name their ``blocks``)."""
    from torchao.quantization.quantize_.common import KernelPreference

    how = [blocks]
    if config.wgrad_with_hp:
        how.append("weight grads in high precision")
    if config.kernel_preference == KernelPreference.EMULATED:
        how.append("emulated")
    return f"mxfp8 e4m3 fwd+grads ({', '.join(how)})"


NVFP4_SWAPPED = "NVFP4Linear"
"""What the plan records for a Linear torchao's NVFP4 training converts (a module swap through ``quantize_``)."""

NVFP4_DIM = 128
"""torchao's NVFP4 training GEMM (``nvfp4_mm_triton``) takes M, K and N divisible by 128 only."""


def nvfp4_hardware_reason(hardware) -> str | None:
    """Why ``torchao_recipe='nvfp4'`` cannot run on ``hardware`` (sm_100+ only), with the ways out; None: it can."""
    where = _not_sm100(hardware)
    return where and (f"torchao_recipe='nvfp4' needs FP4 tensor cores (CUDA sm_100+), not {where}: torchao's NVFP4 "
                      "training (NVFP4TrainingConfig) quantizes with Triton kernels only, with no CPU or emulated "
                      "form. Plan for it with --target b200, measure its numerics here with fp8dist probe --target "
                      "b200 (emulated NVFP4 casts), or train with torchao_recipe='mxfp8_emulated' on this device")


def nvfp4_linear_reason(module: nn.Module) -> str | None:
    """Why ``module``'s kind or dims keep it from torchao's NVFP4Linear; None when they do not."""
    if is_conv1d(module):
        return "a Conv1D: torchao's NVFP4 training swaps nn.Linear only; use a tensorwise / rowwise recipe"
    return plain_linear_reason(module) or dims_reason(
        module, NVFP4_DIM, f"torchao's NVFP4 training GEMM takes multiples of {NVFP4_DIM} only")


def convert_nvfp4(model: nn.Module, names: set[str]) -> None:
    """Swap exactly the Linears ``names`` for torchao's ``NVFP4Linear`` (weights kept), then prove that an
    NVFP4Linear runs FP4 GEMMs here. Call before sharding, on a CUDA sm_100+ device."""
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear, NVFP4TrainingConfig
    from torchao.quantization import quantize_

    # one Hadamard sign vector, the same on every rank (torchao draws one per layer: replicas would differ)
    signs = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    quantize_(model, NVFP4TrainingConfig(rht_sign_vector=signs), filter_fn=lambda m, fqn: fqn in names)
    missed = [n for n in sorted(names) if not isinstance(model.get_submodule(n), NVFP4Linear)]
    ran = _fp4_gemms() if names else 1
    if missed or not ran:
        what = f"{', '.join(missed[:3])} were not swapped for NVFP4Linear" if missed else "NVFP4Linear ran no FP4 GEMM"
        raise RuntimeError(f"torchao NVFP4 conversion: {what}, although the plan calls them FP4; fp8dist will not "
                           "report them FP4. Keep them out with fp8_exclude, or use torchao_recipe='mxfp8'.")


class FP4Gemms(TorchFunctionMode):
    """Counts the scaled-mm calls on FP4 operands (NVFP4Linear's ``F.scaled_mm`` reaches the mode as
    ``torch._scaled_mm_v2``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if "scaled_mm" in getattr(func, "__name__", "") and getattr(args[0] if args else None, "dtype", None) \
                == torch.float4_e2m1fn_x2:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _fp4_gemms() -> int:
    """FP4 GEMMs in one forward of a bf16 128x128 ``NVFP4Linear`` here (every converted Linear runs that forward)."""
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

    module = NVFP4Linear(NVFP4_DIM, NVFP4_DIM, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(NVFP4_DIM, NVFP4_DIM, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), FP4Gemms() as gemms:
        module(x)
    return gemms.count
