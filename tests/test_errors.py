"""Block detection, launch environments and CPU thread sharing (each bad input's error is a row of
tests/test_bad_inputs.py)."""

from __future__ import annotations

import pytest
from torch import nn

from fp8dist.runtime.env import LaunchError, detect_launch_env
from fp8dist.train.models import build_llama
from fp8dist.strategies import find_blocks


def test_block_detection_order():
    model = build_llama("tiny")
    blocks, how = find_blocks(model)
    assert [n for n, _ in blocks] == ["model.layers.1", "model.layers.0"] and "_no_split_modules" in how
    blocks, how = find_blocks(model, ("LlamaMLP",))
    assert sorted(n for n, _ in blocks) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    stack = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]))
    blocks, how = find_blocks(stack)
    assert len(blocks) == 3 and "largest nn.ModuleList '1'" in how
    assert find_blocks(nn.Linear(4, 4))[0] == []


def test_launch_env_from_torchrun_slurm_and_nothing(monkeypatch, tmp_path):
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    env = detect_launch_env(torchrun)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.master_port) == ("env", 3, 4, 1, 29500)
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "4242",
             "MASTER_ADDR": "head"}
    env = detect_launch_env(slurm)
    assert (env.launcher, env.rank, env.world_size, env.master_addr, env.master_port) == ("slurm", 1, 2, "head",
                                                                                           24242)
    assert detect_launch_env({}).launcher == "none" and detect_launch_env({}).world_size == 1


def test_slurm_without_scontrol_says_to_set_master_addr(monkeypatch):
    """(The other launch-environment errors are rows of tests/test_bad_inputs.py.)"""
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(LaunchError, match="scontrol.*not on PATH: set MASTER_ADDR"):
        detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]",
                           "SLURM_JOB_ID": "7"})


@pytest.mark.parametrize("environ,expected", [
    ({"LOCAL_WORLD_SIZE": "2"}, "half"),                         # torchrun / elastic spawn
    ({"LOCAL_SIZE": "2"}, "half"),                               # the deepspeed launcher
    ({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}, None),         # the user's setting wins
    ({}, None),                                                  # one process: keep torch's default
])
def test_cpu_ranks_share_the_cores_instead_of_oversubscribing(environ, expected):
    import os

    import torch

    from fp8dist.runtime.env import share_cpu_threads

    before = torch.get_num_threads()
    try:
        got = share_cpu_threads(environ)
        cores = len(os.sched_getaffinity(0))
        assert got == (max(1, cores // 2) if expected == "half" else None)
        assert torch.get_num_threads() == (got if got else before)
    finally:
        torch.set_num_threads(before)


def _user_initialized_group(rank: int, world: int, port: int) -> list[tuple]:
    """wrap_model inside a process group the user initialized: file:// (the harness's) with RANK / WORLD_SIZE set
    but no MASTER_ADDR, then tcp:// with no launcher variables at all."""
    import os

    import torch.distributed as dist

    from fp8dist import get_wrap_info, wrap_model

    seen = []
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    for style in ("file", "tcp"):
        if style == "tcp":
            dist.destroy_process_group()
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                os.environ.pop(name, None)
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        env = get_wrap_info(wrap_model(nn.Linear(16, 16), strategy="ddp")).env
        seen.append((style, env.rank, env.world_size, env.local_rank, env.launcher))
    return seen


def test_a_process_group_the_user_initialized_is_the_truth():
    from cli_helpers import free_port
    from dist_harness import run_ranks

    for rank, seen in enumerate(run_ranks(_user_initialized_group, free_port())):
        assert seen == [("file", rank, 2, rank, "initialized"), ("tcp", rank, 2, rank, "initialized")]
