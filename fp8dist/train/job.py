"""The reference training job behind ``fp8dist train``: a small Llama on the built-in corpus, or any causal LM
(``--model-config``, ``--pretrained``) on text files (``--data``). ``fp8dist train`` spawns its processes (one per
GPU, or 2 on CPU); under torchrun it runs in the launched ones:

    torchrun --nproc-per-node 2 -m fp8dist.cli train                 # one node
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 -m fp8dist.cli train
"""

from __future__ import annotations

import math
import os
import socket
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..accounting import report
from ..accounting.sharding import sharding_summary
from ..checkpoint.fp8_export import fp8_summary
from ..checkpoint.hf import export_dtype, is_fp8, save_pretrained
from ..checkpoint.io import CheckpointError, all_ranks_values, from_rank0
from ..checkpoint.lock import CheckpointDirLock, CheckpointDirLocked, lock_checkpoint_dir
from ..checkpoint.save_load import load_checkpoint, save_checkpoint
from ..config.resolve import Config
from ..config.rules import facts_of
from ..config.text import plural
from ..runtime.agree import on_all_ranks
from ..pipeline.api import get_plan, get_wrap_info, wrap_model
from ..pipeline.blocks import describe_blocks
from ..runtime.env import (aten_cpu_fp8_gemms, current_launch, init_distributed, local_world_size, peak_memory_mib,
                            runs_on_cpu)
from ..pipeline.grads import clip_grad_norm_
from ..plan.selection import with_read_options
from ..strategies import get_strategy
from ..strategies.grad_fp8 import describe_tally, fp8_wire_words, model_grad_wire
from .checks import LossWatch, MemoryNeed, check_checkpoint_dir, check_memory, check_positions, job_memory_need
from .config import TrainConfig
from .data import check_batch_split, load_tokenizer
from .data.job import JobBatches, eval_steps, lm_loss, load_job_corpus, load_on_each_node
from .log import JobLog, check_outputs, format_summary
from .lora import export_lora, lora_job_model
from .models import build_job_model, job_model_config
from .schedule import describe_schedule, lr_schedule, set_lr

__all__ = ["TrainConfig", "TrainResult", "run_training", "default_nproc", "default_fp8", "save_due"]


def default_fp8() -> str | None:
    """The training job's FP8 backend without ``--fp8``: the commands' default (torchao) where it runs for real on
    this machine (a CPU with torch's _scaled_mm, CUDA sm_89+), else none. The library itself defaults to none."""
    from ..fp8 import BACKENDS, get_backend

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    for backend in map(get_backend, BACKENDS):
        if backend.commands_default and backend.unavailable_reason(None, device) is None:
            return backend.name
    return None


def default_nproc() -> int:
    """One process per GPU, or 2 CPU processes."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


@dataclass
class TrainResult:
    """What a finished run measured (every rank gets the same values)."""

    losses: list[float]  # mean over ranks, per step of this run
    tokens_per_s: float  # global, over the steps after the first (which includes warm-up)
    peak_memory_mib: list[float]  # per rank: peak CUDA memory allocated, or peak RSS on CPU
    sharding: list[str] = field(default_factory=list)  # per rank: fp8dist.sharding_summary
    plan_counts: str = ""  # FP8 and fallback layers and parameters: fp8dist.get_plan
    device: str = "cpu"
    start_step: int = 0  # steps already done when this run started (from a checkpoint)
    wall_s: float = 0.0
    blocks: str = ""  # activation checkpointing, compile and its graph breaks (rank 0)
    skipped_steps: int = 0  # optimizer steps the non-finite guard skipped, this run's and before
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss), text data only
    grad_wire: str = ""  # reduce_dtype='fp8': rank 0's gradient bytes per step, counted at the collectives


def _bar(done: int, total: int) -> str:
    filled = int(20 * done / total)
    return "[" + "#" * filled + "." * (20 - filled) + f"] {100 * done / total:3.0f}%"


def _as_saved(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value  # JSON keeps a tuple as a list


def _resume(train: TrainConfig, resume_from: Path | None, model: Any, optimizer: Any, batches: JobBatches,
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


APPLIED_KEY = "optimizer_steps"  # checkpoint extra: the steps the guard did not skip, the lr schedule's position


def save_due(train: TrainConfig, done: int) -> bool:
    """Whether the job saves a checkpoint after ``done`` steps: with a ``checkpoint_dir``, every ``save_every`` steps
    and after the last."""
    return train.checkpoint_dir is not None and (done == train.steps or (train.save_every is not None
                                                                         and done % train.save_every == 0))


def _save(train: TrainConfig, model: Any, optimizer: Any, done: int, applied: int, batches: JobBatches,
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


def _export(train: TrainConfig, model: Any, batches: JobBatches, log: Callable[[str], Any] | None,
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


NORM_ONLY = float(torch.finfo(torch.float32).max)  # clip_grad_norm_ scales by exactly 1.0: clipping off, norm shown


def _backward_and_step(wrapped: Any, optimizer: Any, micro: list[torch.Tensor], *, engine: bool, clip: float,
                       windows: bool, show_report: Callable[[str], Any] | None) -> tuple[torch.Tensor, Any]:
    """One optimizer step over the micro-batches (reduced at the last, clipped to ``clip``, 0: not; ``engine``: the
    engine clips itself), through the strategy's step (:meth:`~fp8dist.strategies.base.Strategy.backward`,
    ``optimizer_step``, ``global_grad_norm``); (mean loss, grad norm before clipping). ``show_report`` gets the
    report while gradients and optimizer states are both held (the strategy's ``while_held``)."""
    strategy = get_strategy(get_wrap_info(wrapped).sharding.strategy)
    total = torch.zeros((), device=micro[0].device)
    for i, ids in enumerate(micro):
        last = i == len(micro) - 1
        with strategy.accumulating(wrapped, last=last):
            loss = lm_loss(wrapped, ids, windows=windows)
            strategy.backward(wrapped, loss, micro_batches=len(micro), last=last)
        total += loss.detach().float()
    norm = None if engine else clip_grad_norm_(wrapped, clip if clip > 0 else NORM_ONLY)
    held = None if show_report is None else lambda: show_report(str(report(wrapped, optimizer)))
    strategy.optimizer_step(wrapped, optimizer, while_held=held)
    return total / len(micro), strategy.global_grad_norm(wrapped) if norm is None else norm


def _wrap(config: Config, train: TrainConfig, model: Any, world: int) -> tuple[Config, Any, Any]:
    """wrap_model with the job's optimizer; DeepSpeed accumulates and clips itself, the loop does for the others."""
    accum = config.parallel.grad_accum
    check_batch_split(train.batch_size, world, accum)
    # the job's batch, where an axis reads it: DeepSpeed's micro-batch, the FP8 speed prediction's tokens
    config = with_read_options(config, micro_batch_size=train.batch_size // (world * accum), seq_len=train.seq_len)
    if not facts_of(config, world).engine_builds_optimizer:  # the loop below accumulates and clips: not wrap_model
        config = replace(config, parallel=replace(config.parallel, grad_accum=1,
                                                  gradient_clipping=type(config.parallel)().gradient_clipping))
    # the optimizer spec goes through wrap_model: engines that own the optimizer (MS-AMP) build it themselves
    wrapped, optimizer = wrap_model(model, config=config, optimizer={"type": "AdamW", "lr": train.lr,
                                                                     "betas": (0.9, 0.95), "weight_decay": 0.0})
    return config, wrapped, optimizer


def _header(config: Config, train: TrainConfig, wrapped: Any, name: str, n_params: int, need: MemoryNeed) -> str:
    info = get_wrap_info(wrapped)
    env, group = info.env, info.env.backend or "no process group"
    return (f"fp8dist train: {name} ({n_params / 1e6:.2f}M params), strategy {config.parallel.strategy}, fp8 "
            f"{config.precision.fp8 or 'none'}, {env.world_size} x {env.device.type} ({group}), global batch "
            f"{train.batch_size} x {train.seq_len} tokens; layout: {info.sharding.blocks_found_by}\n"
            f"lr {train.lr:g}: {describe_schedule('cosine', train.steps)}; memory: {need.describe()}")


def _load_corpus(config: Config, train: TrainConfig) -> Any:
    """The job's text corpus (None: built-in), tokenized by local rank 0 while the node's others wait for its cache."""
    if not train.data:
        return None
    local = 0
    if current_launch().world_size > 1:
        local = init_distributed(device=config.parallel.device).local_rank
    with warnings.catch_warnings():
        if current_launch().rank != 0:  # rank 0 says the data's notes (an option with no effect) for every rank
            warnings.simplefilter("ignore")
        return load_on_each_node(lambda: load_job_corpus(train, config.parallel.pretrained), local)


def run_training(config: Config, train: TrainConfig, *, log: Callable[[str], Any] | None = None,
                 progress: Callable[[int], Any] | None = None) -> TrainResult:
    """Train the job's model with ``config``'s strategy; call it in every process of the job. ``log`` receives rank
    0's progress lines (default: print); ``progress`` the steps done, at the start and after each step and its
    checkpoint when due (a step whose save fails or is interrupted: before the error passes on). With a
    ``checkpoint_dir``, global rank 0 holds its lock (:mod:`fp8dist.checkpoint.lock`) from before the first step
    until the job ends.

    Raises:
        TrainingDiverged: the loss was not finite for MAX_NONFINITE_STEPS consecutive steps.
        MemoryError: the estimate of what a rank needs exceeds its memory (before the first step).
        ValueError: bad data, a tokenizer the model cannot read, a checkpoint of another data stream.
        CheckpointDirLocked: another job holds ``checkpoint_dir``'s lock (this job holds it until it ends).
    """
    log = log or (lambda line: print(line, flush=True))
    start = time.perf_counter()
    save_to, _ = check_checkpoint_dir(train)  # a step folder named: resumed from, saved beside
    lock = _lock(config, save_to, log)
    try:
        _, resume_from = check_checkpoint_dir(train)  # read under the lock: no other job moves `latest` now
        return _run_training(config, replace(train, checkpoint_dir=None if save_to is None else str(save_to)),
                             resume_from, log, progress, start)
    finally:
        if lock is not None:
            lock.release()


def _lock(config: Config, save_to: Path | None, log: Callable[[str], Any]) -> CheckpointDirLock | None:
    """The checkpoint directory's lock, held by global rank 0 for the job (it publishes every checkpoint); every
    rank raises CheckpointDirLocked when another job holds it."""
    if save_to is None:
        return None
    if current_launch().world_size > 1:  # every rank learns rank 0's answer
        init_distributed(device=config.parallel.device)

    def take() -> CheckpointDirLock | str:
        try:
            return lock_checkpoint_dir(save_to)
        except CheckpointDirLocked as err:  # said by every rank as it is
            return str(err)

    held = on_all_ranks(f"locking {save_to}", take if current_launch().rank == 0 else None, error=CheckpointError)
    refusal = from_rank0(held if isinstance(held, str) else None)
    if refusal is not None:
        raise CheckpointDirLocked(refusal)
    if held is not None and held.note():
        log(held.note())
    return held


def _run_training(config: Config, train: TrainConfig, resume_from: Path | None, log: Callable[[str], Any],
                  progress: Callable[[int], Any] | None, start: float) -> TrainResult:
    """:func:`run_training` past its checkpoint directory's lock: ``train.checkpoint_dir`` the one it saves into."""
    check_outputs(train)
    kernels = aten_cpu_fp8_gemms() if config.precision.fp8 and runs_on_cpu(config.parallel.device) else None
    corpus = _load_corpus(config, train)
    model_config, name = job_model_config(config, train, corpus)
    check_positions(model_config, name, config, train, current_launch().world_size)
    model = build_job_model(config, train, model_config)
    pretrained = config.parallel.pretrained
    if train.lora_rank:  # the base loaded whole, then the adapters: wrap_model gets the PEFT model
        config, model = lora_job_model(config, train, model)
    n_params = sum(p.numel() for p in model.parameters())
    world = current_launch().world_size
    asked = config  # grad_accum and gradient_clipping as asked: the loop does them (wrap_model, for DeepSpeed)
    config, wrapped, optimizer = _wrap(config, train, model, world)
    info = get_wrap_info(wrapped)
    env = info.env
    if env.world_size > 1:  # one line per rank: which node and host each rank landed on
        launch = current_launch()
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        print(f"fp8dist train: rank {env.rank}/{env.world_size} local rank {env.local_rank} node {launch.node_rank} "
              f"host {host} device {env.device} ready", flush=True)
    need = job_memory_need(asked, train, model_config, env.world_size)
    ranks_here = local_world_size(os.environ, env.world_size)  # one node unless the launcher says
    on_all_ranks("checking the job's memory", lambda: check_memory(need, env.device, ranks_here), error=MemoryError,
                 passthrough=(MemoryError,))
    batches = JobBatches(corpus, batch_size=train.batch_size, seq_len=train.seq_len, seed=train.seed, rank=env.rank,
                         world_size=env.world_size, eval_batches=train.eval_batches)
    say = log if env.rank == 0 else None  # rank 0 logs
    if say:
        say("\n".join(filter(None, [_header(config, train, wrapped, name, n_params, need), kernels,
                                     batches.describe()])))
        if config.precision.fp8:
            say(str(info.plan))
    first, applied = _resume(train, resume_from, wrapped, optimizer, batches, say)
    job_log = JobLog(config, train, wrapped, first=first, log=say)
    if say:
        say(job_log.header())
    try:
        losses, step_times, evals = _train_steps(asked, train, wrapped, optimizer, batches, (first, applied), job_log,
                                                 say, progress)
    finally:
        job_log.close()
    _export(train, wrapped, batches, say, pretrained)
    timed = step_times[1:] or step_times
    tokens_per_s = train.batch_size * train.seq_len * len(timed) / sum(timed) if timed else 0.0
    gathered = all_ranks_values([peak_memory_mib(env.device), str(sharding_summary(wrapped))])
    result = TrainResult(losses=losses, tokens_per_s=tokens_per_s, peak_memory_mib=[g[0] for g in gathered],
                         sharding=[g[1] for g in gathered], plan_counts=get_plan(wrapped).counts(),
                         device=env.device.type, wall_s=time.perf_counter() - start, start_step=first,
                         blocks=describe_blocks(info.blocks), skipped_steps=info.skipped_steps, eval_losses=evals,
                         grad_wire=_wire_line(wrapped, len(losses)))
    if say:
        say(format_summary(result, config, train))
    return result


def _wire_line(wrapped: Any, steps: int) -> str:
    wire = model_grad_wire(wrapped)
    return describe_tally(wire.total.per_step(steps), fp8_wire_words(wire)) if wire is not None and steps else ""


def _train_steps(config: Config, train: TrainConfig, wrapped: Any, optimizer: Any, batches: JobBatches,
                 start: tuple[int, int], job_log: JobLog, log: Callable[[str], Any] | None,
                 progress: Callable[[int], Any] | None) -> tuple[list, list, list]:
    """Steps ``start[0]`` .. ``train.steps``: each one's loss (mean over ranks) and time, and each evaluation's
    held-out loss. The lr follows the optimizer steps applied (``start[1]`` before): a step the guard skipped leaves
    the schedule where it was, as DeepSpeed's engine does. ``config`` as asked (grad_accum, gradient_clipping)."""
    (first, applied), info = start, get_wrap_info(wrapped)
    env = info.env
    lr_factor, engine = lr_schedule("cosine", train.steps), info.plan.facts.engine_builds_optimizer
    accum, clip = config.parallel.grad_accum, config.parallel.gradient_clipping
    watch = LossWatch(train.lr, resumable=train.checkpoint_dir is not None)
    evaluate_after = set(eval_steps(train.steps, train.eval_every)) if batches.windows else set()
    wire = model_grad_wire(wrapped)  # reduce_dtype='fp8': the bytes counted at the collectives
    losses, step_times, evals = [], [], []  # each step's loss and seconds; (step, held-out loss) of each evaluation
    if progress is not None:
        progress(first)
    for step in range(first, train.steps):
        t0 = time.perf_counter()
        micro = list(batches.take(step).to(env.device).chunk(accum))
        lr = train.lr * lr_factor(applied)
        set_lr(optimizer, lr)
        skipped, sent = info.skipped_steps, wire.total if wire is not None else None
        # the precision/memory report once, after the first step (DeepSpeed: the second step's backward)
        show = log if step == min(first + (1 if engine else 0), train.steps - 1) else None
        mean_loss, norm = _backward_and_step(wrapped, optimizer, micro, engine=engine, clip=clip,
                                             windows=batches.windows, show_report=show)
        applied += info.skipped_steps == skipped  # the guard counts a skip inside the optimizer's (engine's) step
        if env.world_size > 1:
            dist.all_reduce(mean_loss)
            mean_loss /= env.world_size
        losses.append(mean_loss.item())
        step_times.append(time.perf_counter() - t0)
        extra = {}
        if step + 1 in evaluate_after:
            val = batches.evaluate(wrapped, env.device)
            evals.append((step + 1, val))
            extra = {"val_loss": val, "val_perplexity": math.exp(min(val, 700.0))}
        if wire is not None:
            tally = wire.total - sent
            extra.update(grad_wire_bytes=tally.sent, grad_wire_ratio=tally.ratio)
        record = job_log.step(step=step + 1, loss=losses[-1], tokens=train.batch_size * train.seq_len,
                              step_time_s=step_times[-1], grad_norm=norm, lr=lr, skipped_steps=info.skipped_steps,
                              extra=extra)
        if log is not None:
            eta = sum(step_times) / len(step_times) * (train.steps - step - 1)
            log(f"step {step + 1:>4}/{train.steps} {_bar(step + 1, train.steps)} | {record.figures()} | "
                f"eta {eta:.1f}s")
        watch.update(step, losses[-1])  # the same loss on every rank: every rank stops at the same step
        try:
            _save(train, wrapped, optimizer, step + 1, applied, batches, log)
        except BaseException:  # Ctrl-C, a rank gone: the step is done, only its checkpoint was cut short
            if progress is not None:
                progress(step + 1)
            raise
        if progress is not None:
            progress(step + 1)
    return losses, step_times, evals
