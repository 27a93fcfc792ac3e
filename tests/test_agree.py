"""Every rank must wrap the same model the same way (fp8dist/runtime/agree.py: check_ranks): ranks given another FP8 backend,
another model or other weights fail on every rank, naming what differs, before anything is converted (they used to
hang in the first step or train a silent mixture); check_ranks="settings" lets weights differ on purpose, and a
strategy that copies rank 0's weights (DDP) does not compare them."""

from __future__ import annotations

import warnings

import pytest

from dist_harness import run_ranks


def _cases(rank: int, world: int) -> dict:
    import torch

    import fp8dist
    from fp8dist.runtime.agree import RanksDisagreeError
    from fp8dist.train.models import build_llama

    warnings.simplefilter("ignore")
    out = {}

    def attempt(name, build, **options):
        model = build()
        before = [type(m) for m in model.modules()]
        try:
            fp8dist.wrap_model(model, **options)
            out[name] = None
        except RanksDisagreeError as err:
            out[name] = (str(err), [type(m) for m in model.modules()] == before)

    attempt("fp8 on rank 0 only", lambda: build_llama("tiny", seed=0), strategy="fsdp",
            fp8="torchao" if rank == 0 else None)
    attempt("another model", lambda: build_llama("tiny" if rank == 0 else "small", seed=0), strategy="fsdp")
    attempt("other weights", lambda: build_llama("tiny", seed=rank), strategy="fsdp")
    attempt("other weights, on purpose", lambda: build_llama("tiny", seed=rank), strategy="fsdp",
            check_ranks="settings")
    attempt("other weights, ddp copies rank 0's", lambda: build_llama("tiny", seed=rank), strategy="ddp")
    torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, world_size=2, timeout=300)


def test_ranks_given_other_settings_or_models_fail_together_naming_what_differs(results):
    for out in results:
        message, unchanged = out["fp8 on rank 0 only"]
        assert message.startswith("the ranks of this job were given different models or settings: option fp8: "
                                  "rank 0 'torchao', rank 1 None. Every rank must build the same model")
        assert "check_ranks='settings'" in message and unchanged, "refused before anything was converted"
        message, _ = out["another model"]
        assert message.startswith("the ranks of this job were given different models or settings: model structure "
                                  "(parameter names, shapes, dtypes): ranks [1] differ from rank 0")
        message, _ = out["other weights"]
        assert message.startswith("the ranks of this job were given different models or settings: weights: ranks "
                                  "[1] differ from rank 0")


def test_weights_may_differ_on_purpose_or_where_the_strategy_copies_rank_0s(results):
    for out in results:
        assert out["other weights, on purpose"] is None
        assert out["other weights, ddp copies rank 0's"] is None
