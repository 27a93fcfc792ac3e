"""The dtype columns of the precision report, read from the wrapped model's policy objects, modules and tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._memory import deepspeed_gradients, leaves
from .report import Part, PrecisionRow, _inner, _Members, _names, dtype_name

__all__ = ["row_for"]


@dataclass(frozen=True)
class _Engine:
    """How the strategy moves and computes weights, as its own objects say."""

    compute: torch.dtype | None
    """Dtype high-precision GEMMs see (None: the stored dtype)."""
    gather: str | None
    """All-gather dtype name (None: the compute dtype; "none" when nothing is gathered)."""
    reduce: str
    deepspeed: Any = None


def _autocast_dtype(model: nn.Module) -> torch.dtype | None:
    return getattr(_inner(model).forward, "_fp8dist_autocast", None)


def _ddp_reduce(ddp: nn.Module) -> str:
    """What DDP's gradients travel in: the dtype its registered compression hook casts them to, else their own."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = [hook for hook, _state in getattr(ddp, "_comm_hooks", ())]  # DDP.register_comm_hook keeps them here
    if not hooks:
        return _names({p.dtype for p in ddp.parameters()})
    compress = {default_hooks.bf16_compress_hook: torch.bfloat16, default_hooks.fp16_compress_hook: torch.float16}
    dtype = compress.get(hooks[-1])
    if dtype is None:
        return f"set by the comm hook {getattr(hooks[-1], '__qualname__', hooks[-1])}"
    return dtype_name(dtype)


def _engine(model: nn.Module) -> _Engine:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    from .strategies.deepspeed import is_deepspeed_engine

    if is_deepspeed_engine(model):
        compute = torch.bfloat16 if model.bfloat16_enabled() else torch.float16 if model.fp16_enabled() else None
        stage = model.zero_optimization_stage()
        gather = None if stage == 3 else f"{dtype_name(compute or torch.float32)} (updated weights, after the step)"
        return _Engine(compute, gather, dtype_name(model.communication_data_type), deepspeed=model)
    if isinstance(model, FullyShardedDataParallel):
        mp = model.mixed_precision
        return _Engine(mp.param_dtype, None, dtype_name(mp.reduce_dtype or mp.param_dtype or torch.float32))
    state = getattr(model, "_get_fsdp_state", None)
    if state is not None:
        policy = state()._mp_policy
        reduce = policy.reduce_dtype or policy.param_dtype
        return _Engine(policy.param_dtype, None, dtype_name(reduce) if reduce else "the stored dtype")
    if isinstance(model, DistributedDataParallel):
        return _Engine(_autocast_dtype(model), "none (replicated)", _ddp_reduce(model))
    return _Engine(_autocast_dtype(model), "none", "none")  # one process: nothing gathered or reduced


def _stored(model: nn.Module, params: list[nn.Parameter], engine: _Engine) -> list[torch.Tensor]:
    if engine.deepspeed is not None and all(hasattr(p, "ds_tensor") for p in params):
        return [p.ds_tensor for p in params]
    return [leaf for p in params for leaf in leaves(p) if leaf.numel() > 0] or list(params)


def _fp8_gemm(module: nn.Module, model: nn.Module) -> str:
    """The FP8 formats of an FP8 Linear, from torchao's config on the module or TE's recipe on the forward."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "cast_config_input"):  # torchao Float8Linear
        fwd = dtype_name(config.cast_config_input.target_dtype)
        bwd = dtype_name(config.cast_config_grad_output.target_dtype)
        granularity = config.cast_config_input.scaling_granularity.value
        return f"{fwd} fwd, {bwd.removeprefix('fp8 ')} grads ({granularity})"
    recipe = getattr(_inner(model).forward, "_fp8dist_fp8_recipe", None)
    if recipe is not None:  # TE: HYBRID is E4M3 forward, E5M2 gradients
        fmt = getattr(getattr(recipe, "fp8_format", None), "name", "E4M3")
        formats = "fp8 e4m3 fwd, e5m2 grads" if fmt == "HYBRID" else f"fp8 {fmt.lower()}"
        return f"{formats} ({type(recipe).__name__})"
    from .api import get_plan

    return f"fp8 ({get_plan(model).backend})"


def _all_gather(params: list[nn.Parameter], engine: _Engine, stored: list[torch.Tensor]) -> str:
    from torch.distributed.tensor import DTensor

    if engine.gather is not None:
        return engine.gather
    locals_ = [p.to_local() for p in params if isinstance(p, DTensor)]
    if locals_ and all("Float8" in type(t).__name__ for t in locals_):  # torchao's FP8 all-gather weight wrapper
        return "fp8 e4m3 (FP8 all-gather)"
    return dtype_name(engine.compute) if engine.compute is not None else _names({t.dtype for t in stored})


def _optimizer_states(optimizer: Any, params: list[nn.Parameter], engine: _Engine) -> str:
    if engine.deepspeed is not None:
        inner = getattr(engine.deepspeed.optimizer, "optimizer", None)
        states = list(getattr(inner, "state", {}).values())
    else:
        state = getattr(optimizer, "state", None) or {}
        states = [state[p] for p in params if p in state]
    kinds = sorted({"+".join(dtype_name(leaf.dtype) for k, v in s.items() if k != "step" for leaf in leaves(v))
                    for s in states})
    return ", ".join(k for k in kinds if k) or "none yet (after the first step)"


def _weight_grad(params: list[nn.Parameter], engine: _Engine) -> str:
    grads = {leaf.dtype for p in params for leaf in leaves(p.grad) if leaf.untyped_storage().nbytes()}
    if engine.deepspeed is not None:
        grads |= {leaf.dtype for leaf in leaves(deepspeed_gradients(engine.deepspeed.optimizer))
                  if leaf.untyped_storage().nbytes()}
    return _names(grads, "none held now (report after backward)")


def _master(engine: _Engine) -> str:
    if engine.deepspeed is None:
        return "n/a (the stored weight)"
    zero = engine.deepspeed.optimizer
    masters = {leaf.dtype for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
               for leaf in leaves(getattr(zero, name, None))}
    return f"{_names(masters)} (ZeRO partition)" if masters else "none"


def row_for(model: nn.Module, optimizer: Any, part: Part, members: _Members) -> PrecisionRow:
    """The chart row for ``part`` of ``model``: its modules, and the parameters counted in it."""
    engine = _engine(model)
    params = [h.param for h in members.params]
    stored = _stored(model, params, engine)
    weight = _names({t.dtype for t in stored})
    if part is Part.FP8_GEMM:
        gemm = _fp8_gemm(members.modules[0], model)
    elif part is Part.GEMM:
        gemm = dtype_name(engine.compute) if engine.compute is not None else weight
    else:
        gemm = "no GEMM"
    return PrecisionRow(part=part, modules=len(members.modules), params=sum(h.numel for h in members.params),
                        gemm=gemm, all_gather=_all_gather(params, engine, stored), reduce=engine.reduce,
                        weight=weight, master_weight=_master(engine), weight_grad=_weight_grad(params, engine),
                        optimizer_states=_optimizer_states(optimizer, params, engine))
