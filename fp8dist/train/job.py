"""The reference training job behind ``fp8dist train``: a small Llama on the built-in corpus, or any causal LM
(``--model-config``, ``--pretrained``) on text files (``--data``). ``fp8dist train`` spawns its processes (one per
GPU, or 2 on CPU); under torchrun it runs in the launched ones:

    torchrun --nproc-per-node 2 -m fp8dist.cli train                 # one node
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 -m fp8dist.cli train

This module sets the job up (model, data, wrap_model, memory check, the checkpoint directory's lock) and reports it;
the steps run in :mod:`fp8dist.train.steps`, checkpoints and the export in :mod:`fp8dist.train.saving`.
"""

from __future__ import annotations

import os
import socket
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..accounting.sharding import sharding_summary
from ..checkpoint.io import CheckpointError, all_ranks_values, from_rank0
from ..checkpoint.lock import CheckpointDirLock, CheckpointDirLocked, lock_checkpoint_dir
from ..config.resolve import Config
from ..config.rules import facts_of
from ..runtime.agree import on_all_ranks
from ..pipeline.api import get_plan, get_wrap_info, wrap_model
from ..pipeline.blocks import describe_blocks
from ..runtime.env import (aten_cpu_fp8_gemms, current_launch, init_distributed, local_world_size, peak_memory_mib,
                            runs_on_cpu)
from ..plan.selection import with_read_options
from .checks import MemoryNeed, check_checkpoint_dir, check_memory, check_positions, job_memory_need
from .config import TrainConfig
from .data import check_batch_split
from .data.job import JobBatches, load_job_corpus, load_on_each_node
from .log import JobLog, check_outputs, format_summary
from .lora import lora_job_model
from .models import build_job_model, job_model_config
from .saving import export_model, resume_job, save_due
from .schedule import describe_schedule
from .steps import grad_wire_line, train_steps

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
    first, applied = resume_job(train, resume_from, wrapped, optimizer, batches, say)
    job_log = JobLog(config, train, wrapped, first=first, log=say)
    if say:
        say(job_log.header())
    try:
        losses, step_times, evals = train_steps(asked, train, wrapped, optimizer, batches, (first, applied), job_log,
                                                say, progress)
    finally:
        job_log.close()
    export_model(train, wrapped, batches, say, pretrained)
    timed = step_times[1:] or step_times
    tokens_per_s = train.batch_size * train.seq_len * len(timed) / sum(timed) if timed else 0.0
    gathered = all_ranks_values([peak_memory_mib(env.device), str(sharding_summary(wrapped))])
    result = TrainResult(losses=losses, tokens_per_s=tokens_per_s, peak_memory_mib=[g[0] for g in gathered],
                         sharding=[g[1] for g in gathered], plan_counts=get_plan(wrapped).counts(),
                         device=env.device.type, wall_s=time.perf_counter() - start, start_step=first,
                         blocks=describe_blocks(info.blocks), skipped_steps=info.skipped_steps, eval_losses=evals,
                         grad_wire=grad_wire_line(wrapped, len(losses)))
    if say:
        say(format_summary(result, config, train))
    return result
