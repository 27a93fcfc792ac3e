"""Run the ``fp8dist`` command with a fault injected from outside the library (tests/test_checkpoint_crash.py):

    python tests/checkpoint_faults.py pause-before-rename STEP train ARGS...
        the save of step STEP stops after writing everything and before its rename, until the process is killed
    torchrun ... tests/checkpoint_faults.py kill-rank RANK:STEP train ARGS...
        on torchrun's first attempt, rank RANK SIGKILLs itself once STEP steps are done (and saved, if due)
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch.distributed as dist

import fp8dist.checkpoint.save_load as save_load
import fp8dist.train.job as train
from fp8dist.cli import main


def pause_before_rename(step: int) -> None:
    publish = save_load._publish

    def paused(tmp, root, name, keep_last):
        if name == f"step_{step:08d}":
            print(f"checkpoint_faults: pausing before renaming {tmp}", flush=True)
            time.sleep(3600)
        publish(tmp, root, name, keep_last)

    save_load._publish = paused


def kill_rank(rank: int, step: int) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return  # the restarted attempt trains on
    save = train._save

    def save_then_kill(job, model, optimizer, done, *rest):  # rest: the data position and the log
        save(job, model, optimizer, done, *rest)
        if done != step:
            return
        dist.barrier()  # every rank has logged its steps before the kill
        if dist.get_rank() == rank:
            print(f"checkpoint_faults: rank {rank} kills itself after step {done}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    train._save = save_then_kill


if __name__ == "__main__":
    fault, value, *argv = sys.argv[1:]
    if fault == "pause-before-rename":
        pause_before_rename(int(value))
    elif fault == "kill-rank":
        victim, at = value.split(":")
        kill_rank(int(victim), int(at))
    else:
        sys.exit(f"checkpoint_faults: unknown fault {fault!r}; pause-before-rename STEP or kill-rank RANK:STEP")
    sys.exit(main(argv))
