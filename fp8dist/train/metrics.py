"""The figures a training user reads each step (loss, grad norm, lr, tokens/s, step time, MFU, FP8-aware MFU, peak
memory), written one JSON object per step and optionally as TensorBoard scalars: :class:`TrainingFigures` and
:class:`MetricsWriter` give your own loop what ``fp8dist train`` logs."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["DevicePeaks", "device_peaks", "AttentionShape", "FlopsPerToken", "flops_per_token", "Utilization",
           "utilization", "StepRecord", "TrainingFigures", "MetricsWriter", "METRIC_KEYS", "truncate_jsonl"]

METRIC_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu", "fp8_aware_mfu",
               "peak_memory_bytes", "skipped_steps")
"""The keys of every JSON line :class:`MetricsWriter` writes (null where not known or not finite)."""


class DevicePeaks(Protocol):
    """A device's dense tensor-core peaks in TFLOP/s (a :class:`fp8dist.runtime.gpus.GpuSpec` is one); None: unknown."""

    label: str
    bf16_tflops: float | None
    fp8_tflops: float | None


def device_peaks(device: torch.device) -> tuple[DevicePeaks | None, str]:
    """The dense peaks of ``device`` from fp8dist's GPU table, or None and why (a CPU, a GPU the table lacks)."""
    from ..runtime.hardware import find_gpu, hardware_of

    if device.type != "cuda":
        return None, f"MFU is a fraction of a GPU's dense tensor-core peak, and {device.type} is not a GPU"
    lookup = find_gpu(hardware_of(device))
    return lookup.spec, lookup.reason


@dataclass(frozen=True)
class AttentionShape:
    """The attention dimensions of the FLOPs count (query heads; context in tokens)."""

    layers: int
    heads: int
    head_dim: int
    context: int

    @classmethod
    def of(cls, config: Any, seq_len: int) -> AttentionShape:
        """From a Hugging Face config at ``seq_len`` tokens of context."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, heads, head_dim, seq_len)


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs (forward + backward) per token: 6 x the multiplying parameters of the GEMMs kept in high
    precision and of those the plan runs in FP8, and the attention's 12 x layers x heads x head_dim x context."""

    gemm_high: int
    gemm_fp8: int
    attention: int

    @property
    def total(self) -> int:
        """FLOPs per token: the GEMMs' in both precisions plus attention's."""
        return self.gemm_high + self.gemm_fp8 + self.attention

    def describe(self) -> str:
        """The FLOPs per token in words, with the formula."""
        return (f"{self.total:.3e} FLOPs/token = 6 x {(self.gemm_high + self.gemm_fp8) // 6:,} multiplying params "
                f"({self.gemm_fp8 // 6:,} in FP8) + attention {self.attention:.3e} (PaLM's 6N + 12LHQT)")


def flops_per_token(model: nn.Module, *, seq_len: int, attention: AttentionShape | None = None) -> FlopsPerToken:
    """The training FLOPs per token of ``model`` (wrapped: its plan says which GEMMs run in FP8) at ``seq_len`` tokens
    of context: PaLM's ``6N + 12LHQT`` (Chowdhery et al. 2022, app. B), N the weights of every GEMM (the head too, a
    MoE expert's scaled by top_k / experts; not embeddings or norms); as torchtitan and Megatron, no causal-mask
    discount nor recomputation. ``attention`` defaults to the model's Hugging Face ``config`` (else ValueError)."""
    from ..pipeline.api import get_plan
    from ..config.resolve import Config
    from ..runtime.hardware import Hardware
    from ..plan.precision import plan_precision
    from ..strategies import unwrap_model

    try:
        plan = get_plan(model)
    except ValueError:  # not wrapped: the plan with FP8 off counts the same GEMMs
        plan = plan_precision(model, Config(), device=Hardware("cpu"))
    fp8 = sum(e.gemm_flops for e in plan if e.precision == "fp8")
    high = sum(e.gemm_flops for e in plan) - fp8
    if attention is None:
        config = getattr(unwrap_model(model), "config", None)
        if config is None or not hasattr(config, "num_attention_heads"):
            raise ValueError(f"{type(model).__name__} has no Hugging Face config to read its attention from: pass "
                             "attention=AttentionShape(layers=, heads=, head_dim=, context=seq_len).")
        attention = AttentionShape.of(config, seq_len)
    attn = 12 * attention.layers * attention.heads * attention.head_dim * attention.context
    return FlopsPerToken(3 * high, 3 * fp8, attn)  # plan entries hold forward FLOPs: 2 x params


@dataclass(frozen=True)
class Utilization:
    """MFU: achieved FLOP/s per device / the dense bf16 peak, every FLOP as bf16 (torchtitan's figure, which with FP8
    overstates what is left to gain). FP8-aware MFU: the step's FLOPs' time at peak (FP8 GEMMs at the FP8 peak, the
    rest at bf16) / the step's time. None with ``note`` saying why (an unknown peak: a CPU)."""

    mfu: float | None
    fp8_aware_mfu: float | None
    note: str | None = None


def utilization(flops: FlopsPerToken, tokens_per_s_per_device: float, peaks: DevicePeaks | None,
                device: str = "this device") -> Utilization:
    """MFU and FP8-aware MFU (:class:`Utilization`) of ``tokens_per_s_per_device`` at ``flops`` per token against the
    device's dense ``peaks``; None with the reason where a peak is unknown (``device`` names it)."""
    bf16 = (getattr(peaks, "bf16_tflops", None) or 0) * 1e12
    if not bf16:
        return Utilization(None, None, f"no dense bf16 peak is known for {device}")
    mfu = tokens_per_s_per_device * flops.total / bf16
    if flops.gemm_fp8 == 0:
        return Utilization(mfu, mfu)
    fp8 = (getattr(peaks, "fp8_tflops", None) or 0) * 1e12
    if not fp8:
        return Utilization(mfu, None, f"no dense FP8 peak is known for {device}")
    ideal_s = (flops.gemm_high + flops.attention) / bf16 + flops.gemm_fp8 / fp8
    return Utilization(mfu, tokens_per_s_per_device * ideal_s)


def _float(value: Any) -> float | None:  # non-finite kept: the step line shows them, JSON gets null
    return None if value is None else float(value.item() if isinstance(value, torch.Tensor) else value)


def _number(value: Any) -> float | None:
    value = _float(value)
    return value if value is not None and math.isfinite(value) else None


@dataclass
class StepRecord:
    """One logged step's figures (``as_dict`` is its JSON line; keys :data:`METRIC_KEYS`, then ``extra``, e.g. a
    validation loss). ``loss`` may be nan or inf (null in JSON); ``tokens_per_s`` is global; ``peak_memory_bytes``
    this process's (CUDA allocated, or peak RSS on CPU); ``skipped_steps`` so far, for non-finite gradients."""

    step: int
    loss: float | None
    grad_norm: float | None
    lr: float | None
    tokens_per_s: float
    step_time_s: float
    mfu: float | None
    fp8_aware_mfu: float | None
    peak_memory_bytes: int | None
    skipped_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The record as one JSON row (metrics.jsonl): every metric key and the extras, a non-finite float as null."""
        out = {k: getattr(self, k) for k in METRIC_KEYS}
        out.update(self.extra)
        return {k: _number(v) if isinstance(v, float) else v for k, v in out.items()}

    def line(self) -> str:
        """The step's line as ``fp8dist train`` prints it."""
        return f"step {self.step} | {self.figures()}"

    def figures(self) -> str:
        """The figures without the step number, ``|``-separated (MFU ``n/a`` where null)."""
        def pct(v: float | None) -> str:
            return "n/a" if v is None else f"{100 * v:.1f}%"

        parts = ["loss n/a" if self.loss is None else f"loss {self.loss:.4f}"]
        if self.grad_norm is not None:
            parts.append(f"grad norm {self.grad_norm:.3g}")
        if self.lr is not None:
            parts.append(f"lr {self.lr:.2e}")
        parts += [f"{self.tokens_per_s:,.0f} tok/s", f"{self.step_time_s:.3f} s/step"]
        if self.mfu is None and self.fp8_aware_mfu is None:
            parts.append("MFU n/a")
        else:
            parts += [f"MFU {pct(self.mfu)} (bf16 peak)", f"FP8-aware MFU {pct(self.fp8_aware_mfu)}"]
        if self.peak_memory_bytes is not None:
            parts.append(f"peak mem {self.peak_memory_bytes / 2**30:.2f} GiB")
        parts.append(f"skipped {self.skipped_steps}")
        wire, ratio = self.extra.get("grad_wire_bytes"), _number(self.extra.get("grad_wire_ratio"))
        if wire is not None:  # reduce_dtype='fp8': this rank's gradient bytes, counted at the collectives
            parts.append(f"grad wire {wire / 2**20:.2f} MiB" + (f" ({ratio:.3f}x bf16)" if ratio is not None else ""))
        val = _number(self.extra.get("val_loss"))
        if val is not None:
            ppl = _number(self.extra.get("val_perplexity"))
            parts.append(f"val loss {val:.4f}" + (f" (ppl {ppl:.2f})" if ppl is not None else ""))
        return " | ".join(parts)


class TrainingFigures:
    """The figures of each step of a training loop, as ``fp8dist train`` logs them. Build once after
    :func:`fp8dist.wrap_model`, call :meth:`step` after each optimizer step.

    Args:
        model: the wrapped model (or an unwrapped one: no FP8 layers counted).
        peaks: a :class:`DevicePeaks`; "auto": the model's device in fp8dist's GPU table; None: unknown, MFU null.
        world_size: devices sharing the work; default the wrapped model's world size (1 unwrapped).
        attention: see :func:`flops_per_token`.
    """

    def __init__(self, model: nn.Module, *, seq_len: int, peaks: DevicePeaks | None | str = "auto",
                 world_size: int | None = None, attention: AttentionShape | None = None) -> None:
        from ..pipeline.api import get_wrap_info

        self.flops = flops_per_token(model, seq_len=seq_len, attention=attention)
        try:
            env = get_wrap_info(model).env
        except ValueError:
            env = None
        self.world_size = world_size or (env.world_size if env else 1)
        self.device = env.device if env else next(model.parameters()).device
        why = None
        if isinstance(peaks, str):
            if peaks != "auto":
                raise ValueError(f"peaks={peaks!r}: pass a DevicePeaks (an fp8dist.runtime.gpus.GpuSpec), 'auto' or "
                                 "None.")
            peaks, why = device_peaks(self.device)
        self.peaks = peaks
        self.device_name = getattr(peaks, "label", None) or str(self.device)
        note = utilization(self.flops, 1.0, peaks, self.device_name).note
        self.null_reason: str | None = f"{note}; {why}" if note and why else note  # why MFU is null here

    def header(self) -> str:
        """What the figures mean, for the run's header: FLOPs count, peaks, why MFU is null."""
        lines = [f"figures: {self.flops.describe()}"]
        bf16 = getattr(self.peaks, "bf16_tflops", None)
        if bf16:
            fp8 = getattr(self.peaks, "fp8_tflops", None)
            lines.append(f"MFU: achieved FLOP/s per device / {self.device_name}'s dense bf16 peak {bf16:,.0f} "
                         f"TFLOP/s; FP8-aware MFU counts the FP8 layers' GEMMs at the dense FP8 peak "
                         f"({f'{fp8:,.0f} TFLOP/s' if fp8 else 'unknown'}); peaks from fp8dist.runtime.gpus")
        if self.null_reason:
            lines.append(f"MFU: null ({self.null_reason})")
        return "\n".join(lines)

    def step(self, *, step: int, loss: Any, tokens: int, step_time_s: float, grad_norm: Any = None,
             lr: float | None = None, skipped_steps: int = 0, peak_memory_bytes: int | None = None,
             extra: dict[str, Any] | None = None) -> StepRecord:
        """The :class:`StepRecord` of a step that trained ``tokens`` tokens (all ranks') in ``step_time_s``;
        ``peak_memory_bytes`` defaults to this process's peak so far."""
        if step_time_s <= 0:
            raise ValueError(f"step_time_s={step_time_s!r} must be positive (the step's wall time in seconds).")
        from ..runtime.env import peak_memory_mib

        tokens_per_s = tokens / step_time_s
        use = utilization(self.flops, tokens_per_s / self.world_size, self.peaks, self.device_name)
        if peak_memory_bytes is None:
            peak_memory_bytes = round(peak_memory_mib(self.device) * 2**20)
        return StepRecord(step, _float(loss), _float(grad_norm), _number(lr), tokens_per_s, step_time_s, use.mfu,
                          use.fp8_aware_mfu, peak_memory_bytes, skipped_steps, dict(extra or {}))


class MetricsWriter:
    """Writes each :class:`StepRecord` as one JSON line to ``path`` (flushed per line: a crash loses no logged step)
    and, with ``tensorboard_dir``, as TensorBoard scalars ``train/<key>`` (``pip install 'fp8dist[tensorboard]'``).
    Use on one rank (rank 0).

    Args:
        path, tensorboard_dir: the JSON-lines file and the TensorBoard log directory; None: not written.
        append: add to an existing file (a resumed run) instead of starting it anew.
        purge_step: a resumed run's first logged step: TensorBoard hides what an earlier run logged there at this
            step and after (SummaryWriter's ``purge_step``), as :func:`truncate_jsonl` does for the file.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, tensorboard_dir: str | os.PathLike | None = None,
                 append: bool = False, purge_step: int | None = None) -> None:
        from ..runtime.files import check_output_path

        if path is not None:  # both checked before either is opened: nothing half-made on a bad path
            check_output_path(path, name="path")
        if tensorboard_dir is not None:
            check_output_path(tensorboard_dir, name="tensorboard_dir", directory=True)
        self._board = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("tensorboard_dir needs the tensorboard package: pip install "
                                  "'fp8dist[tensorboard]' (or tensorboard).") from None
            self._board = SummaryWriter(str(tensorboard_dir), purge_step=purge_step)
        self._file = open(path, "a" if append else "w") if path is not None else None

    def write(self, record: StepRecord) -> None:
        """Append ``record`` to metrics.jsonl and TensorBoard (each where opened)."""
        row = record.as_dict()
        if self._file is not None:
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
        if self._board is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._board.add_scalar(f"train/{key}", value, record.step)

    def close(self) -> None:
        """Close the files; writing after it does nothing."""
        for out in (self._file, self._board):
            if out is not None:
                out.close()
        self._file = self._board = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def truncate_jsonl(path: str | os.PathLike, *, before_step: int) -> None:
    """Keep the lines of JSON-lines file ``path`` whose ``step`` is below ``before_step`` (a resumed run logs the later
    ones again); replaced atomically; a missing file stays missing."""
    from ..runtime.files import atomic_write_text

    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        return
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) < before_step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))
