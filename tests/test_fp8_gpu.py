"""Real FP8 on a CUDA GPU: torchao, Transformer Engine and MS-AMP, each where installed. Skipped, with the reason,
on machines without them (CI has no GPU): a skip here is never a pass."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from dist_harness import run_ranks

from fp8dist.config import resolve_config
from fp8dist.train import TrainConfig, run_training

pytestmark = pytest.mark.gpu

FP8_LOSS_TOLERANCE = 0.05  # mean of the last 5 of 40 steps, FP8 vs bf16, small Llama


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)


needs_fp8_gpu = pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _needs(package: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed")


def _losses(fp8: str | None, strategy: str = "none", **options) -> list[float]:
    job = TrainConfig(model_size="small", steps=40, seq_len=256, batch_size=8)
    return run_training(resolve_config(strategy=strategy, fp8=fp8, **options), job, log=lambda line: None).losses


def _close_to_bf16(fp8: str) -> None:
    bf16, ours = _losses(None), _losses(fp8)
    assert ours != bf16
    assert abs(sum(ours[-5:]) / 5 - sum(bf16[-5:]) / 5) < FP8_LOSS_TOLERANCE


@needs_fp8_gpu
def test_torchao_real_fp8_tracks_bf16():
    _close_to_bf16("torchao")


@needs_fp8_gpu
@_needs("transformer_engine")
def test_transformer_engine_real_fp8_tracks_bf16():
    _close_to_bf16("te")


def _te_amax_case(rank: int, world: int) -> list[torch.Tensor]:
    import transformer_engine.pytorch as te

    from fp8dist import wrap_model
    from fp8dist.data import Batches
    from fp8dist.models import build_llama

    model = wrap_model(build_llama("small", seed=0), strategy="ddp", fp8="te")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = Batches(batch_size=8, seq_len=128, rank=rank, world_size=world)[0].cuda()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    states = []
    for module in model.module.modules():
        if isinstance(module, te.Linear):
            meta = module.fp8_meta["scaling_fwd"]
            states += [meta.scale.detach().cpu(), meta.amax_history.detach().cpu()]
    return states


@needs_fp8_gpu
@needs_two
@_needs("transformer_engine")
def test_transformer_engine_amax_and_scales_identical_across_ranks():
    """The amax reduction over the world group makes every rank's FP8 scales identical after a step."""
    first, second = run_ranks(_te_amax_case, backend="nccl")
    assert first and all(torch.equal(a, b) for a, b in zip(first, second))


@needs_fp8_gpu
@_needs("msamp")
def test_msamp_real_fp8_trains():
    losses = _losses("msamp", opt_level="O2")
    assert losses[-1] < losses[0] - 1.0
