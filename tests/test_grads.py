"""Gradient accumulation (fp8dist.no_sync) and clipping (fp8dist.clip_grad_norm_) on 2 gloo ranks under every
strategy that runs them: 4 accumulated micro-batches give the gradients of one batch 4x the size with one gradient
reduction per step (counted), and the returned norm and clipped gradients are the hand-computed ones."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from dist_harness import run_ranks

import fp8dist
from fp8dist.bench.comm import CommCounter
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

STRATEGIES = ("fsdp", "fsdp1", "ddp", "none")
MICRO = 4
REDUCTIONS = ("reduce_scatter", "all_reduce")


def _wrap(base, strategy: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # strategy none in a 2-process group says so
        return fp8dist.wrap_model(copy.deepcopy(base), strategy=strategy, param_dtype="fp32")


def _full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, by name (FSDP2's DTensor shards gathered; FSDP1 summoned)."""
    if hasattr(model, "summon_full_params"):  # FSDP1
        with model.summon_full_params(model, with_grads=True):
            return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name.removeprefix("module.")] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _reductions(counter: CommCounter) -> int:
    counts = counter.counts.to_dict()
    return sum(counts.get(kind, {}).get("calls", 0) for kind in REDUCTIONS)


def _case(rank: int, world: int) -> dict:
    base = build_llama("tiny", seed=0)
    ids = Batches(batch_size=MICRO * 2, seq_len=32, rank=rank, world_size=world, seed=0)[0]
    out = {}
    for strategy in STRATEGIES:
        one = _wrap(base, strategy)
        with CommCounter() as whole:
            one(input_ids=ids, labels=ids).loss.backward()
        accumulated = _wrap(base, strategy)
        per_micro = []
        for i, chunk in enumerate(ids.chunk(MICRO)):
            with CommCounter() as counter, fp8dist.no_sync(accumulated, last=i == MICRO - 1):
                (accumulated(input_ids=chunk, labels=chunk).loss / MICRO).backward()
            per_micro.append(_reductions(counter))
        a, b = _full_grads(one), _full_grads(accumulated)
        diff = max((a[n] - b[n]).abs().max().item() for n in a)
        # clipping: the norm over the whole gradients, by hand, then the clipped gradients
        norm_by_hand = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in a.values()]))
        max_norm = norm_by_hand.item() / 4
        norm = fp8dist.clip_grad_norm_(one, max_norm)
        clipped = _full_grads(one)
        coef = max_norm / (norm_by_hand.item() + 1e-6)
        clip_diff = max((clipped[n] - a[n] * coef).abs().max().item() for n in a)
        out[strategy] = dict(names=sorted(a) == sorted(b), diff=diff, per_micro=per_micro,
                             whole=_reductions(whole), norm=norm.item(), by_hand=norm_by_hand.item(),
                             norm_type=type(norm).__name__, clip_diff=clip_diff)
    return out


def test_accumulation_reduces_once_and_clipping_returns_the_global_norm():
    for rank, r in enumerate(run_ranks(_case)):
        for strategy in STRATEGIES:
            s = r[strategy]
            assert s["names"], strategy
            assert s["diff"] < 1e-6, f"rank {rank} {strategy}: accumulated vs one batch, max |diff| {s['diff']}"
            if strategy == "none":
                assert s["per_micro"] == [0, 0, 0, 0] and s["whole"] == 0
            else:
                assert s["whole"] > 0
                assert s["per_micro"] == [0, 0, 0, s["whole"]], f"{strategy}: reductions per micro-batch"
            assert s["norm_type"] == "Tensor"
            assert abs(s["norm"] - s["by_hand"]) <= 1e-5 * s["by_hand"], f"rank {rank} {strategy}"
            assert s["clip_diff"] < 1e-6, f"rank {rank} {strategy}: clipped gradients"


@pytest.mark.parametrize("call,message", [
    (lambda m: fp8dist.clip_grad_norm_(m, 0), "max_norm=0 must be a positive number"),
    (lambda m: fp8dist.clip_grad_norm_(m, float("nan")), "max_norm=nan must be a positive number"),
])
def test_bad_max_norm_is_a_clear_error(call, message):
    model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none", param_dtype="fp32")
    with pytest.raises(ValueError, match=message):
        call(model)


def test_a_model_not_from_wrap_model_is_a_clear_error():
    with pytest.raises(ValueError, match="was not returned by fp8dist.wrap_model"):
        with fp8dist.no_sync(build_llama("tiny", seed=0)):
            pass
