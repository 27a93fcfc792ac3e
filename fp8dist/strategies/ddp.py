"""strategy="ddp": DistributedDataParallel, fp32 parameters and gradients, the forward under autocast."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from ..config.axis import ALWAYS, StrategyFacts, When
from ..config.dtypes import torch_dtype
from ..runtime.env import runs_on_cpu
from .base import (EngineDtypes, EngineMemory, Sharded, ShardingInfo, ShardJob, Strategy, fill_whole, prepared,
                   reduce_words, require_1d_mesh)
from .common import cast_buffers
from .grad_fp8 import (FP8HookState, GradWire, fp8_all_reduce_hook, fp8_wire_words, model_grad_wire,
                        predict_all_reduce)
from .single import apply_single

__all__ = ["DDP", "apply_ddp", "STRATEGY"]


def _compression_hooks() -> dict:
    """DDP's own gradient-compression hooks, by the dtype they reduce in (they need NCCL)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {torch.bfloat16: default_hooks.bf16_compress_hook, torch.float16: default_hooks.fp16_compress_hook}


def apply_ddp(model: nn.Module, *, device: torch.device, compute_dtype: torch.dtype,
              reduce_dtype: torch.dtype, mesh: DeviceMesh | None = None,
              fp8_wire: GradWire | None = None, fp32_layers: tuple[str, ...] = ()) -> DistributedDataParallel:
    """Replicate ``model`` with DDP: fp32 parameters and gradients, forward under autocast to ``compute_dtype``,
    over the 1-D ``mesh`` (None: the default process group); ``fp8_wire``: all-reduce them as FP8 blocks
    (:func:`~fp8dist.strategies.grad_fp8.fp8_all_reduce_hook`) counting in it, but the gradients of the modules
    ``fp32_layers`` names in fp32; else in ``reduce_dtype``. Returns the DDP wrapper; ``wrapper.module`` is the
    model."""
    hook = fp8_all_reduce_hook if fp8_wire is not None else _compression_hooks().get(reduce_dtype)
    apply_single(model, device=device, compute_dtype=compute_dtype)
    # gradients as views of DDP's buckets: one copy of the gradients, not two (torchtitan does the same)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True, device_mesh=mesh)
    group = mesh.get_group() if mesh is not None else dist.group.WORLD
    if fp8_wire is not None:
        fallback = frozenset(id(q) for name in fp32_layers for q in model.get_submodule(name).parameters())
        fp8_wire.fp32_units = tuple(f"{name} (split out of DDP's bucket)" for name in fp32_layers)
        ddp.register_comm_hook(FP8HookState(group, fp8_wire, fallback), hook)
    elif hook is not None:
        ddp.register_comm_hook(group, hook)
    return ddp


class DDP(Strategy):
    """DDP: the whole model on every rank, gradients all-reduced in their own dtype or through a compression
    hook."""

    name = "ddp"
    engine_words = "wrapped in DistributedDataParallel (DDP)"
    accelerate = {"distributed_type": ("MULTI_GPU", "MULTI_CPU")}
    bench_devices = ("cpu", "cuda")
    options = {"reduce_dtype": ALWAYS, "reduce_fp8_block": When({"reduce_dtype": ("fp8",)})}
    reduce_fallback_unit = "layer (its gradients split out of DDP's bucket)"

    def is_engine(self, module: object) -> bool:
        """A ``DistributedDataParallel`` wrapper."""
        return isinstance(module, DistributedDataParallel)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """DDP's ``.module``."""
        return model.module

    def facts(self, cfg, world_size=None) -> StrategyFacts:
        """Parameters stay fp32 and whole on every rank, the forward under autocast; rank 0's weights are broadcast."""
        return StrategyFacts(autocast_forward=True, broadcasts_weights=True,
                             shard_degree=None if world_size is None else 1)

    def shard(self, model: nn.Module, job: ShardJob) -> Sharded:
        """Allocate a meta model whole, fill it, then wrap it in ``DistributedDataParallel`` (autocast to
        ``param_dtype``; a compression or FP8 hook for a non-fp32 ``reduce_dtype``)."""
        p, device = job.cfg.parallel, job.env.device
        loaded, how = fill_whole(model, job, self.name)
        model, built = prepared(model, job)
        param = torch_dtype(p.param_dtype)
        cast_buffers(model, torch_dtype(p.buffer_dtype))
        fp8 = p.reduce_dtype == "fp8"
        wrapped = apply_ddp(model, device=device, compute_dtype=param,
                            reduce_dtype=torch.float32 if fp8 else torch_dtype(p.reduce_dtype), mesh=job.mesh,
                            fp8_wire=GradWire(p.reduce_fp8_block) if fp8 else None, fp32_layers=job.reduce_fallback)
        autocast = param if param != torch.float32 else None
        notes = tuple(f"reduce_dtype='fp8': {name}'s gradients are all-reduced in fp32, split out of DDP's bucket, "
                      "not FP8: the FP8 blocks hurt its weight gradient (the numerics probe's verdict)"
                      for name in job.reduce_fallback) if fp8 else ()
        return Sharded(wrapped, ShardingInfo(self.name, (), "replicated (DDP)", autocast=autocast, notes=notes), loaded,
                       how, built)

    def check_mesh(self, mesh, cfg) -> None:
        """A 1-D mesh only: DDP replicates over one group (ValueError otherwise)."""
        require_1d_mesh(mesh, self.name)

    def check_launch(self, cfg, world_size: int) -> None:
        """A bf16/fp16 reduce (a compression hook, which needs NCCL) is refused on the CPU: a launch check, as the
        table also plans for other machines and device='auto' is the CPU only where CUDA is missing."""
        name = cfg.parallel.reduce_dtype
        if name in ("bf16", "fp16") and runs_on_cpu(cfg.parallel.device):
            raise ValueError(
                f"reduce_dtype={name!r} with strategy={self.name!r} on cpu: DDP reduces in {name} through its "
                f"{name}_compress_hook, which needs NCCL (CUDA). Use reduce_dtype='fp32' or 'fp8' (fp8dist's FP8 "
                "hook, which runs on gloo) here, or strategy='fsdp', whose reduce_dtype works on every backend.")

    def no_sync(self, model: nn.Module):
        """DDP's own ``no_sync()``: gradients accumulate unreduced in each rank's buckets."""
        return model.no_sync()

    def estimate_engine(self, model: nn.Module, cfg, world_size: int, blocks: list[str], *, optimizer: str,
                        on_cpu: bool) -> EngineMemory:
        """No master copy; gradients are bucket views, said in a note."""
        return EngineMemory(notes=("DDP's gradients are views of its buckets (gradient_as_bucket_view=True): no "
                                   "second copy",))

    def grad_wire(self, model: nn.Module, cfg, world_size: int, blocks: list[str], fallback: tuple[str, ...] = ()):
        """The FP8 all-reduce of every trained gradient element (as one bucket: DDP's buckets each pad a little), the
        parameters of the ``fallback`` modules in fp32."""
        if cfg.parallel.reduce_dtype != "fp8":
            return None
        fp32 = {id(q) for name in fallback for q in model.get_submodule(name).parameters()}
        trained = [q for q in model.parameters() if q.requires_grad]
        return predict_all_reduce([q.numel() for q in trained if id(q) not in fp32], world_size,
                                  cfg.parallel.reduce_fp8_block, sum(q.numel() for q in trained if id(q) in fp32))

    def engine_dtypes(self, model: nn.Module, autocast) -> EngineDtypes:
        """Gradients reduce in the dtype of DDP's compression hook, else their own; a hook of the user's is named."""
        hooks = [hook for hook, _state in getattr(model, "_comm_hooks", ())]  # DDP.register_comm_hook keeps them
        compress = {hook: dtype for dtype, hook in _compression_hooks().items()}
        if hooks and hooks[-1] is fp8_all_reduce_hook:
            words = fp8_wire_words(model_grad_wire(model))
        elif hooks and hooks[-1] not in compress:
            words = f"set by the comm hook {getattr(hooks[-1], '__qualname__', repr(hooks[-1]))}"
        else:
            words = reduce_words(compress[hooks[-1]] if hooks else None, model)
        return EngineDtypes(autocast, words, "none (replicated)")


STRATEGY = DDP()
"""The strategy ``strategy='ddp'`` selects (registered by :func:`fp8dist.strategies.register_builtins`)."""
