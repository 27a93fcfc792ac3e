"""A non-finite step never reaches the weights (fp8dist/runtime/guard.py): one batch whose forward makes an inf, on 2 gloo
ranks. Under fsdp + torchao, fsdp1, ddp and none the step is skipped on every rank (under "none" the other rank's
gradients were finite: the ranks agree through one reduction), its weights and optimizer state are bit-identical to
before it, and the losses after it equal those of a run that never saw that batch; the skip is warned about and
counted. DeepSpeed's engine skips by its own check (bf16 check_grad_overflow), counted the same way. Consecutive
bad steps raise, naming the way out."""

from __future__ import annotations

import warnings

import pytest
import torch

from dist_harness import run_ranks

BAD = 2  # the batch whose forward makes an inf (on rank 0 only)
N = 5


def _poison(model, rank: int, bad: bool):
    """A forward hook on one Linear that turns its output to inf, on rank 0 for the bad batch."""
    from fp8dist import unwrap_model

    if not bad or rank != 0:
        return None
    layer = unwrap_model(model).model.layers[1].mlp.down_proj
    return layer.register_forward_hook(lambda module, args, out: out * float("inf"))


def _steps(model, optimizer, batches, rank: int, bad_at: int | None = None, engine: bool = False) -> list[float]:
    losses = []
    for i, ids in batches:
        hook = _poison(model, rank, i == bad_at)
        loss = model(input_ids=ids, labels=ids).loss
        (model.backward(loss), model.step()) if engine else loss.backward()
        if hook is not None:
            hook.remove()
        if not engine:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _plain(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` as a plain tensor (a DTensor's shard, torchao's FP8 weight wrapper unwrapped)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    t = t.dequantize() if type(t).__name__.startswith("OptimState") else t  # memory="lean": 8-bit AdamW states
    return getattr(t, "_tensor", t).detach().clone()


def _state(model, optimizer) -> list[torch.Tensor]:
    """This rank's weights and optimizer state, as plain local tensors (shards under FSDP)."""
    local = [_plain(p) for p in model.parameters()]
    for per_param in (optimizer.state.values() if optimizer is not None else ()):
        local += [_plain(v) for v in per_param.values() if torch.is_tensor(v)]
    return local


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _cases(rank: int, world: int) -> dict:
    import fp8dist
    from fp8dist.train.data import Batches
    from fp8dist.runtime.guard import NonFiniteStepsError
    from fp8dist.train.models import build_llama

    data = Batches(batch_size=2 * world, seq_len=32, rank=rank, world_size=world, seed=0)
    batches = [(i, data[i]) for i in range(N)]
    # a NaN loss makes every gradient NaN: every module holding parameters is named (8, then "and N more")
    out = {"modules": len({n.rpartition(".")[0] for n, _ in build_llama("tiny").named_parameters()})}
    for strategy, fp8 in (("fsdp", "torchao"), ("fsdp1", None), ("ddp", None), ("none", None)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8=fp8)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            _steps(model, opt, batches[:BAD], rank)
            before = _state(model, opt)
            bad_loss = _steps(model, opt, batches[BAD:BAD + 1], rank, bad_at=BAD)[0]
            same = _equal(before, _state(model, opt))
            after = _steps(model, opt, batches[BAD + 1:], rank)
        said = [str(w.message) for w in caught if "skipped: non-finite gradients" in str(w.message)]
        twin = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8=fp8)
        twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
        never = _steps(twin, twin_opt, [b for b in batches if b[0] != BAD], rank)[BAD:]
        out[strategy] = dict(same=same, after=after, never=never, bad_loss=bad_loss, said=said,
                             skipped=fp8dist.get_wrap_info(model).skipped_steps)
    model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="ddp", max_skipped_steps=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _steps(model, opt, batches[:1], rank, bad_at=0)
        try:
            _steps(model, opt, batches[1:2], rank, bad_at=1)
            out["raised"] = None
        except NonFiniteStepsError as err:
            out["raised"] = str(err)
        engine, _ = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="deepspeed",
                                       micro_batch_size=2, optimizer={"type": "AdamW", "lr": 1e-2})
        _steps(engine, None, batches[:BAD], rank, engine=True)
        before = [p.detach().clone() for p in engine.parameters()]
        _steps(engine, None, batches[BAD:BAD + 1], rank, bad_at=BAD, engine=True)
        out["deepspeed"] = dict(same=_equal(before, [p.detach() for p in engine.parameters()]),
                                skipped=fp8dist.get_wrap_info(engine).skipped_steps)
    return out


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("torchao", reason="torchao is not installed")
    return run_ranks(_cases, world_size=2, timeout=600)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1", "ddp", "none"])
def test_a_non_finite_step_leaves_weights_and_state_as_if_the_batch_was_never_seen(results, strategy):
    for rank, out in enumerate(results):
        case = out[strategy]
        assert case["bad_loss"] != case["bad_loss"] or rank == 1, "the planted batch really was non-finite (rank 0)"
        assert case["same"], f"rank {rank}: weights or optimizer state changed in the skipped step"
        assert case["after"] == case["never"], (rank, case["after"], case["never"])
        assert case["skipped"] == 1
        assert len(case["said"]) == 1 and case["said"][0].startswith(
            "step 3 skipped: non-finite gradients in model.embed_tokens, model.layers.0."), case["said"]
        assert f" and {out['modules'] - 8} more on some rank; weights and optimizer state are as before" in \
            case["said"][0]


def test_consecutive_non_finite_steps_raise_on_every_rank_with_the_way_out(results):
    for out in results:
        assert out["raised"].startswith("2 consecutive steps had non-finite gradients (the last in ")
        assert "Lower the learning rate" in out["raised"] and "fp8_exclude" in out["raised"]


def test_deepspeeds_own_check_skips_and_fp8dist_counts_it(results):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    for out in results:
        assert out["deepspeed"] == dict(same=True, skipped=1)


def test_error_mode_raises_before_anything_changes():
    import fp8dist
    from fp8dist.runtime.guard import NonFiniteStepsError
    from fp8dist.train.models import build_llama

    model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none", nonfinite_step="error")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    hook = _poison(model, 0, True)
    model(input_ids=ids, labels=ids).loss.backward()
    hook.remove()
    with pytest.raises(NonFiniteStepsError, match=r"^step 1: non-finite gradients in .*nothing was updated"):
        opt.step()
    assert _equal(before, [p.detach() for p in model.parameters()]) and not opt.state
    off = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none", nonfinite_step="off")
    assert fp8dist.get_wrap_info(off).guard is None


def test_fp8_health_is_sampled_after_the_steps_of_the_users_own_optimizer(tmp_path):
    """FP8Telemetry(model, every=2) with no optimizer given: steps 0 and 2 of 4 are sampled after the steps of an
    optimizer it never saw (fp8dist's step registry), one JSON line each, one layer entry per FP8 layer."""
    import json

    import fp8dist
    from fp8dist.train.models import build_llama
    from fp8dist.numerics import FP8Telemetry

    path = tmp_path / "health.jsonl"
    model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao")
    telemetry = FP8Telemetry(model, every=2, jsonl=path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(4):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in telemetry.records] == [r["step"] for r in lines] == [0, 2]
    assert len(lines[0]["layers"]) == len(fp8dist.get_plan(model).fp8)


HUGE = 1e24
"""A factor on one layer's output gradient: every gradient stays finite (at most ~1e24), their norm does not (the
squares pass float32's 3.4e38), and clipping by it zeroes every gradient: the step is non-finite all the same."""


def _blow_up(model, rank: int):
    """A forward hook on the last down_proj scaling its output gradient by :data:`HUGE`, on rank 0."""
    from fp8dist import unwrap_model

    def hook(module, args, out):
        out.register_hook(lambda g: g * HUGE)

    return unwrap_model(model).model.layers[1].mlp.down_proj.register_forward_hook(hook) if rank == 0 else None


def _finite_grads(model) -> bool:
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
    return all(bool(torch.isfinite(g).all()) for g in grads if g is not None)


def _norm_cases(rank: int, world: int) -> dict:
    """Per strategy: 2 clipped steps, then one whose gradients are finite and their norm inf (rank 0's)."""
    import fp8dist
    from fp8dist.train.data import Batches
    from fp8dist.train.models import build_llama

    data = Batches(batch_size=2 * world, seq_len=32, rank=rank, world_size=world, seed=0)
    out = {}
    for case, strategy, fp8, memory in (("fsdp", "fsdp", "torchao", "standard"), ("fsdp1", "fsdp1", None, "standard"),
                                        ("ddp", "ddp", None, "standard"), ("none", "none", None, "standard"),
                                        ("lean", "fsdp", "torchao", "lean")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8=fp8, memory=memory,
                                            optimizer={"type": "AdamW", "lr": 1e-2})
            for step in range(3):
                if step == 2:
                    before, hook = _state(model, opt), _blow_up(model, rank)
                model(input_ids=data[step], labels=data[step]).loss.backward()
                finite = _finite_grads(model)
                norm = float(fp8dist.clip_grad_norm_(model, 1.0))
                opt.step()
                opt.zero_grad(set_to_none=True)
            if hook is not None:
                hook.remove()
        out[case] = dict(finite=finite, norm=norm, same=_equal(before, _state(model, opt)),
                             skipped=fp8dist.get_wrap_info(model).skipped_steps,
                             said=[str(w.message) for w in caught if " skipped: " in str(w.message)])
    engine, _ = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="deepspeed", micro_batch_size=2,
                                   gradient_clipping=1.0, optimizer={"type": "AdamW", "lr": 1e-2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            if step == 2:
                before, hook = [p.detach().clone() for p in engine.parameters()], _blow_up(engine, rank)
            engine.backward(engine(input_ids=data[step], labels=data[step]).loss)
            engine.step()
        hook is not None and hook.remove()
    out["deepspeed"] = dict(same=_equal(before, [p.detach() for p in engine.parameters()]),
                            skipped=fp8dist.get_wrap_info(engine).skipped_steps,
                            norm=float(engine.get_global_grad_norm()))
    return out


@pytest.fixture(scope="module")
def norm_results():
    pytest.importorskip("torchao", reason="torchao is not installed")
    return run_ranks(_norm_cases, world_size=2, timeout=600)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1", "ddp", "none", "lean"])
def test_a_finite_gradient_whose_norm_is_inf_is_a_skipped_step_on_every_rank(norm_results, strategy):
    """Clipping by an inf norm zeroes every gradient, and AdamW would still move the weights by its momentum: the
    guard hears the norm from fp8dist.clip_grad_norm_ and skips the step on every rank (under "none" rank 1's own
    norm was finite), said and counted; "lean": memory="lean" under fsdp + torchao, its 8-bit AdamW."""
    for rank, out in enumerate(norm_results):
        case = out[strategy]
        assert case["finite"], f"rank {rank}: every gradient value was finite, only their norm was not"
        assert case["norm"] == float("inf") or (strategy == "none" and rank == 1), case["norm"]
        assert case["same"], f"rank {rank}: weights or optimizer state changed in the skipped step"
        assert case["skipped"] == 1
        assert case["said"] == ["step 3 skipped: non-finite gradients of norm inf, values past float32's range when "
                                "squared, on some rank; weights and optimizer state are as before the step (1 "
                                "skipped so far)."], case["said"]


def test_deepspeed_skips_a_step_whose_gradient_norm_is_inf_and_fp8dist_counts_it(norm_results):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    for out in norm_results:
        assert out["deepspeed"] == dict(same=True, skipped=1, norm=float("inf")), out["deepspeed"]


def test_a_second_clip_of_the_zeroed_gradients_does_not_undo_an_inf_norm():
    """Clipping twice (say, once to log): the first norm is inf and zeroes the gradients, the second reads 0. The step
    is still skipped: weights and optimizer state as before, counted."""
    import fp8dist
    from fp8dist.train.models import build_llama

    model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    before, hook = _state(model, opt), _blow_up(model, 0)
    model(input_ids=ids, labels=ids).loss.backward()
    hook.remove()
    norms = [float(fp8dist.clip_grad_norm_(model, 1.0)), float(fp8dist.clip_grad_norm_(model, 1.0))]
    with pytest.warns(RuntimeWarning, match=r"^step 2 skipped: non-finite gradients of norm inf"):
        opt.step()
    assert norms == [float("inf"), 0.0] and _equal(before, _state(model, opt))
    assert fp8dist.get_wrap_info(model).skipped_steps == 1
