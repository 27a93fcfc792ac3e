"""The dtype columns of the precision report, read from the wrapped model's policy objects, modules and tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._memory import deepspeed_gradients, leaves
from .report import PrecisionRow, _inner, _names, dtype_name

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


def _engine(model: nn.Module) -> _Engine:
    from torch.distributed.fsdp import FullyShardedDataParallel

    from .sharding import _ddp_reduce_dtype
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
    reduce = _ddp_reduce_dtype(model)
    return _Engine(_autocast_dtype(model), "none (replicated)" if "no reduction" not in reduce else "none",
                   reduce if "no reduction" not in reduce else "none")


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
    return f"fp8 ({type(module).__module__.split('.')[0]})"


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


def _fsdp1_full_numels(model: nn.Module) -> dict[tuple[int, str], int]:
    """FSDP1's original parameters are views of this rank's shard; their full sizes are in the flat params."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    full: dict[tuple[int, str], int] = {}
    for fsdp in FullyShardedDataParallel.fsdp_modules(model):
        flat = fsdp._flat_param
        for info, shape in zip(getattr(flat, "_param_infos", ()), getattr(flat, "_shapes", ())):
            full[(id(info.module), info.param_name)] = shape.numel()
    return full


def row_for(model: nn.Module, optimizer: Any, part: str, modules: list[nn.Module]) -> PrecisionRow:
    """The chart row for ``part`` of ``model`` (its ``modules`` hold their own parameters)."""
    from .report import _PARTS

    engine = _engine(model)
    params = [p for m in modules for p in m.parameters(recurse=False)]
    stored = _stored(model, params, engine)
    weight = _names({t.dtype for t in stored})
    compute = dtype_name(engine.compute) if engine.compute is not None else weight
    if part == _PARTS[0]:
        gemm = _fp8_gemm(modules[0], model)
    else:
        gemm = compute if part == _PARTS[1] else "no GEMM"
    full = _fsdp1_full_numels(model)
    numel = sum(full.get((id(m), name)) or getattr(p, "ds_numel", None) or p.numel()
                for m in modules for name, p in m.named_parameters(recurse=False))
    return PrecisionRow(part=part, modules=len(modules), params=numel, gemm=gemm,
                        all_gather=_all_gather(params, engine, stored), reduce=engine.reduce, weight=weight,
                        master_weight=_master(engine), weight_grad=_weight_grad(params, engine),
                        optimizer_states=_optimizer_states(optimizer, params, engine))
