"""Run the ``fp8dist`` command with a fault injected from outside the library (tests/test_checkpoint_crash.py):

    python tests/checkpoint_faults.py pause-before-rename STEP train ARGS...
        the save of step STEP stops after writing everything and before its rename, until the process is killed or
        interrupted (in the ranks ``fp8dist train`` spawns too: its fork server imports this module)
    torchrun ... tests/checkpoint_faults.py kill-rank RANK:STEP[@ATTEMPT] train ARGS...
        rank RANK SIGKILLs itself once STEP steps are done (and saved, if due)
    torchrun ... tests/checkpoint_faults.py kill-rank-mid-step RANK:STEP[@ATTEMPT] train ARGS...
        rank RANK SIGKILLs itself during step STEP: after its backward, before the optimizer step
    torchrun ... tests/checkpoint_faults.py kill-rank-mid-save RANK:STEP[@ATTEMPT] train ARGS...
        rank RANK SIGKILLs itself during step STEP's save: after writing its shards, before the checksums and rename

A kill happens on one torchrun attempt: ATTEMPT (TORCHELASTIC_RESTART_COUNT), by default the first; faults may be
given several times before ``train`` (``kill-rank-mid-save 1:4 kill-rank-mid-step 1:6@1 train ...``).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch.distributed as dist

import fp8dist.checkpoint.save_load as save_load
import fp8dist.runtime.env as launch_env
import fp8dist.train.data.job as job_data
import fp8dist.train.steps as train_steps
from fp8dist.cli import main

ENV = "CHECKPOINT_FAULTS"  # the faults, for the fork server of `fp8dist train`, which imports this module


def pause_before_rename(step: int) -> None:
    publish = save_load._publish

    def paused(tmp, root, name, keep_last):
        if name == f"step_{step:08d}":
            print(f"checkpoint_faults: pausing before renaming {tmp}", flush=True)
            time.sleep(3600)
        publish(tmp, root, name, keep_last)

    save_load._publish = paused


def _kill(rank: int, what: str) -> None:
    print(f"checkpoint_faults: rank {rank} kills itself {what}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_rank(rank: int, step: int) -> None:
    save = train_steps.save_step

    def save_then_kill(job, model, optimizer, done, *rest):  # rest: the data position and the log
        save(job, model, optimizer, done, *rest)
        if done != step:
            return
        dist.barrier()  # every rank has logged its steps before the kill
        if dist.get_rank() == rank:
            _kill(rank, f"after step {done}")

    train_steps.save_step = save_then_kill


def kill_rank_mid_step(rank: int, step: int) -> None:
    take, clip = job_data.JobBatches.take, train_steps.clip_grad_norm_
    current = {}

    def taking(self, index):  # the loop takes step `index`'s batch as the step starts
        current["step"] = index + 1
        return take(self, index)

    def clip_or_kill(model, max_norm):  # after the backward, before the optimizer step
        if current.get("step") == step and dist.get_rank() == rank:
            _kill(rank, f"during step {step}, after its backward")
        return clip(model, max_norm)

    job_data.JobBatches.take, train_steps.clip_grad_norm_ = taking, clip_or_kill


def kill_rank_mid_save(rank: int, step: int) -> None:
    write = save_load._write_rank

    def write_then_kill(tmp, model, optimizer, strategy, this_rank, trainable_only):
        write(tmp, model, optimizer, strategy, this_rank, trainable_only)
        if tmp.name == f".tmp-step_{step:08d}" and this_rank == rank:
            _kill(rank, f"while saving step {step}, its shards written")

    save_load._write_rank = write_then_kill


FAULTS = {"pause-before-rename": pause_before_rename, "kill-rank": kill_rank,
          "kill-rank-mid-step": kill_rank_mid_step, "kill-rank-mid-save": kill_rank_mid_save}


def apply(fault: str, value: str) -> None:
    if fault == "pause-before-rename":
        pause_before_rename(int(value))
        return
    where, _, attempt = value.partition("@")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == (attempt or "0"):
        victim, at = where.split(":")
        FAULTS[fault](int(victim), int(at))


def _faults(argv: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    faults = []
    while argv and argv[0] in FAULTS:
        faults.append((argv[0], argv[1]))
        argv = argv[2:]
    if not faults:
        sys.exit(f"checkpoint_faults: no fault in {argv[:2]}; one of {', '.join(FAULTS)} first")
    return faults, argv


def _into_spawned_ranks(faults: list[tuple[str, str]]) -> None:
    """`fp8dist train --nproc N` forks its ranks from a fork server that imports the modules it is told: this one,
    which applies ``faults`` as it is imported there."""
    os.environ[ENV] = " ".join(f"{fault} {value}" for fault, value in faults)
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    rank_imports = launch_env.rank_imports  # fp8dist train reads it from pipeline.env when it spawns
    launch_env.rank_imports = lambda *args: [*rank_imports(*args), "checkpoint_faults"]


if __name__ == "__main__":
    given, argv = _faults(sys.argv[1:])
    for fault, value in given:
        apply(fault, value)
    _into_spawned_ranks(given)
    sys.exit(main(argv))
elif os.environ.get(ENV):  # imported by the fork server of `fp8dist train`: its ranks inherit the faults
    words = os.environ[ENV].split()
    for fault, value in zip(words[::2], words[1::2]):
        apply(fault, value)
