"""Transformer Engine wiring, checked on CPU through a STAND-IN of TE's API (tests/standins, not TE itself):
which modules are swapped, weights copied exactly, the recipe and the world group reaching fp8_autocast under
every strategy, eval turning FP8 off. The real TE runs in tests/test_fp8_gpu.py on a CUDA machine."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from helpers import BATCH, engine_losses, train_losses
from standin import drop_standins, use_standins
from torch import nn

import fp8dist
from fp8dist import get_plan, wrap_model
from fp8dist.models import build_llama
from fp8dist.plan import FP8UnavailableError


@pytest.fixture
def standin_te():
    use_standins()
    yield
    drop_standins()


class Mixed(nn.Module):
    """An eligible Linear, an odd one in the middle, then more eligible layers: conversion must not stop."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 30)
        self.norm = nn.LayerNorm(30)
        self.back = nn.Linear(30, 32, bias=False)
        self.out = nn.Linear(32, 48)
        self.rms = nn.RMSNorm(48, eps=1e-6)

    def forward(self, x):
        return self.rms(self.out(self.back(self.norm(self.odd(self.up(x))))))


def test_swaps_eligible_modules_copies_weights_and_skips_the_rest(standin_te):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    model = Mixed()
    original = copy.deepcopy(model)
    x = torch.randn(4, 32)
    wrapped = wrap_model(model, strategy="none", fp8="te", param_dtype="fp32")
    plan = get_plan(wrapped)
    assert [(e.name, e.precision, e.converted_to) for e in plan] == [
        ("up", "fp8", "te.Linear"), ("odd", "fp32", None), ("norm", "fp32", "te.LayerNorm"),
        ("back", "fp32", None), ("out", "fp8", "te.Linear"), ("rms", "fp32", "te.RMSNorm")]
    assert "in_features=30 not divisible by 16" in plan.by_name("back").reason
    assert "out_features=30 not divisible by 16" in plan.by_name("odd").reason
    assert type(wrapped.up) is te.Linear and type(wrapped.out) is te.Linear, "converted past the odd layer"
    assert type(wrapped.odd) is nn.Linear and type(wrapped.back) is nn.Linear
    assert type(wrapped.norm) is te.LayerNorm and type(wrapped.rms) is te.RMSNorm and wrapped.rms.eps == 1e-6
    for name, tensor in original.state_dict().items():
        assert torch.equal(wrapped.state_dict()[name], tensor), f"{name} copied exactly"
    assert torch.equal(wrapped(x), original(x)), "the stand-in computes the same math: only the classes changed"


def test_llama_rmsnorm_is_swapped_with_its_epsilon(standin_te):
    import transformer_engine.pytorch as te

    model = wrap_model(build_llama("tiny"), strategy="none", fp8="te")
    assert type(model.model.norm) is te.RMSNorm and model.model.norm.eps == model.config.rms_norm_eps
    assert sum(type(m) is te.Linear for m in model.modules()) == 15, "TE converts first and last Linear too"


def test_recipes_by_name_and_interval_warning(standin_te):
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    for name, cls in (("current", recipe.Float8CurrentScaling), ("mxfp8", recipe.MXFP8BlockScaling)):
        model = wrap_model(Mixed(), strategy="none", fp8="te", te_recipe=name, fp8_format="E4M3")
        model(torch.randn(2, 32))
        assert te.AUTOCAST_CALLS[-1][1] == cls(fp8_format=recipe.Format.E4M3)
    with pytest.warns(UserWarning, match="interval=4: Transformer Engine 2.x .* has no interval"):
        wrap_model(Mixed(), strategy="none", fp8="te", interval=4)


def test_real_te_is_gated_with_a_clear_error_or_an_announced_fallback():
    drop_standins()
    with pytest.raises(FP8UnavailableError, match="fp8='te' cannot run here: Transformer Engine is not installed"
                                                  ".*on_unsupported='fallback'"):
        wrap_model(Mixed(), strategy="none", fp8="te")
    with pytest.warns(UserWarning, match="fp8='te': fallback: Transformer Engine is not installed") as caught:
        model = wrap_model(Mixed(), strategy="none", fp8="te", on_unsupported="fallback")
    assert len([w for w in caught if "fallback" in str(w.message)]) == 1, "one warning"
    assert not get_plan(model).fp8 and all("on_unsupported='fallback'" in e.reason for e in get_plan(model))
    assert all(type(m).__module__.startswith("torch.") for m in model.modules() if m is not model)


def _te_rank_case(rank: int, world: int, strategy: str) -> dict:
    use_standins()
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    group = dist.new_group([0, 1])
    ds = dict(micro_batch_size=BATCH // world, optimizer={"type": "AdamW", "lr": 1e-3}) \
        if strategy == "deepspeed" else {}
    model = wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8="te", fp8_format="E4M3",
                       amax_history_len=16, amax_compute_algo="most_recent", margin=1,
                       override_linear_precision=(False, False, True), **ds)
    if strategy == "deepspeed":
        model = model[0]
        losses = engine_losses(model, rank, world, steps=2)
    else:
        losses = train_losses(model, rank, world, steps=2)
    train_call = te.AUTOCAST_CALLS[-1]
    rows = {row.part: row for row in fp8dist.report(model).rows}
    inner = model.module if hasattr(model, "module") else model
    # isinstance: FSDP2 gives each module it shards a subclass of its own (lm_head, in the final norm + output unit)
    fp8_forwards = {n: m.fp8_forwards for n, m in inner.named_modules() if isinstance(m, te.Linear)}
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    eval_call = te.AUTOCAST_CALLS[-1]
    custom = wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8="te", fp8_group=group,
                        use_autocast_during_eval=True, **ds)
    custom = custom[0] if strategy == "deepspeed" else custom
    custom.eval()
    with torch.no_grad():
        custom(input_ids=torch.zeros(1, 8, dtype=torch.long))
    expected = recipe.DelayedScaling(margin=1, fp8_format=recipe.Format.E4M3, amax_history_len=16,
                                     amax_compute_algo="most_recent", override_linear_precision=(False, False, True))
    return dict(losses=losses, train_enabled=train_call[0], recipe_ok=train_call[1] == expected,
                world_group=train_call[2] is dist.group.WORLD, fp8_forwards=fp8_forwards,
                eval_enabled=eval_call[0], custom_group=te.AUTOCAST_CALLS[-1][2] is group,
                custom_eval_enabled=te.AUTOCAST_CALLS[-1][0],
                prepared=list(te.distributed.PREPARED), report_gemm=rows["fp8_gemm"].gemm,
                report_fp8_modules=rows["fp8_gemm"].modules)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1", "ddp", "deepspeed"])
def test_autocast_gets_recipe_and_world_group_under_each_strategy(strategy):
    for r in run_ranks(_te_rank_case, strategy):
        assert r["train_enabled"] and r["recipe_ok"] and r["world_group"]
        assert r["report_gemm"] == "fp8 e4m3 (DelayedScaling)", "fp8dist.report reads the recipe on the forward"
        assert r["report_fp8_modules"] == len(r["fp8_forwards"])
        assert len(r["fp8_forwards"]) == 15 and all(n > 0 for n in r["fp8_forwards"].values()), \
            "every te.Linear ran inside the FP8 autocast (FSDP2 did not lose it)"
        assert r["eval_enabled"] is False, "eval turns FP8 autocast off"
        assert r["custom_group"] and r["custom_eval_enabled"] is True
        assert r["prepared"] == (["FullyShardedDataParallel"] * 2 if strategy == "fsdp1" else [])
        assert r["losses"][1] < r["losses"][0]
