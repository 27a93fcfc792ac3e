"""What a new user meets when a run goes wrong: a diverged loss stops the job with one line, a rank's error is one
line from the launching process, Ctrl-C says where the job stood (rc 130, every child reaped), a rendezvous that
misses a process says so instead of hanging, and a very long run does not warm up forever."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

from cli_helpers import BIN, free_port
from fp8dist.cli import main


BLOWN_UP = 1e30
"""The factor on every weight of the blown-up checkpoint below. Its weights (~0.02 x 1e30, norm weights 1e30) are
finite in fp32 and bf16 (max 3.4e38). RMSNorm squares its input in fp32: each embedding row holds an entry of at
least ~4e28 (measured), far above the 1.8e19 whose square overflows, so every norm's variance is inf, rsqrt(inf) = 0
and every norm outputs exactly x * 0 = 0; attention and MLP see zeros and add zeros, the logits are 0 and the loss
is ln 256 = 5.5452, finite. Backward, the final norm's input gradient sums weight_j * grad_j * x_j over the hidden
size, terms of 1e30 x ~1e27 x ~1e28, inf in fp32; times d rsqrt/d var at inf (0) that is NaN, which reaches every
weight below (the embedding first). IEEE overflow alone decides this, with 8 or more orders of magnitude to spare
on each side: no kernel's rounding can change it."""


@pytest.mark.parametrize("guard", ["skip", "off"])
def test_a_diverging_run_stops_after_five_non_finite_steps_with_one_line(capsys, tmp_path, guard):
    """A checkpoint saved as a run blew up (its weights finite, ~1e30): its loss is finite and its gradients are not
    (see :data:`BLOWN_UP`), at an ordinary learning rate and on any CPU. With the guard (nonfinite_step, on by
    default) those steps are skipped, the weights stay finite and the 5th skip in a row stops the run, naming the
    modules; without it the weights go NaN and the 5th non-finite loss in a row stops it. One line, rc 1, either way.
    (A learning rate alone is no such source: at lr 1e4 AdamW's first step sets each weight to about +-lr, the
    signs those of gradients the CPU's bf16 kernels round differently, and whether a later step overflows to NaN or
    RMSNorm's squared overflow zeroes the activations and every gradient first depends on them: on an AVX-512 BF16
    host the run died at loss ln 256 with gradient norm 0 and never went non-finite.)"""
    from fp8dist.train.models import build_llama
    from fp8dist.train.checks import MAX_NONFINITE_STEPS

    model = build_llama("tiny", seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(BLOWN_UP)
    model.save_pretrained(tmp_path)  # transformers' own writer, fp32
    code = main(["train", "--strategy", "none", "--nproc", "1", "--fp8", "none", "--pretrained", str(tmp_path),
                 "--lr", "1e-3", "--steps", "40", "--batch-size", "2", "--seq-len", "32", "--nonfinite-step", guard])
    out, err = capsys.readouterr()
    printed = re.findall(r"^step +\d+/40 .* loss (\S+) \|", out, flags=re.M)
    lines = [line for line in err.strip().splitlines() if line.startswith("fp8dist train: error:")]
    assert code == 1 and "Traceback" not in err and len(lines) == 1, err
    if guard == "skip":
        assert len(printed) == MAX_NONFINITE_STEPS - 1, "the 5th skip stops the run before its step line"
        assert all(math.isfinite(float(loss)) for loss in printed), "no skipped step reached the weights"
        assert lines[0].startswith(f"fp8dist train: error: {MAX_NONFINITE_STEPS} consecutive steps had non-finite "
                                   "gradients (the last in model.embed_tokens, ")
        assert lines[0].endswith("Lower the learning rate, keep the layers named out of FP8 (fp8_exclude=[...]; "
                                 "fp8dist probe measures them), or resume from the last checkpoint.")
        return
    first = next(i for i, loss in enumerate(printed) if not math.isfinite(float(loss)))
    assert first == 1, "step 1's loss is finite, its NaN gradients reach the weights, step 2's loss is NaN"
    assert len(printed) == first + MAX_NONFINITE_STEPS, "stopped at the 5th non-finite step in a row"
    assert lines == [
        f"fp8dist train: error: loss non-finite ({printed[-1]}) for 5 consecutive steps (steps {first + 1}-"
        f"{first + 5}): training diverged. Lower --lr (now 0.001), or clip gradients (--gradient-clipping 1.0)."]


def test_a_long_run_warms_up_over_at_most_2000_steps_and_the_header_says_so():
    from fp8dist.train.schedule import MAX_WARMUP_STEPS, describe_schedule, lr_schedule, warmup_steps

    factor = lr_schedule("cosine", 10**9)
    assert warmup_steps(10**9) == MAX_WARMUP_STEPS == 2000 and factor(MAX_WARMUP_STEPS - 1) == 1.0
    assert factor(0) == 1 / 2000
    assert warmup_steps(60) == 6 and lr_schedule("cosine", 60)(5) == 1.0, "short runs keep 10%"
    assert describe_schedule("cosine", 10**9) == ("linear warm-up over 2,000 steps, then cosine decay to 10% at step "
                                                   "1,000,000,000")


def test_an_error_inside_a_spawned_rank_is_one_line_with_exit_code_2(capfd):
    code = main(["train", "--replicate-degree", "3", "--nproc", "2", "--steps", "1", "--fp8", "none"])
    out, err = capfd.readouterr()  # the ranks' own file descriptors too
    assert code == 2 and "fp8dist train: starting 2 processes" in out
    assert "Traceback" not in err and "Terminating process" not in err, err
    assert [line for line in err.splitlines() if "error" in line.lower()] == [
        "fp8dist train: error: replicate_degree=3 does not split world size 2 into equal shard groups: choose one of "
        "[1, 2] (the number of nodes shards within a node), or 1 to shard over every rank."]


def _descendants(pid: int) -> list[str]:
    found, todo = [], [str(pid)]
    while todo:
        kids = subprocess.run(["pgrep", "-P", todo.pop()], capture_output=True, text=True).stdout.split()
        found += kids
        todo += kids
    return found


def _stat(pid: str) -> tuple[str, str] | None:
    """A process's state and start time (the pair names one process even if its PID is reused), or None once it is
    gone: reaped by its parent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19]


def _left(children: dict[str, tuple[str, str]]) -> dict[str, str]:
    """The state of each of ``children`` (PID -> its state and start time when listed) that still exists."""
    now = {pid: _stat(pid) for pid in children}
    return {pid: stat[0] for pid, stat in now.items() if stat is not None and stat[1] == children[pid][1]}


@pytest.mark.slow
@pytest.mark.parametrize("who", ["launcher", "process group"])
def test_ctrl_c_says_where_the_job_stood_exits_130_and_reaps_every_child(who, tmp_path):
    """A real ``fp8dist train`` with 2 spawned ranks, SIGINT after its third step: to the launcher alone (``kill
    -INT``), or to its whole process group (Ctrl-C in a terminal)."""
    cmd = [str(BIN / "fp8dist"), "train", "--steps", "500", "--fp8", "none", "--batch-size", "2", "--seq-len", "32",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:
            if re.match(r"step +3/500 ", line):
                break
        # the ranks, the fork server they forked from and multiprocessing's resource tracker
        children = {pid: stat for pid in _descendants(proc.pid) if (stat := _stat(pid)) is not None}
        (os.killpg if who == "process group" else os.kill)(proc.pid, signal.SIGINT)
        said = proc.stderr.readline()  # printed once every rank has been joined
        at_report = _left(children)
        proc.wait(timeout=60)
        # exact, no deadline: a launcher reaps what it started before it exits, and the fork server reaps the ranks
        # it forked before it leaves; an orphan left to init would be reaped whenever init gets to it
        after_exit = _left(children)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the last step whose line was printed; an interrupt in its save (due every 2 steps) leaves the one before
    said_as = re.fullmatch(r"fp8dist train: interrupted after step (\d+)(, during its save)?; last checkpoint step "
                           r"(\d+)\n", said)
    done, in_save, saved = int(said_as.group(1)), said_as.group(2) is not None, int(said_as.group(3))
    assert saved == (done - 2 if in_save else done - done % 2) and not (in_save and done % 2), said
    assert proc.returncode == 130 and done >= 3
    assert not list((tmp_path / "ckpt").glob(".*")), "no partial save, no lock left behind"
    assert len(children) >= 3 and "Z" not in at_report.values(), f"a <defunct> child: {at_report}"
    assert after_exit == {}, f"left behind when the launcher exited: {after_exit}"
    assert "Traceback" not in proc.stderr.read()


@pytest.fixture
def launcher_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("FP8DIST_RENDEZVOUS_TIMEOUT", "1")
    return monkeypatch


@pytest.mark.timeout(300)  # the only clock: torch's own rendezvous would wait 30 minutes
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_rendezvous_missing_a_process_stops_after_its_timeout_naming_what_is_missing(rank, launcher_env):
    from fp8dist.runtime.env import LaunchError, init_distributed

    launcher_env.setenv("RANK", rank)
    launcher_env.setenv("WORLD_SIZE", "2")
    where = f"127.0.0.1:{os.environ['MASTER_PORT']}"
    start = time.monotonic()
    with pytest.raises(LaunchError) as err:
        init_distributed(device="cpu")
    assert time.monotonic() - start >= 1.0, "waited the 1 s asked for"
    assert not dist.is_initialized()
    if rank == "0":
        assert str(err.value) == (f"rank 0: only 1 of WORLD_SIZE=2 processes joined the rendezvous at {where} in 1 s: "
                                  "1 never started or cannot reach it. Start all 2 (torchrun --nproc-per-node N sets "
                                  "RANK and WORLD_SIZE for each), or set WORLD_SIZE to the number you start; "
                                  "FP8DIST_RENDEZVOUS_TIMEOUT=SECONDS waits longer (now 1 s).")
    else:
        assert str(err.value).startswith(f"rank 1 of 2 could not reach rank 0 at {where} (MASTER_ADDR:MASTER_PORT) "
                                         "within 1 s: rank 0 is not running there.")


def test_the_rendezvous_default_is_torchruns_join_timeout():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    from fp8dist.runtime.rendezvous import RENDEZVOUS_TIMEOUT_S, rendezvous_timeout

    assert rendezvous_timeout({}) == RENDEZVOUS_TIMEOUT_S == RendezvousTimeout().join.total_seconds()
    assert rendezvous_timeout({"FP8DIST_RENDEZVOUS_TIMEOUT": "2.5"}) == 2.5
