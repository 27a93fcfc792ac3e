"""What a resume restores besides weights and optimizer moments, and what it refuses to restore:

- the optimizer's ``param_groups`` (its learning rate, ``initial_lr``, betas): resumed across an LR schedule, the
  learning rate of each step and the losses equal the uninterrupted run's, under none, fsdp, fsdp1 and ddp;
- a checkpoint whose contents changed after the save (a flipped byte, same size) is refused before anything is
  loaded, naming the file and the way out, for every file a checkpoint holds and every engine's files (DCP shards
  on one and two ranks, RNG and FP8 state; DeepSpeed's own files: test_checkpoint_across.py).

fsdp, fsdp1 and ddp share one 2-rank spawn; "none" runs in the test's process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from helpers import BATCH, SEQ

from fp8dist import CheckpointError, load_checkpoint, save_checkpoint, wrap_model
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

N = 2  # steps before the checkpoint, and after it
LR = 1e-3


def _halving(step: int) -> float:
    """The schedule: the learning rate halves every step (2.5e-4 at the checkpoint, as the issue saw it)."""
    return 0.5 ** step


def _build(strategy: str):
    model = wrap_model(build_llama("tiny", seed=0), strategy=strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _halving)


def _train(model, opt, scheduler, steps: range, rank: int, world: int) -> tuple[list[float], list[float]]:
    """(losses, the learning rate each step ran at)."""
    batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)
    losses, lrs = [], []
    for step in steps:
        lrs.append(opt.param_groups[0]["lr"])
        loss = model(input_ids=batches[step], labels=batches[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
    return losses, lrs


def _resume_across_the_schedule(strategy: str, root: Path, rank: int, world: int) -> dict:
    """The straight run saves at step N (the scheduler's state in ``extra``, as a user keeps it); a fresh model
    and optimizer, built with the peak rate, load it and train on."""
    model, opt, scheduler = _build(strategy)
    losses, lrs = _train(model, opt, scheduler, range(N), rank, world)
    save_checkpoint(root / strategy, model, opt, step=N, extra={"scheduler": scheduler.state_dict()})
    more = _train(model, opt, scheduler, range(N, 2 * N), rank, world)
    model, opt, scheduler = _build(strategy)
    state = load_checkpoint(root / strategy, model, opt)
    scheduler.load_state_dict(state.extra["scheduler"])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    resumed = _train(model, opt, scheduler, range(N, 2 * N), rank, world)
    return {"straight": (losses + more[0], lrs + more[1]), "resumed": resumed, "groups": groups}


def _check(result: dict, strategy: str) -> None:
    losses, lrs = result["straight"]
    assert lrs == [LR * _halving(s) for s in range(2 * N)]
    assert result["groups"][0]["lr"] == lrs[N] == 2.5e-4 and result["groups"][0]["initial_lr"] == LR, (
        f"{strategy}: the optimizer's param_groups come back as saved: {result['groups']}")
    assert result["resumed"] == (losses[N:], lrs[N:]), f"{strategy}: the resumed run is the uninterrupted one"


def _flip_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _grid(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    out = {s: _resume_across_the_schedule(s, root, rank, world) for s in ("fsdp", "fsdp1", "ddp")}
    model, opt, _ = _build("fsdp")
    shard = root / "fsdp" / f"step_{N:08d}" / "__1_0.distcp"  # rank 1's shard; the ranks split the verifying
    if rank == 0:
        _flip_byte(shard)
    dist.barrier()
    try:
        load_checkpoint(root / "fsdp", model, opt)
    except CheckpointError as err:
        out["flipped"] = str(err)
    return out


@pytest.mark.slow
def test_resume_across_an_lr_schedule_restores_param_groups_fsdp_fsdp1_ddp_and_refuses_a_flipped_byte(tmp_path):
    results = run_ranks(_grid, str(tmp_path), timeout=600)
    for rank, result in enumerate(results):
        for strategy in ("fsdp", "fsdp1", "ddp"):
            _check(result[strategy], f"{strategy} rank {rank}")
        shard = tmp_path / "fsdp" / f"step_{N:08d}" / "__1_0.distcp"
        assert f"{shard} is damaged: its crc32 is " in result.get("flipped", ""), f"rank {rank}: {result}"


def test_resume_across_an_lr_schedule_restores_param_groups_none(tmp_path):
    torch.set_num_threads(1)
    _check(_resume_across_the_schedule("none", tmp_path, 0, 1), "none")


# ---- a byte changed inside any file of a checkpoint, one process

class _WithExtraState(torch.nn.Linear):
    """A layer with module extra state (as Transformer Engine's FP8 scales), so that the checkpoint holds
    fp8_state_rank0.pt too."""

    def get_extra_state(self):
        return torch.arange(4.0)

    def set_extra_state(self, state):
        pass


def _saved(tmp_path: Path):
    torch.set_num_threads(1)
    model = wrap_model(torch.nn.Sequential(_WithExtraState(16, 16), torch.nn.Linear(16, 16)), strategy="none")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return model, opt, save_checkpoint(tmp_path, model, opt, step=1)


FILES = [".metadata", "__0_0.distcp", "rng_rank0.pt", "fp8_state_rank0.pt"]


def test_every_file_of_a_checkpoint_is_recorded_with_its_checksum(tmp_path):
    _, _, path = _saved(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["checksum"] == "crc32" and sorted(meta["checksums"]) == sorted(meta["files"]) == sorted(FILES)


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_in_any_file_is_refused_naming_it_before_anything_loads(tmp_path, name):
    model, opt, path = _saved(tmp_path)
    _flip_byte(path / name)
    before = {p: p.read_bytes() for p in path.iterdir()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(tmp_path, model, opt)
    assert str(refused.value).startswith(f"{path / name} is damaged: its crc32 is ")
    assert str(refused.value).endswith(
        f"when it was saved (its size is unchanged). Load an older checkpoint: another step_* folder of {tmp_path} "
        f"(fp8dist train --resume: move {path.name} out of {tmp_path} first), or load_checkpoint(..., verify=False) "
        "to load it as it is.")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), changed)), "nothing was loaded"
    assert {p: p.read_bytes() for p in path.iterdir()} == before


def test_verify_false_loads_without_reading_the_checksums(tmp_path):
    model, opt, path = _saved(tmp_path)
    meta = json.loads((path / "meta.json").read_text())
    meta["checksums"]["__0_0.distcp"] = "00000000"  # the record wrong, the file intact
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="__0_0.distcp is damaged: its crc32 is [0-9a-f]{8}, 00000000 when it "
                                              "was saved"):
        load_checkpoint(tmp_path, model, opt)
    assert load_checkpoint(tmp_path, model, opt, verify=False).step == 1
    with pytest.raises(TypeError, match="verify='no' must be True or False"):
        load_checkpoint(tmp_path, model, opt, verify="no")
