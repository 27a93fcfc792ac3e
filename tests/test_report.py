"""fp8dist.report on live wrapped models (2 real gloo ranks): the dtypes read from the engines match the
configuration, and the bytes per parameter are exactly what a hand count of the tensors gives. DeepSpeed's report
(dtypes and bytes) is checked in test_estimate.py's ZeRO-1/2/3 spawn, to start DeepSpeed once."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_harness import run_ranks
from helpers import BATCH, SEQ
from torch import nn

import fp8dist
from fp8dist.data import Batches
from fp8dist.models import build_llama

# (strategy, fp8, extra options) run on the tiny Llama
CASES = [("fsdp", None, {}), ("fsdp", "torchao", {}), ("fsdp", None, {"reduce_dtype": "bf16"}),
         ("fsdp1", None, {}), ("fsdp1", "torchao", {}), ("ddp", None, {}), ("ddp", "torchao", {})]
HIDDEN, LAYERS = 64, 4  # the hand-countable model: LAYERS bias-free Linear(HIDDEN, HIDDEN)


class Stack(nn.Module):
    """Four square Linears: every parameter count and shard size is easy to compute by hand. One FSDP group
    (no ModuleList): a group of FP8 weights alone would all-gather float8 tensors, which gloo cannot carry."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)))

    def forward(self, x):
        return self.layers(x)


def _one_step(model, optimizer, rank, world):
    ids = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def _rows(rep) -> dict:
    return {r.part: r for r in rep.rows}


def _report_case(rank: int, world: int) -> dict:
    out: dict = {}
    for strategy, fp8, options in CASES:
        model, opt = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8=fp8,
                                        optimizer={"type": "AdamW", "lr": 1e-3}, **options)
        _one_step(model, opt, rank, world)
        rep = fp8dist.report(model, opt)
        out[(strategy, fp8, tuple(options.items()))] = dict(
            rows=_rows(rep), bytes_per_param=rep.bytes_per_param, text=str(rep),
            plan_fp8=sum(e.params for e in fp8dist.get_plan(model) if e.precision == "fp8"))
    for strategy, fp8 in (("fsdp", None), ("fsdp", "torchao"), ("ddp", None)):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no blocks found: all parameters are gathered at once", as meant
            model = fp8dist.wrap_model(Stack(), strategy=strategy, fp8=fp8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(8, HIDDEN)).sum().backward()
        opt.step()
        rep = fp8dist.report(model, opt)
        out[("stack", strategy, fp8)] = dict(bytes=dict(rep.bytes), total=rep.total_params,
                                             per_param=rep.bytes_per_param, rows=_rows(rep))
    return out


def test_report_on_live_models_reads_the_engines_and_counts_bytes_exactly():
    """One spawn for every case (start-up dominates on CPU); each check below is a function of its own."""
    reports = run_ranks(_report_case, timeout=300)
    _fsdp_reads_bf16_compute_fp32_reduce_and_fp8_only_where_planned(reports)
    _fsdp1_ddp_read_their_policies_and_hooks(reports)
    _bytes_per_param_exact_for_a_hand_counted_model(reports)
    _report_prints_both_tables(reports)


def _fsdp_reads_bf16_compute_fp32_reduce_and_fp8_only_where_planned(reports):
    for r in reports:
        bf16 = r[("fsdp", None, ())]["rows"]
        assert "FP8 Linear" not in bf16, "no FP8 GEMM without an FP8 backend"
        linear = bf16["Linear (high precision)"]
        assert (linear.gemm, linear.all_gather, linear.reduce, linear.weight) == ("bf16", "bf16", "fp32", "fp32")
        assert (linear.weight_grad, linear.optimizer_states, linear.master_weight) == \
            ("fp32", "fp32+fp32", "n/a (the stored weight)")
        case = r[("fsdp", "torchao", ())]
        fp8 = case["rows"]["FP8 Linear"]
        assert fp8.gemm == "fp8 e4m3 fwd, e5m2 grads (tensorwise)"
        assert fp8.all_gather == "fp8 e4m3 (FP8 all-gather)", "torchao's FP8 all-gather is visible on the weights"
        assert fp8.params == case["plan_fp8"] == 376_832 and fp8.modules == 13, "FP8 exactly where the plan says"
        kept = case["rows"]["Linear (high precision)"]
        assert (kept.gemm, kept.all_gather, kept.modules) == ("bf16", "bf16", 2), "first/last Linear stay bf16"
        assert r[("fsdp", None, (("reduce_dtype", "bf16"),))]["rows"]["Linear (high precision)"].reduce == "bf16"
        assert case["bytes_per_param"]["parameters"] == pytest.approx(2.0, abs=0.01), "fp32 sharded over 2 ranks"


def _fsdp1_ddp_read_their_policies_and_hooks(reports):
    for r in reports:
        fsdp1 = r[("fsdp1", "torchao", ())]["rows"]
        assert fsdp1["FP8 Linear"].all_gather == "bf16", "FSDP1 has no FP8 all-gather: weights gather in bf16"
        assert fsdp1["FP8 Linear"].params == 376_832, "full sizes, not FSDP1's per-rank views"
        assert fsdp1["Linear (high precision)"].reduce == "fp32"
        for strategy in ("fsdp1", "ddp"):
            rows = r[(strategy, None, ())]["rows"]
            assert "FP8 Linear" not in rows and rows["Linear (high precision)"].gemm == "bf16", strategy
            assert (rows["Linear (high precision)"].weight, rows["Linear (high precision)"].weight_grad) == \
                ("fp32", "fp32"), strategy
        ddp = r[("ddp", "torchao", ())]
        rows = ddp["rows"]
        assert rows["FP8 Linear"].gemm.startswith("fp8 e4m3 fwd")
        assert (rows["Linear (high precision)"].gemm, rows["Linear (high precision)"].all_gather) == \
            ("bf16", "none (replicated)"), "DDP: bf16 autocast, nothing gathered"
        assert rows["Linear (high precision)"].weight == "fp32"
        assert ddp["bytes_per_param"]["gradients"] == pytest.approx(4.0, abs=0.01), \
            "fp32 gradients as views of DDP's buckets: one copy"


def _bytes_per_param_exact_for_a_hand_counted_model(reports):
    n = LAYERS * HIDDEN * HIDDEN  # 16,384 parameters
    step_tensors = LAYERS * 4  # AdamW keeps one fp32 `step` scalar per parameter
    for rank, r in enumerate(reports):
        for fp8, scales in ((None, 0), ("torchao", 2 * 4)):  # one fp32 scale per FP8 weight (2 of 4 convert),
            fsdp = r[("stack", "fsdp", fp8)]                    # precomputed after the step for the FP8 all-gather
            assert fsdp["total"] == n
            assert fsdp["bytes"] == {"parameters": 4 * n // 2, "master_weights": 0, "gradients": 4 * n // 2,
                                     "optimizer_states": 2 * 4 * n // 2 + step_tensors, "fp8_buffers": scales}, rank
            assert fsdp["per_param"]["total"] == ((4 + 4 + 8) / 2 * n + step_tensors + scales) / n
        ddp = r[("stack", "ddp", None)]
        assert ddp["bytes"] == {"parameters": 4 * n, "master_weights": 0, "gradients": 4 * n,
                                "optimizer_states": 2 * 4 * n + step_tensors, "fp8_buffers": 0}
    assert reports[0][("stack", "fsdp", "torchao")]["rows"]["FP8 Linear"].modules == LAYERS - 2


def _report_prints_both_tables(reports):
    text = reports[0][("fsdp", "torchao", ())]["text"]
    assert text.startswith("fp8dist report: strategy fsdp, fp8 torchao, rank 0 of 2, 459,392 parameters")
    for header in ("part", "GEMM", "all-gather", "reduce", "master weight", "weight grad", "optimizer states",
                   "model state (this rank)", "bytes/param", "total model states"):
        assert header in text


def test_report_without_distribution_and_before_any_step():
    plain = _rows(fp8dist.report(fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none")))
    assert "FP8 Linear" not in plain and plain["Linear (high precision)"].gemm == "bf16", "bf16 autocast, no FP8"
    model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao")
    rep = fp8dist.report(model)
    rows = _rows(rep)
    assert rows["Linear (high precision)"].gemm == "bf16" and rows["Linear (high precision)"].reduce == "none"
    assert rows["FP8 Linear"].weight_grad == "none held now (report after backward)"
    assert rows["FP8 Linear"].optimizer_states == "none yet (after the first step)"
    assert rep.bytes["parameters"] == 4 * 459_392 and rep.bytes["gradients"] == rep.bytes["optimizer_states"] == 0
    with pytest.raises(ValueError, match="was not returned by fp8dist.wrap_model"):
        fp8dist.report(build_llama("tiny"))
