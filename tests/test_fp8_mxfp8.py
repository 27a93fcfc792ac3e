"""MXFP8 on dense Linears through torchao's weight wrapper (``quantize_`` with ``MXFP8TrainingOpConfig``), for
real on CPU with emulated GEMMs (``torchao_recipe="mxfp8_emulated"``).

Losses must equal the same torchao API wired by hand, step for step, on 2 gloo ranks under FSDP2; the plan must
say MXFP8 per layer; every planned layer must be seen running torchao's MX GEMM (``aten.mm`` on two ``MXTensor``
operands, counted per module), and no other layer. Real MXFP8 (sm_100) is refused elsewhere with its capability.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import run_ranks
from helpers import gemms_per_module, hand_wired_fsdp2, train_losses
from torch import nn

pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")

from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402

from fp8dist import get_plan, wrap_model  # noqa: E402
from fp8dist.config.rules import refusal_of  # noqa: E402
from fp8dist.fp8 import get_backend  # noqa: E402
from fp8dist.runtime.hardware import parse_target  # noqa: E402
from fp8dist.plan.precision import plan_precision  # noqa: E402
from fp8dist.train.models import build_llama  # noqa: E402


def _hand_wrapped(model: nn.Module) -> nn.Module:
    """torchao's MXFP8 weight wrapper as its API reads: every nn.Linear but the first and the last."""
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    keep = {linears[0], linears[-1]}
    quantize_(model, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
              filter_fn=lambda m, fqn: type(m) is nn.Linear and fqn not in keep)
    return model



def _fsdp_case(rank: int, world: int) -> dict:
    base = build_llama("tiny", seed=0)
    ours = wrap_model(copy.deepcopy(base), strategy="fsdp", fp8="torchao", torchao_recipe="mxfp8_emulated")
    ref = hand_wired_fsdp2(_hand_wrapped(copy.deepcopy(base)), world)
    plan = get_plan(ours)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    per_module, counter = gemms_per_module(ours, ids, "mx")
    mx, total = counter.mx, counter.count
    return dict(ours=train_losses(ours, rank, world), ref=train_losses(ref, rank, world),
                plan={e.name: e.converted_to for e in plan.fp8}, per_module=per_module, mx=mx, total=total,
                local=type(ours.model.layers[1].self_attn.q_proj.weight.to_local()).__name__,
                header=str(plan).splitlines()[0])


def test_fsdp2_mxfp8_emulated_matches_hand_wired_and_every_planned_layer_runs_an_mx_gemm():
    for rank, r in enumerate(run_ranks(_fsdp_case)):
        assert r["ours"] == r["ref"], rank
        assert len(r["plan"]) == 13 and set(r["plan"].values()) == {"MXFP8 weight wrapper (emulated GEMMs)"}
        assert r["local"] == "MXFP8TrainingWeightWrapperTensor", "FSDP2 shards the wrapped weight"
        assert {n for n, c in r["per_module"].items() if c} == set(r["plan"]), "MXFP8 exactly where planned"
        assert set(r["per_module"][n] for n in r["plan"]) == {1}, "one MX forward GEMM per planned layer"
        assert r["mx"] == r["total"] == 3 * 13, "forward, input-gradient and weight-gradient GEMMs all MX"
        assert "recipe mxfp8_emulated, weight_wrapper (auto), FP8 all-gather off" in r["header"]


def test_a_layer_with_dims_off_the_mx_block_stays_out_with_the_reason():
    model = build_llama("tiny", seed=0)
    model.model.layers[0].mlp.up_proj = nn.Linear(model.config.hidden_size, 48, bias=False)
    model.model.layers[0].mlp.down_proj = nn.Linear(48, model.config.hidden_size, bias=False)
    model.model.layers[0].mlp.gate_proj = nn.Linear(model.config.hidden_size, 48, bias=False)
    plan = plan_precision(model, _cfg(torchao_recipe="mxfp8_emulated", strategy="fsdp"), device=parse_target("cpu"),
                          world_size=2)
    rows = {e.name: e for e in plan}
    why = rows["model.layers.0.mlp.up_proj"].reason
    assert "out_features=48 not divisible by 32" in why and "MXFP8" in why, why
    assert "model.layers.0.mlp.up_proj" not in {e.name for e in plan.fp8}


@pytest.mark.parametrize("options,words", [
    (dict(strategy="fsdp", torchao_api="module_swap", torchao_recipe="mxfp8_emulated"),
     ("torchao_api='module_swap' with torchao_recipe='mxfp8_emulated'", "Use torchao_api='weight_wrapper'")),
    (dict(strategy="none", torchao_recipe="mxfp8_emulated"), ("autocast", "strategy='fsdp'")),
])
def test_what_mxfp8_cannot_do_is_refused_with_the_way_out(options, words):
    found = refusal_of(fp8="torchao", **options)
    assert found is not None and all(w in found for w in words), found
    assert refusal_of(fp8="torchao", strategy="fsdp", torchao_recipe="mxfp8_emulated") is None


@pytest.mark.parametrize("target", ["h100", "cpu"])
def test_real_mxfp8_is_refused_without_sm100_naming_the_capability_and_the_way_out(target):
    backend = get_backend("torchao")
    cfg = _cfg(torchao_recipe="mxfp8")
    why = backend.hardware_reason(cfg, parse_target(target))
    assert why and "needs MXFP8 tensor cores (CUDA sm_100+), not" in why and "mxfp8_emulated" in why, why
    assert "--target b200" in why
    assert backend.hardware_reason(cfg, parse_target("b200")) is None
    assert backend.hardware_reason(_cfg(torchao_recipe="mxfp8_emulated"), parse_target(target)) is None


def test_mxfp8_is_planned_for_b200_with_the_speed_models_mxfp8_recipe():
    with torch.device("meta"):
        model = build_llama("tiny", seed=0)
    plan = plan_precision(model, _cfg(strategy="fsdp", torchao_recipe="mxfp8", fp8_select="all"),
                          device=parse_target("b200"), world_size=2, check_installed=False)
    assert {e.converted_to for e in plan.fp8} == {"MXFP8 weight wrapper"}
    backend = get_backend("torchao")
    assert "mxfp8" in [recipe.name for recipe in backend.speed_recipes]
    assert backend.speed_recipe(_cfg(torchao_recipe="mxfp8"), parse_target("b200")) == ("mxfp8", "")
    assert backend.speed_recipe(_cfg(torchao_recipe="mxfp8_emulated"), parse_target("cpu")) == (
        None, "emulated: no speed model")


def test_the_numerics_probe_casts_mxfp8_in_1x32_blocks():
    casts = get_backend("torchao").numerics_casts(_cfg(torchao_recipe="mxfp8_emulated"), None, parse_target("cpu"))
    assert {(c.dtype, c.scaling) for c in casts.values()} == {(torch.float8_e4m3fn, "mx")}
    assert len(casts) == 6


def _cfg(**options):
    from fp8dist.config.resolve import resolve_config

    return resolve_config(fp8="torchao", **options)


def test_the_numerics_probe_measures_each_mxfp8_layer_with_its_block_casts():
    import fp8dist

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    mx, tensorwise = (fp8dist.measure_fp8_numerics(build_llama("tiny", seed=0), [ids], fp8="torchao",
                                                   torchao_recipe=recipe, strategy="fsdp").to_dict()
                      for recipe in ("mxfp8_emulated", "tensorwise"))
    assert mx["recipe"] != tensorwise["recipe"] and len(mx["layers"]) == 13
    assert mx["layers"] != tensorwise["layers"], "MX block casts measure differently from tensorwise ones"
    assert mx["recommended_exclude"] == []


def test_falcons_bypassed_linears_are_kept_out_of_mxfp8_with_the_true_reason():
    """FalconLinear's ``x @ self.weight.T`` unwraps the MXFP8 weight wrapper too, and MXFP8 has no module swap:
    those layers stay in high precision, said, and no layer runs an MX GEMM the plan does not list."""
    from test_fp8_families import falcon_tiny

    cfg = _cfg(strategy="fsdp", torchao_recipe="mxfp8_emulated")
    plan = plan_precision(falcon_tiny(), cfg, device=parse_target("cpu"))
    falcon = [e for e in plan if e.module_type == "FalconLinear"]
    assert falcon and all(e.precision != "fp8" for e in falcon)
    assert all("bypasses torchao's weight wrapper" in e.reason and "MXFP8 has no module swap" in e.reason
               for e in falcon[1:]), [e.reason for e in falcon]


def test_compare_recipes_lists_mxfp8_on_b200_only(capsys):
    from fp8dist.cli import main

    for target, recipes in (("b200", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "nvfp4"]),
                            ("h100", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])):
        assert main(["plan", "--model-size", "tiny", "--fp8", "torchao", "--target", target,
                     "--compare-recipes"]) == 0
        lines = capsys.readouterr().out.splitlines()
        start = lines.index(next(line for line in lines if line.startswith("recipes compared"))) + 3
        assert [line.split()[0] for line in lines[start:]] == ["bf16", *recipes], target


def test_the_report_says_mxfp8_with_its_blocks_for_the_planned_layers():
    import fp8dist

    model = wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao", torchao_recipe="mxfp8_emulated",
                       param_dtype="fp32")
    row = next(line for line in str(fp8dist.report(model)).splitlines() if line.startswith("FP8 GEMM"))
    assert row.split()[2:4] == ["13", "376,832"], row
    assert "mxfp8 e4m3 fwd+grads (1x32 blocks, e8m0 scales, weight wrapper, emulated)" in row


def test_wrap_model_with_real_mxfp8_on_this_cpu_is_refused_with_the_way_out():
    from fp8dist.plan.precision import FP8UnavailableError

    with pytest.raises(FP8UnavailableError) as caught:
        wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao", torchao_recipe="mxfp8",
                   param_dtype="fp32")
    said = str(caught.value)
    assert "torchao_recipe='mxfp8' needs MXFP8 tensor cores (CUDA sm_100+), not device cpu" in said
    assert "torchao_recipe='mxfp8_emulated'" in said and "--target b200" in said


def test_real_mxfp8_under_autocast_on_this_cpu_says_it_needs_blackwell_and_the_emulated_way():
    """The dtype refusal (autocast under strategy none / ddp) comes before the hardware gate: for the real recipe it
    said only how to fix the dtypes, and a CPU user fixed them to be refused again on hardware. It says both."""
    with pytest.raises(ValueError) as caught:
        wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao", torchao_recipe="mxfp8")
    said = str(caught.value)
    assert said.startswith("torchao_recipe='mxfp8' with strategy='none' and the default param_dtype='bf16': "
                           "torchao's MXFP8 Linear (mx_mm) does not follow autocast"), said
    assert "measured on CPU with the emulated GEMMs" in said  # where the failure was seen: not the real GEMMs
    assert "needs MXFP8 tensor cores, a CUDA sm_100+ GPU (Blackwell, e.g. B200)" in said
    assert "torchao_recipe='mxfp8_emulated' runs MXFP8's quantization with emulated GEMMs" in said
    why = get_backend("torchao").hardware_reason(_cfg(torchao_recipe="mxfp8"), parse_target("cpu"))
    assert why.startswith("torchao_recipe='mxfp8' needs MXFP8 tensor cores (CUDA sm_100+), not device cpu: a "
                          "Blackwell GPU (e.g. B200) has them; "), why
