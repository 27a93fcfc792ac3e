"""One job per checkpoint directory: a second ``fp8dist train`` on the same ``--checkpoint-dir`` is refused before it
trains, naming the holder; the lock goes with the job that held it, however it ends. Real processes hold the locks;
every wait is on an event (a line a process printed), never on a clock."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import BIN, ROOT, run

from fp8dist.checkpoint.lock import LOCK_FILE, CheckpointDirLocked, check_unlocked, lock_checkpoint_dir

HOST = socket.gethostname()

# a process that takes the lock, then writes `holder` over its file when given (a job on another host), says so and
# holds it until its stdin closes or it is killed
_HOLDER = """
import json, sys
from fp8dist.checkpoint.lock import lock_checkpoint_dir
lock = lock_checkpoint_dir(sys.argv[1])
if len(sys.argv) > 2:
    lock.file.write_text(sys.argv[2])
print("locked", flush=True)
sys.stdin.read()
"""


def _holder(directory: Path, content: str | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory), *([content] if content else [])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline() == "locked\n"
    return proc


def _refusal(directory: Path, pid: int, host: str, stop: str) -> str:
    """The refusal as a pattern (the holder's start time any); ``stop``: the way out, as said."""
    said = (f"checkpoint_dir '{directory}' is in use by another training job: PID {pid} on host {host} (since TIME) "
            f"holds {directory / LOCK_FILE}. Two jobs writing one checkpoint directory replace each other's "
            f"checkpoints. Wait for that job to end or {stop}; or pass another --checkpoint-dir.")
    return re.escape(said).replace("TIME", r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC")


def _elsewhere(file: Path) -> str:
    return f"stop it; if that job is gone (its host down or unreachable), remove {file}"


def test_a_lock_left_by_a_killed_job_is_taken_over_with_a_note_and_released_without_a_trace(tmp_path):
    directory = tmp_path / "ckpt"
    proc = _holder(directory)
    check_unlocked(tmp_path / "elsewhere")  # nothing there: nothing to say, nothing created
    with pytest.raises(CheckpointDirLocked) as err:
        lock_checkpoint_dir(directory)
    assert re.fullmatch(_refusal(directory, proc.pid, HOST, f"stop it (kill {proc.pid})"), str(err.value))
    proc.kill()
    proc.wait()
    left = (directory / LOCK_FILE).read_text()
    assert f'"pid": {proc.pid}' in left, "SIGKILL left its file: the OS lock went with the process"
    check_unlocked(directory)  # a leftover is no holder
    lock = lock_checkpoint_dir(directory)
    assert re.fullmatch(rf"checkpoint: took over {directory / LOCK_FILE}, left by PID {proc.pid} on host {HOST} "
                        r"\(since [\d: -]+UTC\), which ended without releasing it", lock.note())
    assert f'"pid": {os.getpid()}' in (directory / LOCK_FILE).read_text()
    lock.release()
    lock.release()
    assert list(directory.iterdir()) == [] and not (tmp_path / "elsewhere").exists()
    fresh = lock_checkpoint_dir(tmp_path / "new")  # created for the job: removed with the lock when left empty
    assert fresh.note() is None
    fresh.release()
    assert not (tmp_path / "new").exists()


def test_a_lock_held_from_another_host_says_how_to_take_it_over_and_that_way_out_works(tmp_path):
    """A job on another node of a shared filesystem: the lock is held (the OS says so, as NFS does across hosts);
    its PID cannot be checked from here, so the message says to remove the file once that job is gone."""
    directory = tmp_path / "ckpt"
    proc = _holder(directory, '{"pid": 4242, "host": "node7", "started": "2026-12-01 22:00:00 UTC"}')
    try:
        with pytest.raises(CheckpointDirLocked) as err:
            lock_checkpoint_dir(directory)
        assert re.fullmatch(_refusal(directory, 4242, "node7", _elsewhere(directory / LOCK_FILE)), str(err.value))
        (directory / LOCK_FILE).unlink()  # the way out, while the other process still holds its (removed) file
        lock = lock_checkpoint_dir(directory)
        assert lock.note() is None
        lock.release()
    finally:
        proc.kill()
        proc.wait()


def test_without_flock_the_holder_written_in_the_file_decides(tmp_path, monkeypatch):
    """A filesystem without flock (some network mounts answer ENOLCK): a live process on this host or any on
    another holds the lock; a dead one on this host left it."""
    import errno
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    file = tmp_path / LOCK_FILE
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(ended.stdout)
    for pid, host, stop in [(os.getppid(), HOST, f"stop it (kill {os.getppid()})"), (dead, "node7", _elsewhere(file))]:
        file.write_text(f'{{"pid": {pid}, "host": "{host}", "started": "2026-12-01 22:00:00 UTC"}}')
        with pytest.raises(CheckpointDirLocked) as err:
            lock_checkpoint_dir(tmp_path)
        assert re.fullmatch(_refusal(tmp_path, pid, host, stop), str(err.value))
    file.write_text(f'{{"pid": {dead}, "host": "{HOST}", "started": "2026-12-01 22:00:00 UTC"}}')
    lock = lock_checkpoint_dir(tmp_path)
    assert lock.note().startswith(f"checkpoint: took over {file}, left by PID {dead} on host {HOST}")
    with pytest.raises(CheckpointDirLocked, match=f"PID {os.getpid()} on host {HOST}"):
        lock_checkpoint_dir(tmp_path)
    lock.release()
    assert not file.exists()


def test_run_training_refuses_a_locked_checkpoint_dir_before_it_builds_anything(tmp_path):
    from fp8dist.config.resolve import resolve_config
    from fp8dist.train.job import TrainConfig, run_training

    proc = _holder(tmp_path / "ckpt")
    said = []
    try:
        with pytest.raises(CheckpointDirLocked, match=f"PID {proc.pid} on host {HOST}"):
            run_training(resolve_config(strategy="none", fp8=None),
                         TrainConfig(steps=1, batch_size=4, seq_len=32, checkpoint_dir=str(tmp_path / "ckpt")),
                         log=said.append)
    finally:
        proc.kill()
        proc.wait()
    assert said == [], "refused before the job's header"


def _train(ckpt: Path, *more: str) -> list[str]:
    return ["train", "--fp8", "none", "--batch-size", "2", "--seq-len", "32", "--checkpoint-dir", str(ckpt),
            "--save-every", "2", "--resume", *more]


@pytest.mark.slow
def test_a_second_train_on_the_same_checkpoint_dir_is_refused_before_it_trains_and_the_first_releases_it(tmp_path):
    """`fp8dist train` (2 spawned ranks: rank 0 holds the lock) is running; the same command again, and the same
    under torchrun (rank 0 of that job finds it held, every rank stops), are refused with rc 2 naming the holder;
    Ctrl-C on the first leaves the directory without the lock and without a partial save. The first job is stopped
    (SIGSTOP) while the others are refused: a stopped process holds its lock as a running one does, and its two
    ranks no longer take the cores the refused jobs start on (the test's CPU time: 43 s running, 26 s stopped)."""
    ckpt = tmp_path / "ckpt"
    first = subprocess.Popen([str(BIN / "fp8dist"), *_train(ckpt, "--steps", "500")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=ROOT,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in first.stdout:  # the lock is taken before the first step
            if re.match(r"step +1/500 ", line):
                break
        os.killpg(first.pid, signal.SIGSTOP)
        holder = int(re.search(r'"pid": (\d+)', (ckpt / LOCK_FILE).read_text()).group(1))
        assert os.getpgid(holder) == first.pid and holder != first.pid, "a rank of the first job: its rank 0"
        refused = _refusal(ckpt, holder, HOST, f"stop it (kill {holder})")
        second = run(["fp8dist", *_train(ckpt, "--steps", "4")])
        assert second.returncode == 2 and re.fullmatch(f"fp8dist train: error: {refused}\n", second.stderr), \
            second.stderr[-3000:]
        assert "starting" not in second.stdout, "said before any process starts"
        third = run(["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "fp8dist.cli",
                     *_train(ckpt, "--steps", "4")])
        assert third.returncode != 0 and not re.search(r"^step ", third.stdout, flags=re.M), third.stdout[-3000:]
        assert len(re.findall(f"^fp8dist train: error: {refused}$", third.stderr, flags=re.M)) == 1, \
            third.stderr[-3000:]
        ranks = re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(\d+)", third.stderr)
        assert set(ranks) == {("0", "2"), ("1", "2")}, "every rank stopped as bad input: " + third.stderr[-3000:]
        os.killpg(first.pid, signal.SIGCONT)
        for line in first.stdout:  # its first checkpoint (step 2's) is saved before step 3 is said
            if re.match(r"step +3/500 ", line):
                break
        os.killpg(first.pid, signal.SIGINT)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 130, err[-3000:]
    assert re.fullmatch(r"fp8dist train: interrupted after step \d+(, during its save)?; last checkpoint step \d+\n",
                        err), err[-3000:]
    left = sorted(p.name for p in ckpt.iterdir())
    assert left[0] == "latest" and all(name.startswith("step_") for name in left[1:]), left
