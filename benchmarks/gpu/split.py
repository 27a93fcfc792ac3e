"""A measured step in the parts the step model predicts: a torch.profiler trace's kernels sorted by name into GEMMs,
FP8 cast kernels, attention, collectives, the optimizer and the rest (memory-bound work), and one row per step cell
that puts each measured part beside ``fp8dist.predict_step``'s (benchmarks/gpu/check.py's step part)."""

from __future__ import annotations

from typing import Any

__all__ = ["KINDS", "PREDICTED_OF", "classify", "split", "step_row"]

KINDS = ("gemm", "cast", "attention", "collective", "optimizer", "memory")
"""The measured parts, in the order a row lists them; "memory": every kernel no other name matches (norms, SwiGLU,
RoPE, residuals, copies, the loss)."""

_NAMES = (  # the first kind whose words a kernel (or, on a CPU, an operator) name holds, in this order
    ("collective", ("nccl", "c10d::", "allreduce", "all_reduce", "allgather", "all_gather", "reducescatter",
                    "reduce_scatter", "all_to_all", "alltoall")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "_efficient_attention", "cudnn_generated_fort_native")),
    # before the casts: an FP8 GEMM's kernel names its e4m3 operands
    ("gemm", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "gemv", "splitk", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::_scaled_mm", "aten::_grouped_mm", "triton_tem_fused")),
    ("cast", ("amax", "abs_max", "float8", "fp8", "e4m3", "e5m2", "mxfp", "nvfp4", "fp4", "quantize", "to_mx",
              "scaled_cast", "clamp_div", "reciprocal")),
    ("optimizer", ("multi_tensor_apply", "adam", "_foreach_", "foreach", "fused_sgd")),
)

PREDICTED_OF = {"gemm": ("gemm_s",), "attention": ("attention_s",), "collective": ("collective_s",),
                "optimizer": ("optimizer_s",), "cast": (), "memory": ("memory_s", "recompute_s")}
"""Which ``StepParts`` fields each measured kind is compared with: the model counts FP8 casts in its memory-bound
part (``memory_s``), so a row compares "cast" + "memory" with ``memory_s`` + ``recompute_s``."""


def classify(name: str) -> str:
    """The kind (one of :data:`KINDS`) of a CUDA kernel or profiler operator named ``name``."""
    lowered = name.lower()
    return next((kind for kind, words in _NAMES if any(word in lowered for word in words)), "memory")


def split(prof: Any, *, steps: int, device: str) -> dict[str, float]:
    """Seconds per step of each kind in ``prof`` (a finished ``torch.profiler.profile`` over ``steps`` steps): the
    CUDA kernels' device time on a GPU (``device="cuda"``), every operator's own CPU time on a CPU (a dry run's
    plumbing; a CPU's split says nothing of a GPU's)."""
    from torch.autograd import DeviceType

    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1 (the profiled steps the times are divided by)")
    totals = dict.fromkeys(KINDS, 0.0)
    for event in prof.key_averages():
        if device == "cuda":
            if event.device_type != DeviceType.CUDA:
                continue
            micros = getattr(event, "self_device_time_total", None)
            micros = event.self_cuda_time_total if micros is None else micros
        else:
            micros = event.self_cpu_time_total
        totals[classify(event.key)] += micros / 1e6 / steps
    return totals


def step_row(cell: str, measured_step_s: float | None, measured: dict[str, float] | None,
             predicted: dict[str, Any] | None) -> dict[str, Any]:
    """One step cell's record: the measured step and its split beside the predicted parts of the same precision
    (``predicted``: a ``StepParts`` as a dict, or None where fp8dist has no prediction for it), per kind:
    ``{"measured_s", "predicted_s", "predicted_from"}``, and the unsplit rest of the measured step (host gaps)."""
    parts: dict[str, Any] = {}
    for kind in KINDS:
        fields = PREDICTED_OF[kind]
        predicted_s = sum(predicted[f] for f in fields) if predicted is not None and fields else None
        parts[kind] = {"measured_s": None if measured is None else round(measured[kind], 6),
                       "predicted_s": None if predicted_s is None else round(predicted_s, 6),
                       "predicted_from": list(fields)}
    busy = None if measured is None else sum(measured.values())
    return {"cell": cell, "measured_step_s": measured_step_s, "predicted_step_s": None if predicted is None else
            round(sum(predicted[f] for f in ("gemm_s", "attention_s", "memory_s", "recompute_s", "optimizer_s",
                                              "exposed_s")), 6),
            "parts": parts, "kernels_s": None if busy is None else round(busy, 6),
            "unsplit_s": None if busy is None or measured_step_s is None else round(measured_step_s - busy, 6)}
