"""Bad models, blocks, batches and launch environments: each a clear error naming the value and the way out."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8dist import wrap_model
from fp8dist.data import Batches
from fp8dist.env import LaunchError, detect_launch_env
from fp8dist.models import build_llama
from fp8dist.strategies import find_blocks


def test_not_a_module():
    with pytest.raises(TypeError, match="expects a torch.nn.Module, got dict"):
        wrap_model({"weight": torch.zeros(2)}, strategy="fsdp")


class _NoParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(4, 4)]  # a plain list: not registered, a classic mistake

    def forward(self, x):
        return self.layers[0](x)


def test_model_without_parameters():
    with pytest.raises(ValueError, match="_NoParams has no trainable parameters.*nn.ModuleList"):
        wrap_model(_NoParams(), strategy="fsdp")


def test_missing_block_class_lists_the_classes_present(one_rank_group):
    with pytest.raises(ValueError) as err:
        wrap_model(build_llama("tiny"), strategy="fsdp", block_classes=["GPT2Block"])
    text = str(err.value)
    assert "block_classes=['GPT2Block']" in text and "not found in LlamaForCausalLM" in text
    assert "'LlamaDecoderLayer'" in text and "'LlamaMLP'" in text  # the classes that hold parameters
    assert "leave block_classes empty" in text


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


def test_root_only_sharding_is_announced(one_rank_group):
    with pytest.warns(UserWarning, match="root only.*block_classes"):
        wrap_model(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)), strategy="fsdp")


def test_option_the_strategy_does_not_read_is_reported(one_rank_group):
    with pytest.warns(UserWarning, match=r"block_classes=\['LlamaDecoderLayer'\] has no effect here \(read only when "
                                         r"strategy in \['fsdp', 'fsdp1'\]; strategy='ddp'\)"):
        wrap_model(build_llama("tiny"), strategy="ddp", block_classes=["LlamaDecoderLayer"])


def test_ddp_low_precision_reduce_needs_nccl(one_rank_group):
    with pytest.raises(ValueError, match=r"reduce_dtype='bf16' with strategy='ddp' on cpu.*strategy='fsdp'"):
        wrap_model(build_llama("tiny"), strategy="ddp", reduce_dtype="bf16")


def test_wrapping_twice_is_an_error(one_rank_group):
    model = wrap_model(nn.Linear(16, 16), strategy="ddp")
    with pytest.raises(ValueError, match="already wrapped"):
        wrap_model(model, strategy="ddp")


def test_batch_that_does_not_split_over_the_world():
    with pytest.raises(ValueError, match=r"batch_size=5 does not split over world size 2.*e\.g\. 4 or 6"):
        Batches(batch_size=5, seq_len=8, rank=0, world_size=2)


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


def test_launch_env_errors_say_what_to_set(monkeypatch):
    with pytest.raises(LaunchError, match="no rendezvous address: set MASTER_ADDR and MASTER_PORT"):
        detect_launch_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(LaunchError, match="RANK='one' must be an integer"):
        detect_launch_env({"RANK": "one", "WORLD_SIZE": "2"})
    with pytest.raises(LaunchError, match="rank 2 is outside world size 2"):
        detect_launch_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
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

    from fp8dist.env import share_cpu_threads

    before = torch.get_num_threads()
    try:
        got = share_cpu_threads(environ)
        cores = len(os.sched_getaffinity(0))
        assert got == (max(1, cores // 2) if expected == "half" else None)
        assert torch.get_num_threads() == (got if got else before)
    finally:
        torch.set_num_threads(before)
