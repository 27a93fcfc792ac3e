"""Crashes at the worst moments: a failing file write, a save that fails, is killed or is interrupted (Ctrl-C)
before its rename, a rank killed mid-run under torchrun (full training, and LoRA mid-step and mid-save). The faults are injected from the tests (tests/checkpoint_faults.py wraps the
library's functions); the library ships no test hooks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import ROOT, run, train_on_gloo_ranks
from dist_harness import run_ranks

import fp8dist.runtime.files as files
from fp8dist import CheckpointError, load_checkpoint, save_checkpoint, wrap_model
from fp8dist.checkpoint import latest_checkpoint
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

FAULTS = str(Path(__file__).parent / "checkpoint_faults.py")


# ---- the one atomic writer (results, configs, meta.json, latest)

def test_atomic_write_syncs_the_file_renames_then_syncs_the_directory(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", str(src), str(dst))),
                                                         replace(src, dst)))
    target = tmp_path / "result.json"
    files.atomic_write_text(target, "new\n")
    assert target.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["result.json"]
    tmp = events[1][1]
    assert Path(tmp).parent == tmp_path and Path(tmp).name.startswith(".result.json.")
    assert events == [("fsync", tmp), ("replace", tmp, str(target)), ("fsync", str(tmp_path))]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask, "an ordinary file, not mkstemp's private one"


@pytest.mark.parametrize("fails", ["write", "fsync", "rename"])
def test_a_failing_atomic_write_leaves_the_old_file_and_nothing_else(tmp_path, monkeypatch, fails):
    target = tmp_path / "latest"
    target.write_text("step_00000002\n")

    def write(tmp):
        Path(tmp).write_text("step_000")  # half of the new content, then the failure
        if fails == "write":
            raise OSError("disk full")

    def broken(*args):
        raise OSError(f"{fails} failed")

    if fails != "write":
        monkeypatch.setattr(os, "fsync" if fails == "fsync" else "replace", broken)
    with pytest.raises(OSError, match="disk full" if fails == "write" else f"{fails} failed"):
        files.atomic_write(target, write)
    assert [p.name for p in tmp_path.iterdir()] == ["latest"] and target.read_text() == "step_00000002\n"


# ---- save_checkpoint failing or killed before its rename

def _none_model():
    torch.set_num_threads(1)
    model = wrap_model(build_llama("tiny", seed=0), strategy="none")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_one(model, optimizer, step: int) -> None:
    ids = Batches(batch_size=4, seq_len=64, rank=0, world_size=1, seed=0)[step]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_save_that_fails_before_its_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import fp8dist.checkpoint.save_load as ckpt

    model, opt = _none_model()
    _train_one(model, opt, 0)
    save_checkpoint(tmp_path, model, opt, step=1)
    before = _snapshot(tmp_path)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "_publish", crash)
    _train_one(model, opt, 1)
    with pytest.raises(CheckpointError, match="saving .*step_00000002 failed: OSError: disk full"):
        save_checkpoint(tmp_path, model, opt, step=2)
    assert _snapshot(tmp_path) == before and not list(tmp_path.glob(".tmp-*")), "nothing half-written is left"
    assert load_checkpoint(tmp_path, *_none_model()).step == 1


# ---- `fp8dist train --checkpoint-dir D --save-every N --resume` as a user runs it, killed at the worst moments

def _step_losses(stdout: str) -> list[tuple[int, str]]:
    return [(int(s), loss) for s, loss in re.findall(r"^step +(\d+)/\d+ .* loss (\d+\.\d+) \|", stdout, flags=re.M)]


def _train_args(ckpt: Path, *args: str) -> list[str]:
    return ["train", "--fp8", "none", "--seq-len", "32", "--batch-size", "4", "--save-every", "2",
            "--checkpoint-dir", str(ckpt), "--resume", *args]


@pytest.mark.slow
def test_train_killed_in_the_middle_of_a_save_resumes_from_the_previous_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    args = _train_args(ckpt, "--strategy", "none", "--nproc", "1", "--steps", "6")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, FAULTS, "pause-before-rename", "4", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    paused = ckpt / ".tmp-step_00000004" / "meta.json"  # written last, just before the rename
    printed = []
    for line in proc.stdout:  # the event: the save says it pauses (an exit ends the loop too)
        printed.append(line)
        if line.startswith("checkpoint_faults: pausing before renaming"):
            break
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    first = "".join(printed) + proc.communicate()[0]
    assert paused.exists() and "checkpoint_faults: pausing before renaming" in first, first[-3000:]
    assert latest_checkpoint(ckpt) == ckpt / "step_00000002", "the previous checkpoint is still the latest"
    assert [s for s, _ in _step_losses(first)] == [1, 2, 3, 4]
    # the resumed command in this process (one rank trains in the calling process, as `fp8dist train` runs it)
    from fp8dist.cli import main

    capsys.readouterr()
    assert main(args) == 0
    resumed = capsys.readouterr().out
    assert f"resume: loaded {ckpt / 'step_00000002'} (step 2, saved on 1 rank)" in resumed
    again = _step_losses(resumed)
    assert [s for s, _ in again] == [3, 4, 5, 6] and again[:2] == _step_losses(first)[2:], "same losses again"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002", "step_00000004", "step_00000006"]


@pytest.mark.slow
def test_torchrun_restarts_a_killed_rank_and_training_continues_from_the_last_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    # rank 1 is SIGKILLed once 5 steps are done (a checkpoint at step 3), on the first attempt only: the restart
    # redoes steps 4 and 5, whose losses the first attempt printed before the kill. Step 5's loss follows the
    # restart's first optimizer step, so it also proves the optimizer state came back exactly.
    proc = run(["torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", FAULTS, "kill-rank", "1:5",
                *_train_args(ckpt, "--strategy", "fsdp", "--steps", "6", "--save-every", "3")], timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "checkpoint_faults: rank 1 kills itself after step 5" in out
    assert "starting 2 processes" not in out, "fp8dist train runs in torchrun's processes, no second launch"
    assert f"resume: loaded {ckpt / 'step_00000003'} (step 3" in out
    before, after = out.split("resume: loaded", 1)
    first, second = dict(_step_losses(before)), dict(_step_losses(after))
    assert sorted(first) == [1, 2, 3, 4, 5] and sorted(second) == [4, 5, 6]
    assert "(resumed at step 3)" in out and latest_checkpoint(ckpt) == ckpt / "step_00000006"
    assert second[4] == first[4] and second[5] == first[5], "after the restart: the uninterrupted curve"


@pytest.mark.slow
def test_ctrl_c_during_a_save_removes_it_and_names_the_last_step_done(tmp_path):
    """`fp8dist train` with 2 spawned ranks, Ctrl-C (SIGINT to the process group, as a terminal sends it) while
    rank 0 is about to rename step 4's save into place: the partial save is removed, the job's lock released, and
    the line names step 4 (its line was printed) and the last complete checkpoint, step 2."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, FAULTS, "pause-before-rename", "4", *_train_args(ckpt, "--steps", "6")],
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    printed = []
    try:
        for line in proc.stdout:  # in a spawned rank: the fork server imported the fault
            printed.append(line)
            if line.startswith("checkpoint_faults: pausing before renaming"):
                break
        assert (ckpt / ".tmp-step_00000004" / "meta.json").is_file(), "".join(printed)[-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert [s for s, _ in _step_losses("".join(printed))] == [1, 2, 3, 4]
    assert "fp8dist train: starting 2 processes\n" in printed
    assert proc.returncode == 130 and err == ("fp8dist train: interrupted after step 4, during its save; last "
                                              "checkpoint step 2\n"), err[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002"], "no partial save, no lock left"
    assert latest_checkpoint(ckpt) == ckpt / "step_00000002"


def _lora_args(ckpt: Path) -> list[str]:
    return _train_args(ckpt, "--strategy", "fsdp", "--lora-rank", "8", "--steps", "6")


@pytest.mark.slow
def test_a_lora_rank_killed_mid_save_and_mid_step_resumes_on_the_uninterrupted_curve(tmp_path):
    """LoRA's adapter-only checkpoint under torchrun --max-restarts 2 on 2 ranks, checkpoints every 2 steps: rank 1
    SIGKILLs itself while saving step 4 (its shards written, nothing renamed), then, on the restart, during step 6
    (after its backward, before the optimizer step). Each restart resumes from the newest complete checkpoint (step
    2: the save that was killed left it as it was; then step 4) and every loss printed equals an uninterrupted
    run's: the adapters, their AdamW moments and the data position came back exactly. The uninterrupted run is
    the same job on the dist harness's 2 gloo ranks, forked from its fork server (what each torchrun rank runs;
    under torchrun it printed the same losses and cost ~10 s more CPU: a launcher and two ranks importing torch)."""
    uninterrupted = dict(_step_losses("\n".join(run_ranks(train_on_gloo_ranks, _lora_args(tmp_path / "straight"))[0])))
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5, 6]
    ckpt = tmp_path / "ckpt"
    proc = run(["torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", FAULTS,
                "kill-rank-mid-save", "1:4", "kill-rank-mid-step", "1:6@1", *_lora_args(ckpt)], timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "checkpoint_faults: rank 1 kills itself while saving step 4, its shards written" in out
    assert "checkpoint_faults: rank 1 kills itself during step 6, after its backward" in out
    attempts = out.split("resume: loaded ")
    assert [a.split(" ", 1)[0] for a in attempts[1:]] == [str(ckpt / "step_00000002"), str(ckpt / "step_00000004")]
    assert [sorted(dict(_step_losses(a))) for a in attempts] == [[1, 2, 3, 4], [3, 4, 5], [5, 6]]
    for attempt in attempts:
        assert dict(_step_losses(attempt)).items() <= uninterrupted.items(), "each attempt on the uninterrupted curve"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000002", "step_00000004", "step_00000006"]
    assert latest_checkpoint(ckpt) == ckpt / "step_00000006"
