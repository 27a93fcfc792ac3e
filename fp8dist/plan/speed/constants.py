"""The step model's constants: what no datasheet gives about a whole training step (:class:`StepConstants`) and
the values fitted on published runs (:data:`STEP_CONSTANTS`). :mod:`.comm` and :mod:`.step_time` both read them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepConstants", "STEP_CONSTANTS"]


@dataclass(frozen=True)
class StepConstants:
    """What no datasheet gives about a whole step: two fitted constants and the assumptions beside them."""

    gemm_efficiency: float
    """The step's GEMM time over the per-GEMM model's (fitted): GEMMs beside NCCL kernels, under a power limit."""
    memory_traffic: float
    """Bytes of memory-bound work (norms, SwiGLU, RoPE, residuals, the loss, FSDP's copies) per byte of Linear
    activation (bf16 inputs and outputs, forward; backward twice that), fitted."""
    attention_fraction: float = 0.35
    """Fraction of the dense bf16 peak FlashAttention-2 (PyTorch's SDPA) reaches: 35% on H100 (FlashAttention-3,
    Shah et al. 2024, arXiv:2407.08608, abstract)."""
    attention_backward: float = 2.5
    """Backward FLOPs over forward: five matmuls against two (FlashAttention-2, Dao 2023, arXiv:2307.08691)."""
    eager_traffic: float = 3.0
    """Passes over the Linear activations eager makes where compile fuses into one (assumed)."""
    adapter_traffic: float = 3.0
    """Passes over a trainable Linear's bf16 input and output beside a frozen base (a LoRA adapter: dropout writes
    its input, lora_A reads it, lora_B's output is read and added to the base output), counted from PEFT's ops."""
    collective_fraction: float = 0.8
    """Fraction of one direction's link bandwidth an NCCL all-gather / reduce-scatter reaches (assumed)."""
    optimizer_bytes: float = 32.0
    """Bytes per parameter shard of an fp32 AdamW step (param, grad, two moments read; three written; the norm)."""
    fitted_gpu: str = "h100-hbm2e"
    """The GPU record the constants were fitted on: its predictions of ``fitted_recipes`` are the calibrated ones."""
    fitted_recipes: tuple[str, ...] = ("tensorwise",)
    """The recipes the constants were fitted with (on ``fitted_gpu``)."""
    fitted_on: str = ("every modelled row of benchmarks/step_model/runs.csv: torchao's H100 / B200 / MI300X Llama3-8B "
                      "tables, torchtitan's H100 runs and #3914 (4x GB200), Megatron-Bridge's performance summary, "
                      "TE's training GEMM speedups, torchtune #2833 (benchmarks/step_model/fit.py; each source's "
                      "agreement when left out of the fit: agree.py)")
    """The measurements the constants were fitted on, in words."""


STEP_CONSTANTS = StepConstants(gemm_efficiency=0.924, memory_traffic=6.16)
"""Fitted by ``benchmarks/step_model/fit.py`` (its ``fit.json`` holds the same numbers)."""
