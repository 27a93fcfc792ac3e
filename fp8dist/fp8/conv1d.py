"""GPT-2's ``Conv1D`` (a Linear whose weight is stored (in, out): y = x @ W + b) in FP8: torchao's ``Float8Conv1D``
runs ``Float8Linear``'s GEMM on the Conv1D's own untransposed parameter, Transformer Engine's ``TEConv1D`` holds the
transpose; either way state dicts and checkpoints hold exactly the GPT-2 tensor."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..runtime.weight_layout import register_transposed

__all__ = ["is_conv1d", "conv1d_dims", "to_float8_conv1d", "te_conv1d_class"]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (without importing transformers)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils" and \
        getattr(module, "weight", None) is not None and module.weight.dim() == 2


def conv1d_dims(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a Conv1D: its weight is (in, out)."""
    return int(module.weight.shape[0]), int(module.weight.shape[1])


@functools.cache
def _float8_conv1d_class() -> type:
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    class Float8Conv1D(Float8Linear):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled():  # as Float8Linear.forward does
                input = input.to(torch.get_autocast_gpu_dtype())
            output = matmul_with_hp_or_float8_args.apply(input, self.weight, self.linear_mm_config, self.config)
            if self.bias is not None:
                output = output + self.bias.to(output.dtype)
            return output

    return Float8Conv1D


def to_float8_conv1d(module: nn.Module, config) -> nn.Module:
    """A ``Float8Conv1D`` holding ``module``'s own parameters (wrapped for FP8 all-gather as ``from_float`` does)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    with torch.device("meta"):
        new = _float8_conv1d_class()(*conv1d_dims(module), bias=False, config=config)
    new.weight = module.weight
    new.bias = module.bias
    if config.enable_fsdp_float8_all_gather:
        new.weight = nn.Parameter(WeightWithDynamicFloat8CastTensor(new.weight, new.linear_mm_config,
                                                                    config.cast_config_weight.target_dtype),
                                  requires_grad=new.weight.requires_grad)
    return new


# ---- Transformer Engine: te.Linear holds its weight (out, in); checkpoints keep the Conv1D's (in, out)

def _weight_out(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A contiguous copy: FSDP1 chunks it after this hook; loading writes through :func:`_weight_in`, not into it."""
    if prefix + "weight" in state_dict:
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t().contiguous()


def _weight_in(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    if prefix + "weight" in state_dict:
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].t()


@functools.cache
def te_conv1d_class(linear: type) -> type:
    """Transformer Engine's Linear class ``linear`` made to stand in for a GPT-2 ``Conv1D`` (its state dict keeps
    Conv1D's (in, out) weight layout); one class per ``linear``."""
    class TEConv1D(linear):
        """te.Linear (weight (out, in)) in place of a GPT-2 ``Conv1D``; its state dict holds and takes (in, out)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.register_state_dict_post_hook(_weight_out)
            self.register_load_state_dict_pre_hook(_weight_in)

    return register_transposed(TEConv1D)
