"""What wrap_model did is recorded as data (WrapInfo), and fp8dist.unwrap_model reaches the user's model inside
every strategy's wrapper: nothing depends on attributes stuck onto forward(), so wrapping forward again (a user,
torch.compile) changes nothing fp8dist reports."""

from __future__ import annotations

import functools

import pytest
import torch

from fp8dist import get_wrap_info, report, sharding_summary, unwrap_model, wrap_model
from fp8dist.train.models import build_llama


@pytest.mark.parametrize("strategy,wrapper", [("fsdp", None), ("fsdp1", "FullyShardedDataParallel"),
                                              ("ddp", "DistributedDataParallel"), ("none", None)])
def test_unwrap_model_returns_the_users_model_inside_each_wrapper(one_rank_group, strategy, wrapper):
    model = build_llama("tiny", seed=0)
    wrapped = wrap_model(model, strategy=strategy)
    assert unwrap_model(wrapped) is model
    assert (type(wrapped).__name__ == wrapper) if wrapper else wrapped is model


@pytest.mark.parametrize("strategy,autocast", [("ddp", torch.bfloat16), ("none", torch.bfloat16), ("fsdp", None)])
def test_the_autocast_is_recorded_and_survives_forward_being_wrapped_again(one_rank_group, strategy, autocast):
    wrapped = wrap_model(build_llama("tiny", seed=0), strategy=strategy)
    assert get_wrap_info(wrapped).sharding.autocast == autocast
    inner = unwrap_model(wrapped)
    forward = inner.forward
    inner.forward = functools.wraps(forward)(lambda *a, **k: forward(*a, **k))  # what a user or a compiler does
    assert sharding_summary(wrapped).compute_dtype == "bf16"
    ids = torch.randint(0, 256, (2, 16))
    out = wrapped(input_ids=ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16, "the forward still runs under the recorded autocast / FSDP's cast"


def test_torchao_scale_precompute_is_recorded_under_fsdp_only(one_rank_group):
    fsdp = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="torchao")
    ddp = wrap_model(build_llama("tiny", seed=0), strategy="ddp", fp8="torchao")
    assert get_wrap_info(fsdp).fp8.scale_precompute and not get_wrap_info(ddp).fp8.scale_precompute
    assert get_wrap_info(fsdp).fp8.autocast_recipe is None
    rows = {row.part.value: row for row in report(fsdp).rows}
    assert rows["fp8_gemm"].all_gather == "fp8 e4m3 (FP8 all-gather)"
