"""What a step the guard skipped means for ``fp8dist train``'s learning-rate schedule: nothing. The schedule follows
the optimizer steps applied (DeepSpeed's engine steps its scheduler only when the step was not an overflow), so the
steps after a planted non-finite batch train exactly as a run that never saw that batch; and a resume keeps that
position."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import fp8dist.train.steps as train_module
from fp8dist.config.resolve import resolve_config
from fp8dist.train.data.job import JobBatches
from fp8dist.train.job import TrainConfig, run_training

PLANTED = 3
"""The (0-based) step whose batch gives non-finite gradients."""


def _plant_nan_at(monkeypatch, step: int) -> None:
    """The loss of the ``step``-th training forward is NaN (so are its gradients): the guard skips that step."""
    calls = iter(range(10**6))
    real = train_module.lm_loss

    def loss(model, ids, *, windows):
        out = real(model, ids, windows=windows)
        return out * float("nan") if next(calls) == step else out

    monkeypatch.setattr(train_module, "lm_loss", loss)


def _without_batch(monkeypatch, step: int) -> None:
    """The data stream with batch ``step`` taken out: steps from ``step`` on read the batch after theirs."""
    real = JobBatches.take
    monkeypatch.setattr(JobBatches, "take", lambda self, s: real(self, s + (s >= step)))


def _run(job: TrainConfig) -> list[float]:
    return run_training(resolve_config(strategy="none", fp8=None), job, log=lambda line: None).losses


@pytest.mark.filterwarnings("ignore:step .* skipped:RuntimeWarning")
def test_a_skipped_step_leaves_the_schedule_so_later_steps_equal_a_run_without_that_batch(monkeypatch, tmp_path):
    job = TrainConfig(steps=20, seq_len=32, batch_size=4, lr=3e-3)  # warm-up over 2 steps, then cosine decay
    with monkeypatch.context() as m:
        _plant_nan_at(m, PLANTED)
        skipped = run_training(resolve_config(strategy="none", fp8=None), job, log=lambda line: None)
    with monkeypatch.context() as m:
        _without_batch(m, PLANTED)
        clean = _run(job)
    assert skipped.skipped_steps == 1
    assert skipped.losses[:PLANTED] == clean[:PLANTED]
    # the same weights, optimizer state, batch and learning rate at every later step: equal (measured 0.0); with
    # the schedule advanced by the skipped step they were up to 0.059 apart here (0.14 in issue 40's run)
    later = zip(skipped.losses[PLANTED + 1:], clean[PLANTED:-1])
    assert max(abs(a - b) for a, b in later) < 1e-6, (skipped.losses, clean)


def _stop_after(step: int):
    def progress(done: int) -> None:
        if done == step:
            raise KeyboardInterrupt  # as Ctrl-C after the step's checkpoint
    return progress


def _logged(job: TrainConfig) -> tuple[dict[int, float], dict[int, list[float]]]:
    """The loss of each step in the metrics file, and every loss TensorBoard shows for each step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lines = [json.loads(line) for line in open(job.metrics_file)]
    events = EventAccumulator(job.tensorboard)
    events.Reload()
    board: dict[int, list[float]] = {}
    for event in events.Scalars("train/loss"):
        board.setdefault(event.step, []).append(event.value)
    return {line["step"]: line["loss"] for line in lines}, board


@pytest.mark.filterwarnings("ignore:step .* skipped:RuntimeWarning")
def test_a_resume_keeps_the_schedules_position_and_tensorboard_drops_the_interrupted_steps(monkeypatch, tmp_path):
    """Interrupted at step 6 of 10 after the skip (checkpoint at step 4), resumed: the last steps equal the
    uninterrupted run's, and the metrics file and TensorBoard show steps 5 and 6 once, as the resumed run logged
    them."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    job = TrainConfig(steps=10, seq_len=32, batch_size=4, checkpoint_dir=str(tmp_path / "ckpt"), save_every=4,
                      metrics_file=str(tmp_path / "run.jsonl"), tensorboard=str(tmp_path / "tb"))
    config = resolve_config(strategy="none", fp8=None)
    with monkeypatch.context() as m:
        _plant_nan_at(m, PLANTED)
        whole = run_training(config, replace(job, checkpoint_dir=str(tmp_path / "whole"), metrics_file=None,
                                             tensorboard=None), log=lambda line: None).losses
        _plant_nan_at(m, PLANTED)  # counted afresh
        with pytest.raises(KeyboardInterrupt):
            run_training(config, job, log=lambda line: None, progress=_stop_after(6))
    resumed = run_training(config, replace(job, resume=True), log=lambda line: None)
    assert resumed.start_step == 4
    # measured: equal (the checkpoint restores weights and optimizer state bitwise); resumed at the batches' step
    # instead of the applied steps', the schedule was one step ahead (0.080 apart)
    assert max(abs(a - b) for a, b in zip(resumed.losses, whole[4:])) < 1e-6, (resumed.losses, whole)
    in_file, on_board = _logged(job)
    assert sorted(in_file) == list(range(1, 11)) and in_file[PLANTED + 1] is None  # NaN: null, no scalar
    assert sorted(on_board) == [s for s in range(1, 11) if s != PLANTED + 1]
    assert all(len(values) == 1 for values in on_board.values()), f"a step shown twice: {on_board}"
    for step, loss in zip(range(5, 11), resumed.losses):
        assert in_file[step] == pytest.approx(loss) and on_board[step][0] == pytest.approx(loss)  # float32 events


def _deepspeed_case(rank: int, world: int) -> dict[str, list[float]]:
    """DeepSpeed's engine checks and skips inside its own step: the planted run and the run without the batch."""
    from _pytest.monkeypatch import MonkeyPatch

    job, config = TrainConfig(steps=8, seq_len=32, batch_size=4), resolve_config(strategy="deepspeed", fp8=None)
    out = {}
    for name, patch in (("skipped", _plant_nan_at), ("clean", _without_batch)):
        with MonkeyPatch.context() as m:
            patch(m, PLANTED)
            result = run_training(config, job, log=lambda line: None)
        out[name] = result.losses
        out[f"{name}_skipped_steps"] = result.skipped_steps
    return out


@pytest.mark.filterwarnings("ignore:step .* skipped:RuntimeWarning")
def test_deepspeeds_skipped_step_leaves_the_schedule_too():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from dist_harness import run_ranks

    out = run_ranks(_deepspeed_case)[0]
    assert (out["skipped_skipped_steps"], out["clean_skipped_steps"]) == (1, 0)
    # measured: equal (0.0); with the schedule advanced by the skipped step, 0.142 apart (issue 40: 0.14)
    later = zip(out["skipped"][PLANTED + 1:], out["clean"][PLANTED:-1])
    assert max(abs(a - b) for a, b in later) < 1e-6, out
