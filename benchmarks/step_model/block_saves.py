"""What a compiled, checkpointed decoder block keeps for backward, read from torch's own partitioner: a block shaped
as torchtitan's Llama3 (fused wqkv, SwiGLU), its Linears bf16 or torchao 0.18's NVFP4 training Linear
(``nvfp4_mm_triton``: its autograd Function, its saves, its ``F.scaled_mm``, unchanged), compiled with the min-cut
partitioner inductor uses, under no checkpointing or torchtitan's selective policy (#3914's ``SelectiveAC``: every
other ``aten.mm`` / ``aten.linear`` output, attention and ``aten.max`` saved, every other op recomputed). The
forward graph's extra outputs are what stays alive from forward to backward.

torchao's NVFP4 Triton kernels run on SM100 GPUs only; here CPU ops stand in for the three of them
(``triton_rht_amax``, ``triton_rht_quantize_row_col``, ``triton_weight_quantize_2d``), returning zeros of the shapes
and dtypes torchao's own fake kernels give, so compile traces the rest of torchao's code as a GPU run does. Nothing
is executed past the partition (``F.scaled_mm``'s FP4 GEMM has no CPU kernel)."""

from __future__ import annotations

import functools
from contextlib import contextmanager, suppress
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

BLOCK = dict(batch=1, seq=256, h=256, heads=2, kv_heads=1, head_dim=128, inter=896)
"""Llama3-8B's ratios (k/v width h/4, intermediate 3.5h, head dim 128), small enough to trace on a CPU; every GEMM
dim a multiple of 128, as NVFP4's kernels require."""
KINDS = ("block input", "attention", "GEMM outputs", "quantized copies", "amax scalars", "other")
"""What :func:`block_saves` sorts a saved tensor into: a 3-D placeholder is the block's input, a 4-D tensor or the fp32
log-sum-exp attention's (its q, k, v and output without checkpointing), a uint8 / e4m3 / e2m1 tensor NVFP4's codes and
scales, a 0-d one an amax."""
_SIGNS = (1, -1) * 8  # the Hadamard sign vector: any 16 signs trace alike
_STANDIN = "fp8dist_step_model_nvfp4"


class _Partitioned(Exception):
    """Raised by the captured forward graph instead of running it: the partition is all this reads."""


@functools.cache
def _standin_kernels() -> torch.library.Library:
    """CPU stand-ins for torchao's NVFP4 kernels, registered once (the library lives as long as the process)."""
    lib = torch.library.Library(_STANDIN, "DEF")
    lib.define("amax(Tensor a) -> (Tensor, Tensor)")
    lib.define("quantize_row_col(Tensor a, Tensor col_amax, Tensor row_amax) -> (Tensor, Tensor, Tensor, Tensor)")
    lib.define("quantize_weight(Tensor a, Tensor amax) -> (Tensor, Tensor, Tensor, Tensor)")

    def amax(a):
        return a.new_zeros((), dtype=torch.float32), a.new_zeros((), dtype=torch.float32)

    def codes(a):  # rowwise and columnwise FP4 codes (2 a byte) and swizzled e4m3 scales (1 per 16), as torchao's
        m, n = a.shape
        return (a.new_zeros((n, m // 2), dtype=torch.uint8),
                a.new_zeros((n // 128, m // 64, 32, 16), dtype=torch.float8_e4m3fn),
                a.new_zeros((m, n // 2), dtype=torch.uint8),
                a.new_zeros((m // 128, n // 64, 32, 16), dtype=torch.float8_e4m3fn))

    def quantize_row_col(a, col_amax, row_amax):
        return codes(a)

    def quantize_weight(a, amax):
        col, col_sf, row, row_sf = codes(a)
        return row, row_sf, col, col_sf

    for name, fn in (("amax", amax), ("quantize_row_col", quantize_row_col), ("quantize_weight", quantize_weight)):
        lib.impl(name, fn, "CPU")
        torch.library.register_fake(f"{_STANDIN}::{name}", fn, lib=lib)
    return lib


@contextmanager
def _torchao_nvfp4_on_cpu() -> Iterator[Any]:
    """torchao's NVFP4 training Linear module with the stand-in kernels in place of its Triton ones."""
    from torchao.prototype.moe_training.nvfp4_training import nvfp4_linear as ao

    _standin_kernels()
    ops = getattr(torch.ops, _STANDIN)
    standins = {"triton_rht_amax": lambda a, sign_vector, **_: ops.amax(a),
                "triton_rht_quantize_row_col": lambda a, **kw: ops.quantize_row_col(a, kw["col_global_amax"],
                                                                                    kw["row_global_amax"]),
                "triton_weight_quantize_2d": ops.quantize_weight}
    kept = {name: getattr(ao, name) for name in standins}
    for name, fn in standins.items():
        setattr(ao, name, fn)
    try:
        yield ao
    finally:
        for name, fn in kept.items():
            setattr(ao, name, fn)


class _NVFP4Linear(nn.Linear):
    """torchao's functional NVFP4 Linear, as torchtitan's ``NVFP4Linear.forward`` calls it."""

    def __init__(self, ao: Any, fan_in: int, fan_out: int) -> None:
        super().__init__(fan_in, fan_out, bias=False)
        self.ao = ao
        self.register_buffer("sr_seed", torch.zeros(1, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ao.nvfp4_linear(x, self.weight, None, sr_seed=self.sr_seed, sign_vector=_SIGNS)


class _Block(nn.Module):
    """torchtitan's Llama3 block: RMSNorm, fused wqkv, attention (SDPA: #3914's FlexAttention, saved alike), wo,
    RMSNorm, w2(silu(w1 x) * w3 x), two residual adds."""

    def __init__(self, linear: Any) -> None:
        super().__init__()
        b = BLOCK
        self.kv = b["kv_heads"] * b["head_dim"]
        self.attention_norm, self.ffn_norm = nn.RMSNorm(b["h"]), nn.RMSNorm(b["h"])
        self.wqkv, self.wo = linear(b["h"], b["h"] + 2 * self.kv), linear(b["h"], b["h"])
        self.w1, self.w3, self.w2 = linear(b["h"], b["inter"]), linear(b["h"], b["inter"]), linear(b["inter"], b["h"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, (n, s, _) = BLOCK, x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).split([b["h"], self.kv, self.kv], -1)
        q, k, v = (t.view(n, s, -1, b["head_dim"]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(out.transpose(1, 2).reshape(n, s, -1))
        y = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


def _torchtitan_policy() -> Any:
    """A fresh per-op policy as torchtitan's ``SelectiveAC`` decides (#3914's commit): MUST_SAVE the compute-intensive
    ops of ``get_default_op_list()``, attention (here SDPA's CPU op), ``aten.max`` and ``aten.linear``, but every
    second ``aten.mm`` / ``aten.linear``; PREFER_RECOMPUTE everything else."""
    from torch._functorch.partitioners import get_default_op_list
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    gemms = (aten.mm.default, aten.linear.default)
    saved = {op.default for op in get_default_op_list().compute_intensive_ops}
    saved |= {*gemms, aten.max.default, aten._scaled_dot_product_flash_attention_for_cpu.default}
    counts = {False: 0, True: 0}  # forward, recompute

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func in gemms:
            counts[ctx.is_recompute] += 1
        if func in saved and not (func in gemms and counts[ctx.is_recompute] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module, checkpointing: str) -> None:
        super().__init__()
        self.block, self.checkpointing = block, checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "none":
            return self.block(x)
        return checkpoint(self.block, x, use_reentrant=False, context_fn=_torchtitan_policy)


def _kind(node: Any, value: torch.Tensor) -> str | None:
    """What a saved tensor is; None for a parameter or buffer (not an activation)."""
    b = BLOCK
    if node.op == "placeholder":
        return "block input" if value.dim() == 3 else None
    if value.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float4_e2m1fn_x2):
        return "quantized copies"
    if value.dim() == 0:
        return "amax scalars"
    if value.dim() == 4 or value.shape == (b["batch"], b["heads"], b["seq"]):
        return "attention"
    return "GEMM outputs" if value.dim() == 2 and value.dtype == torch.bfloat16 else "other"


def block_saves(recipe: str, checkpointing: str) -> dict[str, int]:
    """Bytes the compiled block keeps from forward to backward, by kind (:data:`KINDS`), for ``recipe`` ("bf16",
    "nvfp4") under ``checkpointing`` ("none", "selective": torchtitan's policy); parameters and buffers left out.
    Compiles one block (under a second on a CPU)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    saved: dict[str, int] = dict.fromkeys(KINDS, 0)
    captured: list[torch.fx.GraphModule] = []

    def forward_graph(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        captured.append(graph)
        outputs = next(iter(graph.graph.find_nodes(op="output"))).args[0]
        for node in outputs[1:]:  # the block's output, then what backward reads
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and (kind := _kind(node, value)):
                saved[kind] += value.numel() * value.element_size()

        def stop(*args: Any) -> Any:
            raise _Partitioned

        return stop

    backend = aot_autograd(fw_compiler=forward_graph, partition_fn=min_cut_rematerialization_partition)
    with _torchao_nvfp4_on_cpu() as ao:
        linear = functools.partial(_NVFP4Linear, ao) if recipe == "nvfp4" else functools.partial(nn.Linear, bias=False)
        module = _Checkpointed(_Block(linear), checkpointing).to(torch.bfloat16)
        torch._dynamo.reset()
        compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=False)
        x = torch.zeros(BLOCK["batch"], BLOCK["seq"], BLOCK["h"], dtype=torch.bfloat16, requires_grad=True)
        try:
            with suppress(_Partitioned):
                compiled(x)
        finally:
            torch._dynamo.reset()
    if len(captured) != 1:
        raise RuntimeError(f"the {recipe} block compiled into {len(captured)} forward graphs, not one")
    return saved


def all_block_saves() -> dict[str, dict[str, dict[str, int]]]:
    """:func:`block_saves` for bf16 and NVFP4, without checkpointing and under torchtitan's selective policy."""
    return {recipe: {ac: block_saves(recipe, ac) for ac in ("none", "selective")} for recipe in ("bf16", "nvfp4")}
