"""Per-block activation checkpointing and torch.compile: the step of :func:`fp8dist.wrap_model` between FP8
conversion and sharding, in torchtitan's order (convert -> checkpoint -> compile -> shard), on the same blocks
FSDP shards.

- Activation checkpointing wraps each block in torch's ``checkpoint_wrapper`` (non-reentrant): ``state_dict()``
  keys do not change (the wrapper strips its prefix) and DCP's ``get_state_dict`` sees the same names.
  ``selective`` keeps the outputs of matrix multiplies and attention (torchtitan's "op" mode) and recomputes the
  rest.
- Compile is ``block.compile()`` in place, so names and state-dict keys do not change either (``torch.compile``
  would add ``_orig_mod``); FSDP's hooks then run outside the compiled graph. Blocks with a biased GEMM get one
  inductor option that works around a torch bug on CPU (:data:`COMPILE_OPTIONS`).

What was decided, and why, is returned as :class:`BlockWiring` data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config.text import plural
from ..plan.hardware import Hardware

__all__ = ["BlockWiring", "COMPILE_OPTIONS", "has_biased_gemm", "compile_decision", "wrap_blocks", "describe_blocks",
           "graph_breaks", "SAVED_BY_SELECTIVE"]

SAVED_BY_SELECTIVE = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                      "_scaled_dot_product_flash_attention_for_cpu")
"""aten ops whose outputs selective checkpointing keeps (everything else in a block is recomputed)."""


COMPILE_OPTIONS = {"cpp.max_horizontal_fusion_size": 1}
"""Inductor options of a compiled block that holds a biased GEMM. On CPU (inductor's C++ backend; ``cpp.*``
options do nothing for CUDA kernels), torch 2.13's vectorized code declares the same variable twice when one bf16
reduction is stored into two outputs -- the two bias gradients of GPT-NeoX's parallel residual (two biased Linears
whose outputs are summed) -- and the kernel fails to compile (``conflicting declaration 'auto
at_BFloat16_tmp_acc0_vec'``; pytorch/pytorch#194706, open; tests/test_blocks.py keeps the reproduction as an expected
failure). Without horizontal fusion the two outputs come from two loops, each stored once; every other fusion, and
vectorization, stays (GPT-NeoX fsdp bf16 on CPU: a step 8% faster than eager, measured on a busy 2-core machine).
Blocks without a biased GEMM (Llama's) compile with torch's defaults: their numbers stay those of a plain
``torch.compile``."""


def has_biased_gemm(block: nn.Module) -> bool:
    """Whether ``block`` holds a module with a 2-D weight and a bias (a biased Linear or Conv1D)."""
    return any(isinstance(getattr(m, "bias", None), nn.Parameter) and getattr(getattr(m, "weight", None), "ndim", 0)
               == 2 for m in block.modules())


@dataclass(frozen=True)
class BlockWiring:
    """What the block step did."""

    activation_checkpointing: str
    """none, full or selective."""
    compiled: bool
    compile_reason: str
    """Why compile is on or off (auto's decision, or "asked for")."""
    blocks: tuple[str, ...] = ()
    """The blocks checkpointed and/or compiled, by their names before wrapping."""
    notes: tuple[str, ...] = ()
    compiled_with_options: tuple[str, ...] = ()
    """The blocks compiled with :data:`COMPILE_OPTIONS` (they hold a biased GEMM)."""


def compile_decision(compile: bool | None, fp8: str | None, converted: bool, device: torch.device | Hardware,
                     refusal: str | None) -> tuple[bool, str]:
    """Whether blocks are compiled, and why. ``refusal`` is why the combination table refuses compile for this
    config (an FP8 backend's or the strategy's rule), which turns auto off; asking for compile there is an error
    when the config is built (:mod:`fp8dist.config.rules`)."""
    if compile is not None:
        return compile, "asked for" if compile else "turned off"
    if refusal is not None:
        return False, f"auto: off ({refusal})"
    if device.type != "cuda":
        return False, f"auto: off on {device.type} (compiling costs more than it saves there)"
    if not converted:
        return False, "auto: off without FP8 layers (compile=True turns it on)"
    return True, f"auto: on ({fp8} FP8 on CUDA: compiled blocks fuse the casts and scaling)"


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(op, "_opname", None) or str(op).split(".")[1]
    return CheckpointPolicy.MUST_SAVE if name in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(block: nn.Module, mode: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    kwargs = {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)} \
        if mode == "selective" else {}
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)


def _no_cache(model: nn.Module) -> str | None:
    """Hugging Face models build a KV cache in forward unless told not to; a cache filled inside a checkpointed or
    compiled block breaks both (as ``gradient_checkpointing_enable`` does, training turns it off)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
        return ("model.config.use_cache set to False: a KV cache built inside checkpointed or compiled blocks "
                "breaks them, and training does not use it.")
    return None


def wrap_blocks(model: nn.Module, found: list[tuple[str, nn.Module]], mode: str, compiled: bool,
                reason: str) -> tuple[list[tuple[str, nn.Module]], BlockWiring]:
    """Checkpoint (``mode``) and/or compile each block of ``found`` (``(name, module)`` pairs), in place in
    ``model``; returns the blocks to shard (the wrappers where there are some) and what was done. Called only
    where there is something to do (``wrap_model`` skips it otherwise)."""
    note = _no_cache(model)
    out, options = [], []
    for name, block in found:
        if mode != "none":
            block = _checkpointed(block, mode)
            model.set_submodule(name, block)
        if compiled and has_biased_gemm(block):
            block.compile(options=COMPILE_OPTIONS)
            options.append(name)
        elif compiled:
            block.compile()
        out.append((name, block))
    return out, BlockWiring(mode, compiled, reason, tuple(n for n, _ in found), (note,) if note else (),
                            tuple(options))


def graph_breaks() -> int:
    """Graph breaks torch.compile has met in this process so far (``torch._dynamo``'s counters)."""
    import torch._dynamo

    return sum(torch._dynamo.utils.counters["graph_break"].values())


def describe_blocks(wiring: BlockWiring) -> str:
    """One line: activation checkpointing, compile and why, and the graph breaks met so far when compiled."""
    compiled = (f"compile on ({wiring.compile_reason}), {plural(graph_breaks(), 'graph break')}" if wiring.compiled
                else f"compile off ({wiring.compile_reason})")
    return f"activation checkpointing {wiring.activation_checkpointing}, {compiled}"
