"""GPT-2's ``transformers.pytorch_utils.Conv1D`` (a Linear whose weight is stored transposed: (in, out), y = x @ W
+ b) in torchao FP8.

``Float8Conv1D`` is torchao's ``Float8Linear`` computing with Conv1D's own (in, out) parameter: the same
``matmul_with_hp_or_float8_args`` GEMM a converted ``nn.Linear`` runs on ``weight.t()``, fed the (in, out) weight
itself. The parameter object is kept, not transposed, so the state dict (keys and values), fp8dist's checkpoints,
``pretrained=`` loading and ``save_pretrained`` all see exactly the Conv1D tensor and write the HF GPT-2 layout,
and FSDP2 shards it along its dim 0 (in) like any other parameter.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["is_conv1d", "conv1d_dims", "conv1d_dims_reason", "to_float8_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (by class, without importing transformers)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils" and \
        getattr(module, "weight", None) is not None and module.weight.dim() == 2


def conv1d_dims(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a Conv1D: its weight is (in, out)."""
    return int(module.weight.shape[0]), int(module.weight.shape[1])


def conv1d_dims_reason(module: nn.Module) -> str | None:
    """FP8 GEMM tiles need both dims divisible by 16; the reason when they are not."""
    bad = [f"{n}={d}" for n, d in zip(("in_features", "out_features"), conv1d_dims(module)) if d % 16]
    return f"{' and '.join(bad)} not divisible by 16 (FP8 GEMM tiles)" if bad else None


@functools.cache
def _float8_conv1d_class() -> type:
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    class Float8Conv1D(Float8Linear):
        """torchao ``Float8Linear`` over a Conv1D's (in, out) weight: ``weight`` is the Conv1D's parameter."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled():  # as Float8Linear.forward does
                input = input.to(torch.get_autocast_gpu_dtype())
            output = matmul_with_hp_or_float8_args.apply(input, self.weight, self.linear_mm_config, self.config)
            if self.bias is not None:
                output = output + self.bias.to(output.dtype)
            return output

    return Float8Conv1D


def to_float8_conv1d(module: nn.Module, config) -> nn.Module:
    """A ``Float8Conv1D`` holding ``module``'s own weight and bias parameters (wrapped for FP8 all-gather when
    ``config`` enables it, as ``Float8Linear.from_float`` does)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    cls = _float8_conv1d_class()
    in_features, out_features = conv1d_dims(module)
    with torch.device("meta"):
        new = cls(in_features, out_features, bias=False, config=config)
    new.weight = module.weight
    new.bias = module.bias
    if config.enable_fsdp_float8_all_gather:
        new.weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(new.weight, new.linear_mm_config,
                                                                    config.cast_config_weight.target_dtype),
                                  requires_grad=new.weight.requires_grad)
    return new
