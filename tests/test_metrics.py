"""The training figures: FLOPs per token against a hand count, MFU and the FP8-aware figure, null MFU on a CPU with
its reason, and the metrics file's keys for every logged step."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fp8dist
from fp8dist.train.metrics import FlopsPerToken, MetricsWriter, TrainingFigures, flops_per_token, utilization
from fp8dist.train.models import build_llama

# the list, spelled out here so a renamed key fails
KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "mfu", "peak_memory_bytes",
        "skipped_steps"}


def _gemm_params(model: nn.Module, kind: type = nn.Linear) -> int:
    return sum(p.numel() for m in model.modules() if isinstance(m, kind) for p in m.parameters(recurse=False))


def test_flops_per_token_of_a_small_llama_is_the_hand_count():
    from torchao.float8.float8_linear import Float8Linear

    model = build_llama("tiny", max_seq_len=64)
    c = model.config
    linear = _gemm_params(model)  # every projection and the output head; not the embedding nor the norms
    assert linear < sum(p.numel() for p in model.parameters())
    attention = 12 * c.num_hidden_layers * c.num_attention_heads * (c.hidden_size // c.num_attention_heads) * 64
    assert flops_per_token(model, seq_len=64) == FlopsPerToken(6 * linear, 0, attention)
    wrapped = fp8dist.wrap_model(build_llama("tiny", max_seq_len=64), strategy="none", fp8="torchao")
    fp8 = _gemm_params(wrapped, Float8Linear)
    assert 0 < fp8 < linear
    assert flops_per_token(wrapped, seq_len=64) == FlopsPerToken(6 * (linear - fp8), 6 * fp8, attention)


def test_tied_output_head_counts_and_the_embeddings_do_not():
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16))
    assert model.lm_head.weight is model.transformer.wte.weight
    head = model.lm_head.weight.numel()
    assert flops_per_token(model, seq_len=16).gemm_high == 6 * (_gemm_params(model, Conv1D) + head)


def test_mfu_and_fp8_aware_mfu_by_hand_and_null_without_a_peak():
    flops = FlopsPerToken(gemm_high=600, gemm_fp8=1200, attention=200)
    peaks = SimpleNamespace(bf16_tflops=1000e-12, fp8_tflops=2000e-12)  # 1000 and 2000 FLOP/s
    use = utilization(flops, 0.5, peaks)
    assert use.mfu == pytest.approx(0.5 * 2000 / 1000)
    assert use.fp8_aware_mfu == pytest.approx(0.5 * (800 / 1000 + 1200 / 2000))
    assert utilization(FlopsPerToken(600, 0, 200), 0.5, peaks).fp8_aware_mfu == pytest.approx(0.4)
    from fp8dist.runtime.hardware import TARGETS, find_gpu

    h100 = find_gpu(TARGETS["h100"]).spec  # the GPU table's record is the peaks (one source with the speed model)
    on_h100 = utilization(flops, 1e9, h100)
    assert on_h100.mfu == pytest.approx(1e9 * 2000 / 989.4e12)
    assert on_h100.fp8_aware_mfu == pytest.approx(1e9 * (800 / 989.4e12 + 1200 / 1978.9e12))
    none = utilization(flops, 0.5, None, "cpu")
    assert (none.mfu, none.fp8_aware_mfu, none.note) == (None, None, "no dense bf16 peak is known for cpu")
    no_fp8 = utilization(flops, 0.5, SimpleNamespace(bf16_tflops=1000e-12, fp8_tflops=None), "A100")
    assert no_fp8.mfu == pytest.approx(1.0) and no_fp8.fp8_aware_mfu is None and "FP8 peak" in no_fp8.note


def test_metrics_file_has_the_keys_for_every_logged_step(tmp_path):
    torch.manual_seed(0)
    model = fp8dist.wrap_model(build_llama("tiny", max_seq_len=16), strategy="none")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    figures = TrainingFigures(model, seq_len=16)
    assert figures.header().splitlines()[-1] == ("MFU: null (no dense bf16 peak is known for cpu; MFU is a fraction of "
                                                 "a GPU's dense tensor-core peak, and cpu is not a GPU)")
    path, expected = tmp_path / "metrics.jsonl", []
    with MetricsWriter(path) as out:
        for step in range(1, 3):
            t0 = time.perf_counter()
            ids = torch.randint(0, 256, (2, 16))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            norm = fp8dist.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            record = figures.step(step=step, loss=loss.detach(), tokens=2 * 16, step_time_s=time.perf_counter() - t0,
                                  grad_norm=norm, lr=1e-3, skipped_steps=0)
            out.write(record)
            expected.append((loss.item(), norm.item(), 32 / record.step_time_s))
    with MetricsWriter(path, append=True) as out:  # a resumed run adds its steps
        out.write(figures.step(step=3, loss=float("nan"), tokens=32, step_time_s=0.5))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row, (loss, norm, tps) in zip(rows, expected):
        assert KEYS <= set(row)
        assert row["loss"] == pytest.approx(loss) and row["grad_norm"] == pytest.approx(norm)
        assert row["tokens_per_s"] == pytest.approx(tps) and row["lr"] == 1e-3
        assert row["mfu"] is None and row["fp8_aware_mfu"] is None and row["peak_memory_bytes"] > 2**20
    assert rows[2]["loss"] is None and rows[2]["grad_norm"] is None  # not finite / not given: null


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    record = TrainingFigures(build_llama("tiny"), seq_len=16).step(step=7, loss=2.5, tokens=64, step_time_s=0.25,
                                                                   grad_norm=1.25, lr=3e-4)
    with MetricsWriter(None, tensorboard_dir=tmp_path / "tb") as out:
        out.write(record)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s"} <= set(events.Tags()["scalars"])
    (loss,) = events.Scalars("train/loss")
    assert (loss.step, loss.value) == (7, 2.5)


def test_tensorboard_purge_step_hides_what_a_resumed_run_logs_again(tmp_path):
    """Steps 1-5 logged, then a run resumed at step 3 logs 4-6: TensorBoard shows each step once, the new value."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    figures = TrainingFigures(build_llama("tiny"), seq_len=16)
    for steps, loss, purge in ((range(1, 6), 2.0, None), (range(4, 7), 1.0, 4)):
        with MetricsWriter(None, tensorboard_dir=tmp_path / "tb", purge_step=purge) as out:
            for step in steps:
                out.write(figures.step(step=step, loss=loss, tokens=64, step_time_s=0.25))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.0), (2, 2.0), (3, 2.0), (4, 1.0),
                                                                         (5, 1.0), (6, 1.0)]
