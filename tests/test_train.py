"""The main job, `fp8dist train`, as a user runs it; and the training loop on every strategy."""

from __future__ import annotations

import re

import pytest
from cli_helpers import run
from cli_helpers import train_losses_printed as _losses
from dist_harness import run_ranks

from fp8dist.config import resolve_config
from fp8dist.train import TrainConfig, run_training


def test_fp8dist_train_defaults_two_processes_fsdp_loss_falls():
    proc = run(["fp8dist", "train"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "starting 2 processes" in out and "strategy fsdp, fp8 torchao" in out and "2 x cpu (gloo)" in out
    assert "precision plan: fp8=torchao (recipe tensorwise, FP8 all-gather on)" in out, "the plan is printed first"
    assert "fp8 plan        fp8=torchao: FP8 13 layers / 376,832 params (82.0%)" in out
    report = out[out.index("fp8dist report: strategy fsdp, fp8 torchao, rank 0 of 2"):out.index("step    1/60")]
    assert re.search(r"FP8 GEMM +13 +376,832 +fp8 e4m3 fwd, e5m2 grads \(tensorwise\) +fp8 e4m3 \(FP8 all-gather\) "
                     r"+fp32 +fp32", report), "printed after the first step: FP8 GEMMs and FP8 all-gather, read live"
    assert re.search(r"total model states +8\.0\d\d", report), "fp32 params + grads + AdamW states over 2 ranks"
    losses = _losses(out)
    assert len(losses) == TrainConfig().steps
    assert losses[-1] < losses[0] - 2.0, f"loss did not fall: {losses[0]} -> {losses[-1]}"
    assert re.search(r"step +60/60 \[#{20}\] 100%", out), "progress bar reaches 100%"
    summary = out[out.index("== fp8dist train: summary =="):]
    assert re.search(r"throughput +[\d,]+ tokens/s", summary)
    assert re.search(r"peak memory +rank 0: [\d,]+ MiB, rank 1: [\d,]+ MiB", summary)
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: DTensor Shard\(dim=0\): 21/21 tensors sharded over 2 rank\(s\); this rank "
                         r"stores [\d,]+ of 459,392 elements \(50\.0%\) in fp32; compute in bf16, gradients reduced "
                         r"in fp32", summary), summary


def test_fp8dist_train_reads_yaml_and_flags_override(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("strategy: fsdp1\nsteps: 50\nmodel_size: tiny\nseq_len: 64\n")
    proc = run(["fp8dist", "train", "--config", str(cfg), "--steps", "3"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy fsdp1" in proc.stdout and "x 64 tokens" in proc.stdout
    assert len(_losses(proc.stdout)) == 3
    assert "FlatParameter shards" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--batch-size", "5"], "batch_size=5 does not split over world size 2"),
    (["--strategy", "none", "--nproc", "2"], "nproc=2 with strategy='none'"),
    (["--fp8", "te"], "fp8='te' cannot run here: Transformer Engine is not installed"),
    (["--fp8", "msamp", "--strategy", "fsdp"], "fp8='msamp' with strategy='fsdp'"),
    (["--strategy", "deepspeed", "--zero-stage", "4"], "invalid choice: 4"),
    (["--steps", "0"], "steps=0 must be at least 1"),
])
def test_fp8dist_train_bad_input_exits_2_with_the_reason(args, message):
    proc = run(["fp8dist", "train", *args], timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "starting" not in proc.stdout, "rejected before any process starts"


def _train_case(rank: int, world: int, strategy: str) -> list[float]:
    config = resolve_config(strategy=strategy)
    return run_training(config, TrainConfig(steps=25, seq_len=64), log=lambda line: None).losses


@pytest.mark.parametrize("strategy", ["fsdp1", "ddp", "deepspeed"])
def test_training_loss_falls_on_every_strategy(strategy):
    first, second = run_ranks(_train_case, strategy)
    assert first == second, "the logged loss is the mean over ranks"
    assert first[-1] < first[0] - 1.5


def test_fp8dist_train_under_torchrun_runs_in_the_launched_processes():
    proc = run(["torchrun", "--standalone", "--nproc-per-node=2", "-m", "fp8dist", "train", "--steps", "3",
                "--strategy", "ddp"], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting 2 processes" not in proc.stdout, "no second launch inside torchrun"
    assert "strategy ddp" in proc.stdout and "2 x cpu (gloo)" in proc.stdout and len(_losses(proc.stdout)) == 3
