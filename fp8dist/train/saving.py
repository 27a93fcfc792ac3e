"""The training job's files: resuming from a checkpoint (:func:`resume_job`), saving one after a step when due
(:func:`save_step`, :func:`save_due`) and exporting the trained model as Hugging Face safetensors
(:func:`export_model`)."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from ..checkpoint.fp8_export import fp8_summary
from ..checkpoint.hf import export_dtype, is_fp8, save_pretrained
from ..checkpoint.save_load import load_checkpoint, save_checkpoint
from ..config.text import plural
from .config import TrainConfig
from .data import load_tokenizer
from .data.job import JobBatches
from .lora import export_lora

__all__ = ["resume_job", "save_due", "save_step", "export_model", "APPLIED_KEY"]


def _as_saved(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value  # JSON keeps a tuple as a list


def resume_job(train: TrainConfig, resume_from: Path | None, model: Any, optimizer: Any, batches: JobBatches,
               log: Callable[[str], Any] | None) -> tuple[int, int]:
    """(The step to start at, the optimizer steps applied before it): 0, 0, or with ``resume`` those of
    ``resume_from``, loaded into the model and its data position into ``batches``."""
    log = log or (lambda line: None)
    if not train.resume:
        return 0, 0
    if resume_from is None:
        log(f"resume: no checkpoint in {train.checkpoint_dir} yet, starting at step 0")
        return 0, 0
    t0 = time.perf_counter()
    state = load_checkpoint(resume_from, model, optimizer)
    log(f"resume: loaded {state.path} (step {state.step}, saved on {plural(state.world_size, 'rank')}) in "
        f"{time.perf_counter() - t0:.2f}s")
    if batches.text is not None:
        if "data" not in state.extra:
            raise ValueError(f"{state.path} holds no position in --data (its run trained on the built-in corpus), so "
                             "the text cannot continue where a run stopped. Resume without --data, or start a new "
                             "--checkpoint-dir (with --pretrained for weights saved by --save-pretrained).")
        batches.text.load_state_dict(state.extra["data"])
    saved = state.extra.get("train", {})
    changed = [f"{k} {saved[k]} -> {_as_saved(getattr(train, k))}"
               for k in ("seed", "batch_size", "seq_len", "lr", "steps", "data")
               if k in saved and saved[k] != _as_saved(getattr(train, k))]
    if changed:
        log(f"resume: note, the job changed since the checkpoint: {', '.join(changed)}")
    return state.step, state.extra.get(APPLIED_KEY, state.step)  # saved before the key: no step was skipped


APPLIED_KEY = "optimizer_steps"
"""The checkpoint extra holding the optimizer steps the guard did not skip: the lr schedule's position."""


def save_due(train: TrainConfig, done: int) -> bool:
    """Whether the job saves a checkpoint after ``done`` steps: with a ``checkpoint_dir``, every ``save_every`` steps
    and after the last."""
    return train.checkpoint_dir is not None and (done == train.steps or (train.save_every is not None
                                                                         and done % train.save_every == 0))


def save_step(train: TrainConfig, model: Any, optimizer: Any, done: int, applied: int, batches: JobBatches,
              log: Callable[[str], Any] | None) -> None:
    """Save a checkpoint after ``done`` steps when :func:`save_due`, with the data position."""
    if not save_due(train, done):
        return
    t0 = time.perf_counter()
    job = {k: _as_saved(v) for k, v in asdict(train).items() if k not in ("nproc", "resume")}
    position = batches.state_dict()
    extra = {"train": job, APPLIED_KEY: applied, **({"data": position} if position is not None else {})}
    # a resumed job replaces a step it saves again (one published after the checkpoint it resumed from)
    path = save_checkpoint(train.checkpoint_dir, model, optimizer, step=done, extra=extra,
                           keep_last=train.keep_last or None, overwrite=train.resume,
                           trainable_only=bool(train.lora_rank))  # LoRA: the adapters, not the frozen base
    if log is not None:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        log(f"checkpoint: saved {path} ({size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.2f}s")


def export_model(train: TrainConfig, model: Any, batches: JobBatches, log: Callable[[str], Any] | None,
                 pretrained: str | None) -> None:
    """``save_pretrained``: the model as Hugging Face safetensors in ``save_dtype`` (every rank gathers, rank 0
    writes), with the text's tokenizer beside it."""
    if train.save_pretrained is None:
        return
    t0 = time.perf_counter()
    dtype = export_dtype(train.save_dtype, pretrained)
    if train.lora_rank:
        path, what = export_lora(train, model, pretrained, dtype)
    elif is_fp8(dtype):
        path = save_pretrained(model, train.save_pretrained, dtype=dtype, fp8_format=train.save_fp8_format)
        what = fp8_summary(path)
    else:
        path, what = save_pretrained(model, train.save_pretrained, dtype=dtype), dtype
    if log is None:
        return
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    tokenizer = ""
    if batches.corpus is not None:
        load_tokenizer(batches.corpus.tokenizer_dir).save_pretrained(str(path))
        tokenizer = f" with the tokenizer of {batches.corpus.tokenizer_dir}"
    log(f"save_pretrained: wrote {path} ({size / 2**20:.1f} MiB, {what}){tokenizer} in "
        f"{time.perf_counter() - t0:.2f}s")
