"""MS-AMP wiring, checked on CPU through a STAND-IN of MS-AMP's API (tests/standins, not MS-AMP itself):
initialize gets the model, the optimizer built from the spec and the opt level; DDP wraps the converted model;
what MS-AMP cannot do is a clear error. The real MS-AMP runs in tests/test_fp8_gpu.py on a CUDA machine."""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from helpers import BATCH, SEQ
from standin import drop_standins, use_standins
from torch import nn

from fp8dist import get_plan, wrap_model
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama
from fp8dist.plan.precision import FP8UnavailableError


@pytest.fixture
def standin_msamp():
    use_standins()
    yield
    drop_standins()


def test_initialize_gets_model_optimizer_and_opt_level(standin_msamp):
    import msamp

    model, optimizer = wrap_model(build_llama("tiny"), strategy="none", fp8="msamp", opt_level="O1",
                                  optimizer={"type": "AdamW", "lr": 1e-3, "weight_decay": 0.0})
    assert msamp.INIT_CALLS[-1] == ("O1", "AdamW", sum(1 for _ in model.parameters()))
    assert type(optimizer) is msamp.LBAdamW and optimizer.defaults["lr"] == 1e-3
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}, "the optimizer holds the converted model's parameters"
    assert sum(type(m) is msamp.FP8Linear for m in model.modules()) == 15
    assert len(get_plan(model).fp8) == 15


def test_msamp_needs_an_optimizer_and_all_linears_eligible(standin_msamp):
    with pytest.raises(ValueError, match=r"fp8='msamp' owns the optimizer: pass optimizer="):
        wrap_model(build_llama("tiny"), strategy="none", fp8="msamp")
    with pytest.raises(ValueError, match=r"converts every nn.Linear.*\['lm_head'\]"):
        wrap_model(build_llama("tiny"), strategy="none", fp8="msamp", fp8_exclude=["lm_head"],
                   optimizer={"type": "AdamW"})
    with pytest.raises(ValueError, match="needs torch.optim.Adam or AdamW.*got SGD"):
        wrap_model(build_llama("tiny"), strategy="none", fp8="msamp", optimizer={"type": "SGD", "lr": 0.1})
    with pytest.raises(ValueError, match="optimizer type='Adamm'.*Did you mean 'Adam'"):
        wrap_model(nn.Linear(16, 16), strategy="none", optimizer={"type": "Adamm"})


def test_combinations_msamp_cannot_do_are_config_errors():
    # the ways out come from the combination table: what would combine with each value as given
    with pytest.raises(ValueError, match="fp8='msamp' with strategy='fsdp'.*With strategy='fsdp' use fp8='te' or "
                                         "'torchao'; with fp8='msamp' use strategy='none', 'ddp' or 'deepspeed'"):
        wrap_model(build_llama("tiny"), strategy="fsdp", fp8="msamp")
    with pytest.raises(ValueError, match="opt_level='O3' with strategy='ddp'.*With strategy='ddp' use "
                                         "opt_level='O1' or 'O2'; with opt_level='O3' use strategy='deepspeed'"):
        wrap_model(build_llama("tiny"), strategy="ddp", fp8="msamp", opt_level="O3")


def test_real_msamp_is_gated():
    drop_standins()
    with pytest.raises(FP8UnavailableError, match="MS-AMP is not installed"):
        wrap_model(build_llama("tiny"), strategy="none", fp8="msamp", optimizer={"type": "AdamW"})


def _ddp_case(rank: int, world: int) -> dict:
    use_standins()
    import msamp
    from torch.nn.parallel import DistributedDataParallel

    model, optimizer = wrap_model(build_llama("tiny", seed=0), strategy="ddp", fp8="msamp",
                                  optimizer={"type": "AdamW", "lr": 3e-3})
    batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world)
    losses = []
    for step in range(4):
        ids = batches[step]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return dict(ddp=isinstance(model, DistributedDataParallel), opt=type(optimizer).__name__,
                fp8_linears=sum(type(m) is msamp.FP8Linear for m in model.module.modules()),
                same_params={id(p) for g in optimizer.param_groups for p in g["params"]}
                == {id(p) for p in model.parameters()}, losses=losses, opt_level=msamp.INIT_CALLS[-1][0])


def test_msamp_under_ddp_initializes_before_wrapping():
    for r in run_ranks(_ddp_case):
        assert r["ddp"] and r["opt"] == "LBAdamW" and r["fp8_linears"] == 15 and r["same_params"]
        assert r["opt_level"] == "O2", "O2 is the default, as in Accelerate"
        assert r["losses"][-1] < r["losses"][0]


def test_optimizer_spec_works_for_every_backend():
    model, optimizer = wrap_model(nn.Linear(16, 16), strategy="none", optimizer=lambda ps: torch.optim.SGD(ps, 0.1))
    assert isinstance(optimizer, torch.optim.SGD)
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}


def _deepspeed_case(rank: int, world: int) -> dict:
    use_standins()
    import msamp
    import msamp.deepspeed
    from helpers import engine_losses

    engine, optimizer = wrap_model(build_llama("tiny", seed=0), strategy="deepspeed", zero_stage=3, fp8="msamp",
                                   opt_level="O3", micro_batch_size=BATCH // world,
                                   optimizer={"type": "AdamW", "lr": 3e-3})
    return dict(block=msamp.deepspeed.CALLS[-1], init_calls=len(msamp.INIT_CALLS),
                fp8_linears=sum(type(m) is msamp.FP8Linear for m in engine.module.modules()),
                stage=engine.zero_optimization_stage(), losses=engine_losses(engine, rank, world))


def test_msamp_under_deepspeed_goes_through_its_own_entry_point():
    for r in run_ranks(_deepspeed_case, timeout=400):
        assert r["block"] == {"enabled": True, "opt_level": "O3"}, "the msamp config block reaches MS-AMP"
        assert r["init_calls"] == 0, "msamp.initialize is not used under DeepSpeed"
        assert r["fp8_linears"] == 15 and r["stage"] == 3
        assert r["losses"][-1] < r["losses"][0]
