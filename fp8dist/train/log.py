"""What ``fp8dist train`` shows and writes each step (the step line, the metrics file, TensorBoard, the FP8 health of
:class:`fp8dist.numerics.FP8Telemetry`) and the summary at the end of the run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from ..config.text import plural
from .metrics import MetricsWriter, StepRecord, TrainingFigures, truncate_jsonl

__all__ = ["JobLog", "health_file", "check_outputs", "format_summary"]


def check_outputs(train: Any) -> None:
    """Before the job starts: every path it will write can be written (the checkpoint directory on every rank, the
    rest on rank 0, which alone writes them), and ``--tensorboard``'s package imports. ValueError with the way out."""
    from ..runtime.files import check_output_path
    from ..runtime.env import current_launch

    if train.checkpoint_dir is not None:
        check_output_path(train.checkpoint_dir, name="checkpoint_dir", directory=True)
    if current_launch().rank == 0:
        for name, directory in (("save_pretrained", True), ("metrics_file", False), ("tensorboard", True),
                                ("fp8_health_file", False)):
            path = health_file(train) if name == "fp8_health_file" else getattr(train, name)
            if path is not None:
                check_output_path(path, name=name, directory=directory)
    if train.tensorboard is None:
        return
    try:  # imported, not looked up: an installed package that fails to import fails the same way later
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as err:
        raise ValueError(f"tensorboard={train.tensorboard!r} needs the tensorboard package, which cannot be imported "
                         f"here ({err}): pip install 'fp8dist[tensorboard]' (or leave --tensorboard out; "
                         "--metrics-file needs nothing).") from None


def health_file(train: Any) -> str | None:
    """Where the FP8 health records go: ``fp8_health_file``, else beside ``metrics_file`` (``run.fp8_health.jsonl``)."""
    if train.fp8_health_file is not None or train.metrics_file is None:
        return train.fp8_health_file
    return str(Path(train.metrics_file).with_suffix(".fp8_health.jsonl"))


class JobLog:
    """The job's figures and their files; create it on every rank (the FP8 health reduces over the world group).
    ``log``: rank 0's printer, None elsewhere (nothing written). ``first``: steps done before (the files keep them)."""

    def __init__(self, config: Any, train: Any, wrapped: Any, *, first: int, log: Callable[[str], Any] | None):
        self.log = log
        self.figures = TrainingFigures(wrapped, seq_len=train.seq_len)
        self.health, self.health_note = self._health(config, train, wrapped, first)
        self.writer = None
        if log is not None and (train.metrics_file is not None or train.tensorboard is not None):
            if train.metrics_file is not None:
                Path(train.metrics_file).parent.mkdir(parents=True, exist_ok=True)
                if first:
                    truncate_jsonl(train.metrics_file, before_step=first + 1)
            # a resumed run logs the steps after its checkpoint again: the file and TensorBoard drop the old ones
            self.writer = MetricsWriter(train.metrics_file, tensorboard_dir=train.tensorboard, append=first > 0,
                                        purge_step=first + 1 if first else None)

    def _health(self, config: Any, train: Any, wrapped: Any, first: int) -> tuple[Any, str]:
        from ..fp8 import BACKENDS, get_backend
        from ..pipeline.api import get_plan

        every = train.fp8_health_every
        fp8 = config.precision.fp8
        plan = get_plan(wrapped)
        if not every:
            return None, "fp8 health: off (--fp8-health-every 0)"
        if not get_backend(fp8).health_telemetry:
            sampled = " or ".join(name for name in BACKENDS if get_backend(name).health_telemetry)
            return None, (f"fp8 health: off (fp8={fp8 or 'none'}; --fp8-health-every samples the FP8 layers of "
                          f"fp8={sampled} only)")
        if plan.facts.engine_builds_optimizer:
            return None, (f"fp8 health: off (strategy {config.parallel.strategy}: its engine steps its own "
                          "partitions, and FP8Telemetry follows steps of the model's own parameters)")
        if not plan.fp8:
            return None, "fp8 health: off (the plan runs no layer in FP8)"
        from ..numerics import FP8Telemetry

        path = health_file(train)
        if self.log is not None and path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if first:
                truncate_jsonl(path, before_step=first)  # telemetry numbers steps from 0
            else:
                Path(path).write_text("")
        telemetry = FP8Telemetry(wrapped, every=every, jsonl=path, log=self.log, step=first)
        where = f", records in {path}" if path else ""
        return telemetry, (f"fp8 health: every {plural(every, 'step')}, per FP8 layer the amax, scale and share "
                           f"flushed to zero of input, weight and output gradient{where}")

    def header(self) -> str:
        """The figures' header line and the FP8 health note, printed before the first step."""
        return f"{self.figures.header()}\n{self.health_note}"

    def step(self, **figures: Any) -> StepRecord:
        """:meth:`TrainingFigures.step`'s record, written to the files (rank 0)."""
        record = self.figures.step(**figures)
        if self.writer is not None:
            self.writer.write(record)
        return record

    def close(self) -> None:
        """Close the metrics files and the health monitor (rank 0's); call once after the run."""
        for part in (self.writer, self.health):
            if part is not None:
                part.close()


def format_summary(result: Any, config: Any, train: Any) -> str:
    """The summary ``fp8dist train`` prints at the end of a run: the loss from first to last step (and the held-out
    loss), skipped steps, throughput, peak memory per rank and the gradient traffic."""
    tail = result.losses[-5:]
    resumed = f" (resumed at step {result.start_step})" if result.start_step else ""
    loss = (f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f} (mean of last {plural(len(tail), 'step')} "
            f"{sum(tail) / len(tail):.4f}){resumed}" if tail else f"no steps left to train{resumed}")
    lines = ["== fp8dist train: summary ==", f"loss            {loss}"]
    if result.eval_losses:
        step, val = result.eval_losses[-1]
        lines.append(f"validation      loss {val:.4f}, perplexity {math.exp(min(val, 700.0)):,.2f} (held-out, after "
                     f"step {step})")
    lines += [
        f"skipped steps   {result.skipped_steps} (non-finite gradients; weights and optimizer state kept)",
        *([f"gradient wire   {result.grad_wire}"] if result.grad_wire else []),
        f"throughput      {result.tokens_per_s:,.0f} tokens/s (global, steps {result.start_step + 2}-{train.steps})",
        "peak memory     " + ", ".join(f"rank {r}: {m:,.0f} MiB" for r, m in enumerate(result.peak_memory_mib))
        + (" (CUDA allocated)" if result.device == "cuda" else " (peak RSS)"),
        f"fp8 plan        fp8={config.precision.fp8 or 'none'}: {result.plan_counts}",
        f"blocks          {result.blocks}",
        f"parameters      strategy {config.parallel.strategy}",
    ]
    lines += [f"  rank {r}: {text}" for r, text in enumerate(result.sharding)]
    lines.append(f"wall time       {result.wall_s:.1f}s in the training processes")
    return "\n".join(lines)
