"""The optimizer-step hooks fp8dist installs: torchao's FP8 scale precompute keeps working model after model in one
process (a sweep, a notebook), and an optimizer built before wrap_model is stopped at its first step instead of
silently training nothing."""

from __future__ import annotations

import gc

import pytest
import torch

from fp8dist import wrap_model
from fp8dist.train.models import build_llama
from fp8dist.runtime.optim import StaleOptimizerError

pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")

IDS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def _step(model, optimizer) -> float:
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _scale(model) -> torch.Tensor:
    """The FP8 all-gather scale torchao precomputes for one FP8 weight (None until the first precompute)."""
    return model.model.layers[1].self_attn.q_proj.weight._local_tensor._precomputed_scale


def test_a_second_fsdp_torchao_model_in_the_same_process_trains_and_precomputes(one_rank_group):
    first = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="torchao")
    first_opt = torch.optim.AdamW(first.parameters(), lr=1e-3)
    _step(first, first_opt)
    assert _scale(first) is not None
    del first, first_opt
    gc.collect()
    second = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="torchao")
    second_opt = torch.optim.AdamW(second.parameters(), lr=1e-3)
    # an unrelated optimizer once the first model is gone (with a second model's hook behind the first one's, this
    # step and the second model's first step raised "OrderedDict mutated during iteration")
    other = torch.nn.Linear(4, 4)
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    assert _scale(second) is None
    losses = [_step(second, second_opt) for _ in range(3)]
    assert _scale(second) is not None, "the second model's scales are precomputed after its optimizer steps"
    assert losses[-1] < losses[0]


def test_the_scale_precompute_runs_only_for_the_optimizer_of_its_model(one_rank_group):
    model = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="torchao")
    other = torch.nn.Linear(4, 4)
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    assert _scale(model) is None, "an optimizer of other parameters does not trigger this model's precompute"
    _step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert _scale(model) is not None


@pytest.mark.parametrize("strategy,fp8", [("fsdp", None), ("fsdp", "torchao")])
def test_an_optimizer_built_before_wrap_model_is_stopped_at_its_first_step(one_rank_group, strategy, fp8):
    model = build_llama("tiny", seed=0)
    early = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = wrap_model(model, strategy=strategy, fp8=fp8)
    n = len(list(wrapped.parameters()))
    with pytest.raises(StaleOptimizerError, match=rf"AdamW steps over {n} of its {n} parameters that "
                                                  r"fp8dist.wrap_model replaced.*Build the optimizer after wrap_model"):
        _step(wrapped, early)
    late = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    losses = [_step(wrapped, late) for _ in range(3)]
    assert losses[-1] < losses[0], "an optimizer built after wrap_model trains"


@pytest.mark.parametrize("strategy", ["fsdp1", "ddp", "none"])
def test_engines_that_keep_the_parameters_accept_an_earlier_optimizer(one_rank_group, strategy):
    """FSDP1 (use_orig_params), DDP and a single process keep the user's parameter objects: an optimizer built
    before wrap_model really trains them, so it is not refused."""
    model = build_llama("tiny", seed=0)
    early = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped = wrap_model(model, strategy=strategy)
    losses = [_step(wrapped, early) for _ in range(3)]
    assert losses[-1] < losses[0]


def test_models_and_optimizers_created_and_dropped_in_any_order(one_rank_group):
    """The one registry of step actions (fp8dist.runtime.optim.STEP_HOOKS) follows models and optimizers as they come and
    go: each optimizer precomputes the scales of the models it holds, and only those; an optimizer may outlive its
    model or die before it; a model may gain an optimizer late (add_param_group); nothing is left behind."""
    import weakref

    a = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="torchao")
    b = wrap_model(build_llama("tiny", seed=1), strategy="fsdp", fp8="torchao")
    opt_b, opt_a = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (b, a))  # built in the other order
    held = [weakref.ref(x) for x in (a, b, opt_a, opt_b)]
    _step(b, opt_b)
    assert _scale(b) is not None and _scale(a) is None, "b's optimizer precomputes b's scales only"
    del opt_b  # an optimizer dropped before its model
    gc.collect()
    _step(a, opt_a)
    assert _scale(a) is not None
    del a  # a model dropped before its optimizer: stepping that optimizer does nothing of fp8dist's, no error
    gc.collect()
    opt_a.step()
    before = _scale(b)
    opt_a.add_param_group({"params": list(b.parameters())})  # the surviving optimizer now holds b's parameters
    _step(b, opt_a)
    assert _scale(b) is not before, "found again after add_param_group: b's scales are recomputed"
    del b, opt_a
    gc.collect()
    assert [r() for r in held] == [None] * 4, "the registry holds models and optimizers weakly: none kept alive"
