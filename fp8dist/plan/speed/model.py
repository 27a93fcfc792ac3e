"""One Linear's forward + backward time in bf16 and under an FP8 recipe on a named GPU: three GEMMs, each the longest
of compute, memory and the kernel floor, plus the recipe's casts (:mod:`.recipes`), with the GPU's fitted
:class:`~fp8dist.runtime.gpus.Calibration`. Pure: it reads no environment and imports no GPU library."""

from __future__ import annotations

from dataclasses import dataclass

from ...runtime.gpus import GpuSpec
from ...runtime.hardware import Hardware, find_gpu, parse_target
from .recipes import AO_KERNELS, BLOCK_KERNELS, Kernel, Recipe, recipe_named

__all__ = ["LinearPrediction", "predict_linear", "predict_fp8_speedup", "resolve_gpu", "linear_seconds",
           "forward_seconds", "gemm_seconds", "kernel_seconds"]

_BF16 = 2


@dataclass(frozen=True)
class LinearPrediction:
    """One Linear's predicted forward + backward seconds in bf16 and in FP8 (input ``(m, k)``, weight ``(n, k)``)."""

    m: int
    """Rows of the input: tokens per micro-batch per rank (for grouped GEMMs: rows routed to all experts)."""
    k: int
    """in_features."""
    n: int
    """out_features."""
    groups: int
    """Experts sharing the rows (grouped GEMMs); 1 for a Linear."""
    recipe: str
    """The speed recipe predicted (:data:`~fp8dist.plan.speed.recipes.RECIPES`)."""
    gpu: str
    """The GPU's ``--target`` key."""
    gpu_label: str
    """The GPU's name in messages."""
    compile: bool
    """Whether predicted under ``torch.compile`` (the casts fused)."""
    bf16_s: float
    """Seconds of the bf16 way's three GEMMs (output, grad_input, grad_weight), forward + backward."""
    fp8_gemm_s: float
    """The FP8 way's three GEMMs (some bf16, as the recipe says)."""
    cast_s: float
    """The FP8 way's casts and scale kernels."""
    calibrated: bool
    """True only where the constants were fitted on this GPU's own measurements of this recipe under compile."""

    @property
    def fp8_s(self) -> float:
        """Predicted seconds of the FP8 way, forward + backward: its GEMMs (``fp8_gemm_s``) plus its casts and scale
        kernels (``cast_s``); compare with ``bf16_s``."""
        return self.fp8_gemm_s + self.cast_s

    @property
    def speedup(self) -> float:
        """bf16 time over FP8 time: above 1 where FP8 is predicted faster."""
        return self.bf16_s / self.fp8_s

    @property
    def saved_s(self) -> float:
        """Seconds FP8 saves over bf16 (``bf16_s - fp8_s``); negative where FP8 is predicted slower."""
        return self.bf16_s - self.fp8_s

    @property
    def flops(self) -> int:
        """FLOPs of the layer's forward + backward GEMMs (output, grad_input, grad_weight: ``6 * m * k * n``); the
        weight of a layer's share when a step's FLOPs are split between FP8 and bf16."""
        return 6 * self.m * self.k * self.n

    def describe(self) -> str:
        """``predicted 1.21x on H100 at 8,192 tokens (rowwise)``, with "uncalibrated" where it is."""
        basis = "" if self.calibrated else ", uncalibrated"
        return f"predicted {self.speedup:.2f}x on {self.gpu_label} at {self.m:,} tokens ({self.recipe}{basis})"


def resolve_gpu(target: str | Hardware | GpuSpec) -> GpuSpec:
    """The GPU record of a ``--target`` name, a :class:`~fp8dist.runtime.hardware.Hardware` or a GpuSpec (as is).
    ValueError naming the way out: an unknown name, a CPU, a bare capability, an unlisted GPU, one without FP8."""
    spec = target
    if not isinstance(target, GpuSpec):
        lookup = find_gpu(parse_target(target) if isinstance(target, str) else target)
        if lookup.spec is None:
            raise ValueError(f"no FP8 speed prediction for target {target!r}: {lookup.reason}")
        spec = lookup.spec
    if not spec.has_fp8:
        raise ValueError(f"no FP8 speed prediction for {spec.label} (sm_{spec.capability[0]}{spec.capability[1]}): "
                         "it has no FP8 tensor cores (FP8 needs sm_89+); keep bf16 there, or plan for an FP8 GPU "
                         "with --target (e.g. h100).")
    return spec


def _check(m: int, k: int, n: int, groups: int, recipe: Recipe, gpu: GpuSpec) -> None:
    for name, value in (("m", m), ("k", k), ("n", n), ("groups", groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: the GEMM dimensions and groups are positive integers (m = tokens "
                             "per micro-batch per rank, k = in_features, n = out_features).")
    if groups > 1 and not recipe.grouped:
        raise ValueError(f"groups={groups} with recipe {recipe.name!r}: only the grouped-GEMM recipes (moe_*) take "
                         "groups; pass groups=1 for a Linear.")
    if recipe.gemm == "fp4" and gpu.fp4_tflops is None and gpu.capability >= recipe.min_capability:
        raise ValueError(f"recipe {recipe.name!r} runs FP4 GEMMs: the GPU table gives no FP4 peak for {gpu.label}. "
                         "Choose an FP8 recipe (mxfp8, te_mxfp8, ...) or a target with one (b200, gb200).")
    if gpu.capability < recipe.min_capability:
        need = f"sm_{recipe.min_capability[0]}{recipe.min_capability[1]}+"
        raise ValueError(f"recipe {recipe.name!r} needs {need}: {gpu.label} is sm_{gpu.capability[0]}"
                         f"{gpu.capability[1]}. Choose a recipe it runs (tensorwise, rowwise, te_delayed, ...) or "
                         "a target that has it.")


def gemm_seconds(gpu: GpuSpec, m: int, k: int, n: int, reads: float, writes: float, gemm: str,
                 grouped: bool = False) -> float:
    """Seconds of one GEMM of ``2*m*k*n`` flops moving ``reads + writes`` bytes, of kind ``gemm`` ("bf16", "fp8",
    "mx", "fp4"; ``grouped``: MoE experts'): the longest of compute, memory and the floor."""
    cal = gpu.calibration
    peak = ({"bf16": gpu.bf16_tflops, "fp4": gpu.fp4_tflops}.get(gemm, gpu.fp8_tflops)
            * cal.gemm_fraction(gemm, grouped))
    compute = 2 * m * k * n / (peak * 1e12)
    memory = (reads + writes) / (gpu.memory_tbps * 1e12 * cal.memory_fraction)
    return max(compute, memory, cal.kernel_floor_s)


def _gemms_s(gpu: GpuSpec, m: int, k: int, n: int, groups: int, recipe: Recipe | None, grouped: bool,
             count: int = 3) -> float:
    x = m * k  # input elements
    w = groups * n * k  # weight elements, every expert's
    g = m * n  # grad_output elements
    # output, grad_input, grad_weight: (operand elements read, elements written), the first ``count``
    gemms = ((x + w, g), (g + w, x), (x + g, w))[:count]
    low = recipe.fp8_gemms if recipe else (False, False, False)
    total = 0.0
    for (reads, writes), in_fp8 in zip(gemms, low):
        if in_fp8:
            read_bytes = reads * (recipe.operand_bytes + recipe.scale_bytes)
            total += gemm_seconds(gpu, m, k, n, read_bytes, _BF16 * writes, recipe.gemm, grouped)
        else:
            total += gemm_seconds(gpu, m, k, n, reads * _BF16, _BF16 * writes, "bf16", grouped)
    return total


def kernel_seconds(gpu: GpuSpec, kernel: Kernel, elements: int, columnwise_slowdown: float = 1.0,
                   grouped: bool = False) -> float:
    """Seconds of one cast kernel over ``elements``: its bytes at the achieved bandwidth times its kind's fitted
    slowdown, no shorter than the floor unless fused into the producer."""
    cal = gpu.calibration
    slowdown = columnwise_slowdown if kernel.columnwise else 1.0
    block = dict(zip(BLOCK_KERNELS, cal.block_cast_slowdown))
    if grouped and cal.grouped_block_cast_slowdown is not None:
        block[AO_KERNELS] = cal.grouped_block_cast_slowdown
    slowdown *= block.get(kernel.block, 1.0)
    seconds = kernel.bytes_per_element * elements * slowdown / (gpu.memory_tbps * 1e12 * cal.memory_fraction)
    return seconds if kernel.fused else max(seconds, cal.kernel_floor_s)


def _casts_s(gpu: GpuSpec, m: int, k: int, n: int, groups: int, recipe: Recipe, compile: bool,
             count: int = 3) -> float:
    """The casts of the first ``count`` operands (input, weight, grad_output)."""
    operands = zip((m * k, groups * n * k, m * n)[:count], gpu.calibration.cast_slowdown, recipe.casts(compile))
    return sum(kernel_seconds(gpu, kernel, elements, slowdown, recipe.grouped) for elements, slowdown, kernels in
               operands for kernel in kernels)


def linear_seconds(m: int, k: int, n: int, gpu: GpuSpec, recipe: Recipe, compile: bool,
                   groups: int = 1, weight_grad: bool = True) -> tuple[float, float, float]:
    """(bf16 GEMMs, FP8 GEMMs, FP8 casts) in seconds: the model unchecked, as the fits call it with trial constants.
    ``weight_grad`` False: a frozen weight (a LoRA base), whose backward runs no grad_weight GEMM; its casts are
    counted as a trainable weight's (an overestimate: the operands' grad_weight layouts are not subtracted)."""
    count = 3 if weight_grad else 2  # a frozen weight has no grad_weight GEMM
    bf16 = _gemms_s(gpu, m, k, n, groups, None, recipe.grouped, count)
    fp8 = _gemms_s(gpu, m, k, n, groups, recipe, recipe.grouped, count)
    return bf16, fp8, _casts_s(gpu, m, k, n, groups, recipe, compile)


def forward_seconds(m: int, k: int, n: int, gpu: GpuSpec, recipe: Recipe, compile: bool) -> tuple[float, float, float]:
    """(bf16 GEMM, FP8 GEMM, FP8 casts) in seconds of a Linear's forward alone, input ``(m, k)``, weight ``(n, k)``:
    one GEMM, and the recipe's casts of its input and its weight (no grad_output): what a GEMM benchmark that times
    each GEMM as a quantized Linear's forward measures (Transformer Engine's ``benchmarks/gemm/benchmark_gemm.py``
    times Fprop, Dgrad and Wgrad shapes each so). Unchecked, as :func:`linear_seconds`."""
    bf16 = _gemms_s(gpu, m, k, n, 1, None, recipe.grouped, 1)
    fp8 = _gemms_s(gpu, m, k, n, 1, recipe, recipe.grouped, 1)
    return bf16, fp8, _casts_s(gpu, m, k, n, 1, recipe, compile, 2)


def predict_linear(m: int, k: int, n: int, *, target: str | Hardware | GpuSpec, recipe: str = "tensorwise",
                   compile: bool = True, groups: int = 1, weight_grad: bool = True) -> LinearPrediction:
    """One Linear's predicted forward + backward time in bf16 and in FP8, with its breakdown
    (:func:`predict_fp8_speedup` returns the ratio only).

    Args:
        m: input rows: tokens per micro-batch per rank (``moe_*`` recipes: rows routed to all the experts).
        k: in_features. n: out_features.
        target: a ``--target`` name, a :class:`~fp8dist.runtime.hardware.Hardware` or a GPU record.
        recipe: one of :data:`fp8dist.plan.speed.RECIPES` (torchao tensorwise, rowwise, rowwise_with_gw_hp;
            te_delayed, te_current, te_blockwise, te_mxfp8, te_nvfp4; mxfp8, nvfp4; moe_fp8_rowwise, moe_mxfp8).
        compile: under ``torch.compile`` torchao's casts fuse with the previous op; TE's kernels are the same.
        groups: experts of a grouped GEMM (``moe_*`` recipes only).
        weight_grad: False for a frozen weight (``requires_grad=False``, a LoRA base): no grad_weight GEMM.

    Raises:
        ValueError: an unknown target or recipe, a GPU without FP8 or without the recipe's GEMMs, bad dimensions.
    """
    spec, chosen = resolve_gpu(target), recipe_named(recipe)
    _check(m, k, n, groups, chosen, spec)
    bf16, fp8, casts = linear_seconds(m, k, n, spec, chosen, compile, groups, weight_grad)
    calibrated = spec.calibrated and recipe in spec.calibration.recipes and compile
    return LinearPrediction(m, k, n, groups, recipe, spec.key, spec.label, compile, bf16, fp8, casts, calibrated)


def predict_fp8_speedup(m: int, k: int, n: int, *, target: str | Hardware | GpuSpec, recipe: str = "tensorwise",
                        compile: bool = True, groups: int = 1) -> float:
    """Predicted bf16 / FP8 forward + backward time of one Linear with input ``(m, k)`` and weight ``(n, k)`` on
    ``target``: above 1 where FP8 is faster. Args and Raises: as :func:`predict_linear`; accuracy:
    ``benchmarks/speed_model/README.md``.

    Example:
        >>> round(predict_fp8_speedup(8192, 2048, 2048, target="h100", recipe="rowwise"), 2) < 1
        True
    """
    return predict_linear(m, k, n, target=target, recipe=recipe, compile=compile, groups=groups).speedup
