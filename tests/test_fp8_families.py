"""The model families users name (GPT-NeoX, Llama, Mixtral, GPT-2) under FP8: what converts, that FP8 never goes
silently unused, GPT-2's Conv1D in FP8 with its checkpoints unchanged, and Mixtral's experts through torchao's MoE
training conversion (emulated MXFP8 on CPU, named as emulation)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fp8dist
from fp8dist.plan import MIN_FP8_SHARE

pytest.importorskip("torchao", reason="torchao is not installed")


class NoLinear(nn.Module):
    """A GEMM held as a bare 2-D parameter, then one Linear: torchao converts neither (first/last kept)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Parameter(torch.randn(64, 32))
        self.head = nn.Linear(64, 64)

    def forward(self, x):
        return self.head(torch.nn.functional.linear(x, self.proj))


def test_nothing_converted_warns_once_with_the_numbers_and_reasons():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fp8dist.wrap_model(NoLinear(), strategy="none", fp8="torchao")
    low = [str(w.message) for w in caught if "GEMM modules in FP8" in str(w.message)]
    assert len(low) == 1, [str(w.message) for w in caught]
    assert "runs 0 of 2 GEMM modules in FP8: 0 of 6,208 GEMM params (0.0%, below 50%)" in low[0]
    assert "1 module / 2,048 params: NoLinear is not converted by torchao" in low[0]
    assert "1 module / 4,160 params: last Linear, kept in high precision" in low[0]
    cov = fp8dist.get_plan(model).coverage  # the decision as data
    assert (cov.gemm_modules, cov.fp8_modules, cov.gemm_params, cov.fp8_params, cov.low) == (2, 0, 6208, 0, True)
    assert cov.gemm_flops == 2 * 6208 and cov.flop_share == 0.0


def test_a_well_covered_model_does_not_warn_and_the_plan_shows_the_shares():
    from fp8dist.models import build_llama

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fp8dist.wrap_model(build_llama(), strategy="none", fp8="torchao")
    assert not [w for w in caught if "GEMM modules in FP8" in str(w.message)]
    plan = fp8dist.get_plan(model)
    assert plan.coverage.param_share > MIN_FP8_SHARE
    assert "FP8 share of GEMMs: 376,832 of 425,984 params (88.5%), 88.5% of est. GEMM FLOPs" in str(plan)
