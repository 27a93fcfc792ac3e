"""Per-block activation checkpointing (torch's non-reentrant ``checkpoint_wrapper``) and ``block.compile()`` in place,
between FP8 conversion and sharding (torchtitan's order), on the blocks FSDP shards: state-dict keys do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config.text import plural

__all__ = ["BlockWiring", "COMPILE_OPTIONS", "has_biased_gemm", "wrap_blocks", "describe_blocks",
           "SAVED_BY_SELECTIVE", "SELECTIVE_GEMMS"]

SELECTIVE_GEMMS = ("aten.mm.default", "aten.addmm.default", "aten._scaled_mm.default", "aten._scaled_mm_v2.default")
"""The GEMMs selective checkpointing counts, in forward order within one checkpointed block call: it keeps the
output of the 1st, 3rd, 5th... and recomputes the 2nd, 4th... (torchtitan's op mode). torchtitan counts only
``aten.mm``: its bias-free bf16 Linears lower to it, and so does the matmul of an FP8 tensor subclass (torchao's
float8 and MXFP8), which the checkpoint's dispatch mode sees before the subclass turns it into ``_scaled_mm``; a
scaled GEMM a Linear's own autograd function calls on plain tensors (torchao's NVFP4 training Linear:
``F.scaled_mm`` -> ``_scaled_mm_v2``) is not on its list and is recomputed. fp8dist also counts ``addmm``
(Hugging Face's biased Linears) and the scaled GEMMs, as one sequence, so that every recipe keeps every other
GEMM output, as the step model (fp8dist/plan/speed/step_time.py) and the memory estimate assume. Batched products
(eager attention's ``bmm``, MoE's ``_grouped_mm``) are not counted: they are recomputed."""

SAVED_BY_SELECTIVE = ("aten._scaled_dot_product_flash_attention.default",
                      "aten._scaled_dot_product_efficient_attention.default",
                      "aten._scaled_dot_product_cudnn_attention.default",
                      "aten._scaled_dot_product_flash_attention_for_cpu.default",
                      "_c10d_functional.reduce_scatter_tensor.default", "aten.max.default")
"""Ops (besides every other GEMM of :data:`SELECTIVE_GEMMS`) whose outputs selective checkpointing keeps, as
torchtitan's op mode does: fused attention (output and log-sum-exp), a tensor-parallel reduce-scatter, and the
whole-tensor ``max`` FP8 recipes take amax with (a scalar: the scale is not recomputed). Every other op is
recomputed in backward."""


COMPILE_OPTIONS = {"cpp.max_horizontal_fusion_size": 1}
"""Inductor options of a compiled block that holds a biased GEMM: on CPU (``cpp.*`` options do nothing for CUDA
kernels), torch 2.13 declares one variable twice when a bf16 reduction is stored into two outputs (GPT-NeoX's two bias
gradients) and the kernel fails to compile (``conflicting declaration 'auto at_BFloat16_tmp_acc0_vec'``;
pytorch/pytorch#194706, reproduced in tests/test_blocks.py); without horizontal fusion each is stored once, and
GPT-NeoX fsdp bf16 on CPU still steps 8% faster than eager. Other blocks compile with torch's defaults."""


def has_biased_gemm(block: nn.Module) -> bool:
    """Whether ``block`` holds a module with a 2-D weight and a bias (a biased Linear or Conv1D)."""
    return any(isinstance(getattr(m, "bias", None), nn.Parameter) and getattr(getattr(m, "weight", None), "ndim", 0)
               == 2 for m in block.modules())


@dataclass(frozen=True)
class BlockWiring:
    """What the block step did (:func:`wrap_blocks`; :attr:`fp8dist.pipeline.api.WrapInfo.blocks`)."""

    activation_checkpointing: str
    """none, full or selective."""
    compiled: bool
    """Whether each block was compiled with ``torch.compile``."""
    compile_reason: str
    """Why compile is on or off (auto's decision, or "asked for")."""
    blocks: tuple[str, ...] = ()
    """The blocks checkpointed and/or compiled, by their names before wrapping."""
    notes: tuple[str, ...] = ()
    """What the user should know of this step (a Hugging Face model's KV cache turned off: it breaks wrapped
    blocks)."""
    compiled_with_options: tuple[str, ...] = ()
    """The blocks compiled with :data:`COMPILE_OPTIONS` (they hold a biased GEMM)."""


def _selective_contexts() -> Any:
    """The forward and recompute contexts of one checkpointed block call, with a GEMM counter of their own (torch
    calls ``context_fn`` once per call): each pass counts its own GEMMs from 1, so the recompute keeps and
    recomputes exactly the GEMMs the forward did."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    gemms = {False: 0, True: 0}  # per pass: ctx.is_recompute

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        name = str(op)
        if name in SELECTIVE_GEMMS:
            gemms[ctx.is_recompute] += 1
            keep = gemms[ctx.is_recompute] % 2 == 1
        else:
            keep = name in SAVED_BY_SELECTIVE
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(block: nn.Module, mode: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    kwargs = {"context_fn": _selective_contexts} if mode == "selective" else {}
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)


def _no_cache(model: nn.Module) -> str | None:
    """Turn Hugging Face's KV cache off (as ``gradient_checkpointing_enable`` does): it breaks wrapped blocks."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
        return ("model.config.use_cache set to False: a KV cache built inside checkpointed or compiled blocks "
                "breaks them, and training does not use it.")
    return None


def wrap_blocks(model: nn.Module, found: list[tuple[str, nn.Module]], mode: str, compiled: bool,
                reason: str) -> tuple[list[tuple[str, nn.Module]], BlockWiring]:
    """Checkpoint and/or compile each ``(name, block)`` of ``found`` (the model's transformer blocks, innermost
    first) in place in ``model``: activation checkpointing as ``mode`` says ("none", "full", "selective"), then
    ``torch.compile`` when ``compiled`` (``reason``: why, recorded). Call it after FP8 conversion and before sharding
    (torchtitan's order). Returns (the blocks to shard, as replaced; the :class:`BlockWiring` recorded)."""
    note = _no_cache(model)
    out, options = [], []
    for name, block in found:
        if mode != "none":
            block = _checkpointed(block, mode)
            model.set_submodule(name, block)
        if compiled:
            biased = has_biased_gemm(block)
            block.compile(options=COMPILE_OPTIONS if biased else None)
            options += [name] if biased else []
        out.append((name, block))
    return out, BlockWiring(mode, compiled, reason, tuple(n for n, _ in found), (note,) if note else (),
                            tuple(options))


def describe_blocks(wiring: BlockWiring) -> str:
    """One line of ``wiring``: activation checkpointing, compile and why, and the graph breaks met so far when
    compiled (read from dynamo's counters at the call: after the first steps, they are the run's)."""
    compiled = f"compile off ({wiring.compile_reason})"
    if wiring.compiled:
        import torch._dynamo

        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        compiled = f"compile on ({wiring.compile_reason}), {plural(breaks, 'graph break')}"
    return f"activation checkpointing {wiring.activation_checkpointing}, {compiled}"
