"""The main job, `fp8dist train`, as a user runs it; and the training loop on every strategy."""

from __future__ import annotations

import re

import pytest
import torch
from cli_helpers import run
from cli_helpers import train_losses_printed as _losses
from dist_harness import run_ranks

from fp8dist import plan_precision
from fp8dist.config.resolve import resolve_config
from fp8dist.train.models import build_llama
from fp8dist.train.job import TrainConfig, run_training


@pytest.mark.slow
def test_fp8dist_train_defaults_two_processes_fsdp_loss_falls():
    proc = run(["fp8dist", "train"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "starting 2 processes" in out and "strategy fsdp, fp8 torchao" in out and "2 x cpu (gloo)" in out
    assert "precision plan: fp8=torchao (recipe tensorwise, module_swap (auto), FP8 all-gather on)" in out, \
        "the plan is printed first"
    model = build_llama("tiny")
    total = sum(p.numel() for p in model.parameters())
    fp8 = [e for e in plan_precision(model, resolve_config(fp8="torchao"), device=torch.device("cpu")).fp8]
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert [e.name for e in fp8] == linears[1:-1], "every Linear but the first and the last"
    n_fp8 = sum(e.params for e in fp8)
    assert f"fp8 plan        fp8=torchao: FP8 {len(fp8)} layers / {n_fp8:,} params ({100 * n_fp8 / total:.1f}%)" in out
    steps = TrainConfig().steps
    report = out[out.index("fp8dist report: strategy fsdp, fp8 torchao, rank 0 of 2"):out.index(f"step    1/{steps}")]
    assert re.search(rf"FP8 GEMM +{len(fp8)} +{n_fp8:,} +fp8 e4m3 fwd, e5m2 grads \(tensorwise\) +fp8 e4m3 "
                     r"\(FP8 all-gather\) +fp32 +fp32", report), \
        "printed after the first step: FP8 GEMMs and FP8 all-gather, read live"
    assert re.search(r"total model states +8\.0\d\d", report), "fp32 params + grads + AdamW states over 2 ranks"
    losses = _losses(out)
    assert len(losses) == steps
    assert losses[-1] < losses[0] - 2.0, f"loss did not fall: {losses[0]} -> {losses[-1]}"
    assert re.search(rf"step +{steps}/{steps} \[#{{20}}\] 100%", out), "progress bar reaches 100%"
    summary = out[out.index("== fp8dist train: summary =="):]
    assert re.search(r"throughput +[\d,]+ tokens/s", summary)
    assert re.search(r"peak memory +rank 0: [\d,]+ MiB, rank 1: [\d,]+ MiB", summary)
    for rank in (0, 1):
        n_tensors = len(list(model.parameters()))
        assert re.search(rf"rank {rank}: DTensor Shard\(dim=0\): {n_tensors}/{n_tensors} tensors sharded over 2 "
                         rf"ranks; this rank stores [\d,]+ of {total:,} elements \(50\.0%\) in fp32; compute in "
                         r"bf16, gradients reduced in fp32", summary), summary


def test_fp8dist_train_reads_yaml_and_flags_override(tmp_path, capsys):
    from fp8dist.cli import main

    cfg = tmp_path / "job.yaml"
    cfg.write_text("strategy: fsdp1\nsteps: 50\nmodel_size: tiny\nseq_len: 64\n")
    assert main(["train", "--config", str(cfg), "--steps", "3", "--nproc", "1"]) == 0  # one rank: in this process
    out = capsys.readouterr().out
    assert "strategy fsdp1" in out and "x 64 tokens" in out
    assert len(_losses(out)) == 3
    assert "FlatParameter shards" in out
    assert not torch.distributed.is_initialized(), "the job's process group is gone when it returns"


# fp8dist train's bad command lines exit 2 with the reason before any process starts: the CLI table of
# tests/test_bad_inputs.py (in-process, cli.main)


def _train_case(rank: int, world: int, strategy: str) -> tuple[list[float], list[float]]:
    """The logged losses, and every rank's own loss on its first batch from the same initial weights (a plain
    copy under bf16 autocast), to check that the logged loss is their mean."""
    import torch.distributed as dist

    from fp8dist.train.data import Batches

    job = TrainConfig(steps=10, seq_len=64)  # the loss falls by 2.37 in 10 steps (measured, each strategy)
    losses = run_training(resolve_config(strategy=strategy), job, log=lambda line: None).losses
    model = build_llama(job.model_size, seed=job.seed, max_seq_len=job.seq_len)
    ids = Batches(batch_size=job.batch_size, seq_len=job.seq_len, rank=rank, world_size=world, seed=job.seed)[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        local = model(input_ids=ids, labels=ids).loss.float()
    each = [torch.zeros(()) for _ in range(world)]
    dist.all_gather(each, local)
    return losses, [x.item() for x in each]


# the logged first loss vs the mean of the ranks' own first losses: 0 under ddp (the same autocast path), 2.2e-4
# under fsdp1 / deepspeed (bf16 weights cast before the forward); the two ranks' own losses differ by 0.015
MEAN_TOLERANCE = 1e-3


@pytest.mark.parametrize("strategy", ["fsdp1", "ddp", "deepspeed"])
def test_training_loss_is_the_mean_over_ranks_and_falls_on_every_strategy(strategy):
    (losses, each), _ = run_ranks(_train_case, strategy)
    assert abs(losses[0] - sum(each) / len(each)) < MEAN_TOLERANCE
    assert max(each) - min(each) > 5 * MEAN_TOLERANCE, "the ranks train on different batches"
    assert losses[-1] < losses[0] - 1.5


# fp8dist train under torchrun runs in the launched processes: tests/test_launch.py (launch/torchrun.sh)


def _accum_case(rank: int, world: int) -> dict:
    """fp8dist train's loop with the global batch of 8 in 1 or 2 micro-batches per rank, clipping on or off."""
    job = TrainConfig(steps=3, seq_len=32)
    out = {}
    for strategy in ("fsdp", "deepspeed"):
        for accum, clip in ((1, 1.0), (2, 1.0), (1, 0.0)):
            cfg = resolve_config(strategy=strategy, grad_accum=accum, gradient_clipping=clip)
            out[(strategy, accum, clip)] = dict(losses=run_training(cfg, job, log=lambda line: None).losses)
    return out


def test_grad_accum_keeps_the_global_batch_and_clipping_applies_on_every_strategy():
    r = run_ranks(_accum_case)[0]
    for strategy in ("fsdp", "deepspeed"):
        one, two, unclipped = (r[(strategy, 1, 1.0)]["losses"], r[(strategy, 2, 1.0)]["losses"],
                               r[(strategy, 1, 0.0)]["losses"])
        # the same 8 sequences per step, in two micro-batches: the step's loss is their mean (measured: equal);
        # the updates differ by the bf16 rounding of two backward passes instead of one (measured: at most 2.3e-4
        # over 3 steps)
        assert abs(one[0] - two[0]) < 1e-6, (strategy, one, two)
        assert max(abs(a - b) for a, b in zip(one, two)) < 5e-4, (strategy, one, two)
        assert unclipped[0] == one[0] and unclipped[1:] != one[1:], f"{strategy}: clipping at 1.0 changes the steps"


def test_hugging_face_trainers_flag_names_reach_the_same_fields():
    """--max-grad-norm and --gradient-accumulation-steps (HF Trainer's spellings) set gradient_clipping and
    grad_accum, as --gradient-clipping and --grad-accum do."""
    import argparse

    from fp8dist.cli import train as train_cli

    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    for argv in (["--max-grad-norm", "0.5", "--gradient-accumulation-steps", "2"],
                 ["--gradient-clipping", "0.5", "--grad-accum", "2"]):
        config, _ = train_cli._config_and_job(parser.parse_args(["train", *argv]))
        assert (config.parallel.gradient_clipping, config.parallel.grad_accum) == (0.5, 2)
