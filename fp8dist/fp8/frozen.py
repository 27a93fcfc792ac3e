"""A frozen weight (``requires_grad=False``: a LoRA base) under torchao's module swap: its backward skips the
weight-gradient GEMM (torchao 0.18 computes it and lets autograd drop it), its tensorwise FP8 cast is made once and
kept (the FP8 shard FSDP2 all-gathers, or a weight held whole), and it is left out of the scale precompute. A weight
held in FP8 (a LoRA base read from an FP8 checkpoint) is multiplied as its e4m3 bits, held whole or all-gathered by
FSDP2 (its scale kept whole on the module)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor, precompute_float8_dynamic_scale_for_fsdp

from .hf_format import SCALE_ATTR, holds_fp8

__all__ = ["FrozenFloat8Linear", "freeze_float8_linears", "cache_frozen_shards", "precompute_trainable", "kept_casts",
           "hold_for_sharding", "rescale_held_shards"]

_WHOLE, _SHARD = "_fp8_weight", "_fp8_shard"  # where a kept cast lives: on the module, on the FSDP2 local shard
_INVERSE, _SCALE = "_fp8_inverse_scale", "_held_scale"  # a held weight FSDP2 shards: torchao's scale, the file's


class _InputGradOnly(matmul_with_hp_or_float8_args):
    """torchao's FP8 matmul whose backward skips the weight-gradient GEMM where the weight needs no gradient."""

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.needs_input_grad[1]:
            return matmul_with_hp_or_float8_args.backward(ctx, grad_output)
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        _, weight_t = ctx.saved_tensors
        c, mm_config = ctx.config, ctx.linear_mm_config
        if getattr(weight_t, "_axiswise_dim", None) is not None:  # a held rowwise weight: scaled for the forward only
            weight_t = weight_t.to_original_precision()  # its values, recast along the other axis below
        shape = grad_output.shape
        grad = grad_output.reshape(-1, shape[-1])
        grad = _cast(grad, c.cast_config_grad_output, mm_config, GemmInputRole.GRAD_OUTPUT, -1, c)
        weight_t = _cast(weight_t, c.cast_config_weight_for_grad_input, mm_config, GemmInputRole.WEIGHT, -1, c)
        grad_input = torch.mm(grad, weight_t.t())
        return grad_input.reshape(*shape[:-1], grad_input.shape[-1]), None, None, None


def _cast(t: torch.Tensor, cast_config, mm_config, role, dim: int, config) -> torch.Tensor:
    from torchao.float8.config import ScalingType
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

    if tensor_already_casted_to_fp8(t) or cast_config.scaling_type is ScalingType.DISABLED:
        return t
    return hp_tensor_to_float8_dynamic(
        t, cast_config.target_dtype, mm_config, gemm_input_role=role,
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(dim, cast_config.scaling_granularity),
        round_scales_to_power_of_2=config.round_scales_to_power_of_2)


class FrozenFloat8Linear(Float8Linear):
    """A ``Float8Linear`` whose weight is frozen; torchao's exactly while the weight requires a gradient or under
    torch.compile. The kept cast is torchao's own, bit for bit, recomputed when the weight's version changes (a load,
    an in-place edit; an edit through ``.data`` bypasses it: reload or unfreeze to recast). Rowwise recipes (two
    layouts) and a weight gathered whole in high precision (a whole FP8 copy on every rank) recast every step."""

    cache_weight: bool = False
    """Keep the FP8 cast of a weight held whole (tensorwise, not sharded)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """The FP8 forward of ``input``: torchao's own while the weight trains (or under torch.compile); a frozen
        weight's FP8 cast kept (or held in FP8: its bits and scale) and reused otherwise, with no weight-gradient
        GEMM."""
        held = holds_fp8(self) or _INVERSE in self.__dict__
        if not held and (self.weight.requires_grad or torch.compiler.is_compiling()):
            return super().forward(input)
        if torch.is_autocast_enabled():  # as Float8Linear.forward: the input in the autocast dtype
            input = input.to(torch.get_autocast_gpu_dtype())
        if _INVERSE in self.__dict__:  # held in FP8 and sharded by FSDP2: the all-gathered bits, the scale kept whole
            weight_t = self._gathered_weight_t(input.dtype)
        elif held:
            weight_t = self._held_weight_t(input.dtype)
        else:
            weight_t = self._fp8_weight_t() if self.cache_weight else self.weight.t()
        output = _InputGradOnly.apply(input, weight_t, self.linear_mm_config, self.config)
        return output if self.bias is None else output + self.bias.to(output.dtype)

    def _fp8_weight_t(self) -> torch.Tensor:
        weight = self.weight
        key = (weight._version, weight.data_ptr(), weight.dtype, weight.device)
        cached = self.__dict__.get(_WHOLE)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cast = _cast(weight.t(), self.config.cast_config_weight, self.linear_mm_config,
                             GemmInputRole.WEIGHT, 0, self.config)
            cached = self.__dict__[_WHOLE] = (key, cast)
        return cached[1]

    def _held_weight_t(self, dtype: torch.dtype) -> torch.Tensor:
        """The FP8 operand of a weight held as a checkpoint's e4m3 bits with their scale (``weight.fp8_scale``; a LoRA
        base loaded in FP8: :mod:`fp8dist.pipeline.fp8_base`), made once and kept: those bits where their scale has
        the layer's granularity (per tensor for tensorwise, per channel for rowwise), multiplied by the scale torchao
        computes from their values (the dequantized weight's cast, bit for bit); else the layer's cast of their
        values, kept in their place (one layer in fp32 meanwhile)."""
        weight = self.weight
        key = (weight._version, weight.data_ptr(), dtype, weight.device)
        cached = self.__dict__.get(_WHOLE)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self.__dict__[_WHOLE] = (key, self._held_cast(dtype))
        return cached[1]

    def hold_for_sharding(self) -> None:
        """Before FSDP2 shards a weight held in FP8: its bits recast once where the file's granularity is not the
        layer's; torchao's scale of them and the file's kept on the module, whole (FSDP2 all-gathers the bits; an
        attribute on the weight does not survive sharding; not a buffer: a buffer_dtype would cast it), the file's
        set back on the sharded weight by :func:`rescale_held_shards`."""
        weight = self.weight
        if isinstance(weight, WeightWithDynamicFloat8CastTensor):  # torchao wrapped it for FP8 all-gather: unwrap
            weight = self.weight = weight._tensor  # the held Parameter itself, its scale on it
        with torch.no_grad():
            cast = self._held_cast(torch.float32)
        self.__dict__[_SCALE] = getattr(self.weight, SCALE_ATTR)
        self.__dict__[_INVERSE] = {cast._scale.device: cast._scale}  # per device: moved once, at the first forward

    def _gathered_weight_t(self, dtype: torch.dtype) -> torch.Tensor:
        """The FP8 operand of a held weight FSDP2 all-gathered (uint8 bits, whole) with the scale kept beside it:
        no copy, nothing kept (the bits are freed again after the forward)."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        bits_t = self.weight.detach().view(torch.float8_e4m3fn).t()
        kept = self.__dict__[_INVERSE]
        inverse = kept.get(bits_t.device)
        if inverse is None:
            inverse = kept[bits_t.device] = next(iter(kept.values())).to(bits_t.device)
        axiswise = {} if inverse.dim() == 0 else {"axiswise_dim": 0}
        return Float8TrainingTensor(bits_t, inverse, dtype, self.linear_mm_config, GemmInputRole.WEIGHT, **axiswise)

    def _held_cast(self, dtype: torch.dtype) -> torch.Tensor:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_training_tensor import Float8TrainingTensor
        from torchao.float8.float8_utils import amax_to_scale

        from .hf_format import dequantize, granularity_of_scale, quantize_weight

        weight, pow2 = self.weight, self.config.round_scales_to_power_of_2
        scale = getattr(weight, SCALE_ATTR).to(weight.device)
        granularity = granularity_of_scale(tuple(weight.shape), tuple(scale.shape))
        tensorwise = self.config.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE
        own = "tensor" if tensorwise else "channel"
        if granularity != own:
            bits, scale = quantize_weight(dequantize(weight, scale, granularity), own, pow2=pow2)
            weight.data = bits.view(torch.uint8).to(weight.device)
            setattr(weight, SCALE_ATTR, scale.to(weight.device))
        # the dequantized weight's amax from the bits, with no fp32 copy of the layer: an e4m3 magnitude orders as its
        # low 7 bits, and multiplying by a positive scale keeps the order (the same fp32 product as dequantize's)
        magnitude = weight.detach() & 0x7F
        top = magnitude.amax() if tensorwise else magnitude.amax(dim=1, keepdim=True)
        amax = top.view(torch.float8_e4m3fn).float() * scale.float().reshape(top.shape)
        # torchao's scale of the dequantized weight: a pow2 rowwise recipe would round it, and the bits are the file's
        inverse = (1.0 / scale.float()) if pow2 else amax_to_scale(amax, torch.float8_e4m3fn)
        bits_t = weight.detach().view(torch.float8_e4m3fn).t()
        if tensorwise:
            return Float8TrainingTensor(bits_t, inverse.reshape(()), dtype, self.linear_mm_config, GemmInputRole.WEIGHT)
        return Float8TrainingTensor(bits_t, inverse.reshape(1, -1), dtype, self.linear_mm_config, GemmInputRole.WEIGHT,
                                    axiswise_dim=0)


def freeze_float8_linears(model: nn.Module, names: set[str], *, cache_weight: bool) -> list[str]:
    """Make each ``Float8Linear`` among ``names`` whose weight is frozen a :class:`FrozenFloat8Linear` (same
    parameters and state dict); ``cache_weight``: keep its FP8 weight (a tensorwise recipe on a weight held whole).
    Call after conversion, before sharding. Returns the names made frozen, sorted."""
    frozen = []
    for name in sorted(names):
        module = model.get_submodule(name)
        if type(module) is Float8Linear and not module.weight.requires_grad:
            module.__class__ = FrozenFloat8Linear  # same layout: only forward changes
            module.cache_weight = cache_weight
            frozen.append(name)
    return frozen


def hold_for_sharding(model: nn.Module) -> list[str]:
    """Ready for FSDP2 every :class:`FrozenFloat8Linear` of ``model`` whose weight is held in FP8
    (:meth:`FrozenFloat8Linear.hold_for_sharding`). Call after :func:`freeze_float8_linears`, before sharding.
    Returns their names."""
    held = []
    for name, module in model.named_modules():
        if isinstance(module, FrozenFloat8Linear) and hasattr(getattr(module.weight, "_tensor", module.weight),
                                                              SCALE_ATTR):
            module.hold_for_sharding()
            held.append(name)
    return held


def rescale_held_shards(model: nn.Module) -> int:
    """After FSDP2 sharded the weights held in FP8 (:meth:`FrozenFloat8Linear.hold_for_sharding`), set each file's
    scale on its sharded weight again (what exports and telemetry read). Returns the weights."""
    count = 0
    for module in model.modules():
        scale = module.__dict__.get(_SCALE)
        if scale is not None:
            setattr(module.weight, SCALE_ATTR, scale)
            count += 1
    return count


def cache_frozen_shards(model: nn.Module) -> int:
    """Under FSDP2 with FP8 all-gather, cast each frozen weight's shard to FP8 once (until the parameter changes).
    Idempotent: call after sharding and again after a load (FSDP may replace a local tensor). Returns the shards
    cached."""
    count = 0
    for module in model.modules():
        if isinstance(module, FrozenFloat8Linear) and not module.weight.requires_grad:
            shard = getattr(module.weight, "_local_tensor", None)  # the weight is sharded here: a DTensor
            if isinstance(shard, WeightWithDynamicFloat8CastTensor):
                if "fsdp_pre_all_gather" not in shard.__dict__:
                    shard.fsdp_pre_all_gather = _cached_pre_all_gather(shard, module.weight)
                count += 1
    return count


def _cached_pre_all_gather(shard: WeightWithDynamicFloat8CastTensor, param: torch.Tensor):
    """torchao's ``fsdp_pre_all_gather``, kept while ``param`` keeps its version (a load's ``copy_`` counts on the
    DTensor, not on its local tensor)."""
    shard_ref, param_ref = weakref.ref(shard), weakref.ref(param)  # the shard holds this function: no cycle

    def fsdp_pre_all_gather(mesh):
        me, owner = shard_ref(), param_ref()
        version = None if owner is None else owner._version
        cached = me.__dict__.get(_SHARD)
        if version is None or cached is None or cached[0] != version:
            cast = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather(me, mesh)
            cached = me.__dict__[_SHARD] = (version, cast)
        return cached[1]

    return fsdp_pre_all_gather


def kept_casts(module: nn.Module) -> list[Any]:
    """The FP8 casts of a frozen weight kept on ``module`` or on its weights' local shards (None where none)."""
    return [module.__dict__.get(_WHOLE)] + [getattr(p, "_local_tensor", p).__dict__.get(_SHARD)
                                            for p in module.parameters(recurse=False)]


def precompute_trainable(model: nn.Module) -> None:
    """``precompute_float8_dynamic_scale_for_fsdp`` on the FP8 Linears whose weight trains (one all-reduce)."""
    trainable = [m for m in model.modules() if isinstance(m, Float8Linear) and m.weight.requires_grad]
    if trainable:
        precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(trainable))
