"""Transformer Engine's current recipes: ``te_recipe="blockwise"`` (Float8BlockScaling, sm_90+ and CUDA >= 12.9)
and ``"nvfp4"`` (NVFP4BlockScaling, sm_100+). Their capability gates and plans for named GPUs run for real here (a
pure function of the model, the config and the hardware record); the recipe reaching TE's autocast is checked
through the STAND-IN of TE 2.20's API (tests/standins, not TE: never proof that TE runs them)."""

from __future__ import annotations

import re

import pytest
import torch
from standin import drop_standins, use_standins
from torch import nn

import fp8dist
from fp8dist import wrap_model
from fp8dist.cli import main
from fp8dist.fp8 import get_backend
from fp8dist.runtime.hardware import TARGETS
from fp8dist.plan.precision import FP8UnavailableError
from fp8dist.train.models import build_llama


@pytest.fixture
def standin_te():
    use_standins()
    yield
    drop_standins()


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.down(self.up(x))


def test_blockwise_and_nvfp4_reach_te_autocast_as_te_2_20s_recipe_classes(standin_te):
    """blockwise: Float8BlockScaling with the configured format; nvfp4: NVFP4BlockScaling at TE's defaults (its
    fp8_format is its block scales', E4M3, the only one TE 2.20 accepts: passing HYBRID would fail its check)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    for options, expected in (({"te_recipe": "blockwise"}, recipe.Float8BlockScaling(fp8_format=recipe.Format.HYBRID)),
                              ({"te_recipe": "blockwise", "fp8_format": "E4M3"}, recipe.Float8BlockScaling()),
                              ({"te_recipe": "nvfp4"}, recipe.NVFP4BlockScaling())):
        model = wrap_model(Two(), strategy="none", fp8="te", **options)
        model(torch.randn(2, 32))
        enabled, used, _, name = te.AUTOCAST_CALLS[-1]
        assert (enabled, used, name) == (True, expected, "autocast"), options
        assert all(m.fp8_forwards == 1 for m in model.modules() if isinstance(m, te.Linear))
    rows = {row.part: row for row in fp8dist.report(model).rows}
    assert rows["fp8_gemm"].gemm == "fp4 e2m1, e4m3 block scales (NVFP4BlockScaling)"
    with pytest.raises(AssertionError, match="Only E4M3 is supported for NVFP4 scaling"):
        recipe.NVFP4BlockScaling(fp8_format=recipe.Format.HYBRID)  # the stand-in keeps TE's check


def test_an_older_te_without_the_recipe_class_is_refused_naming_it(standin_te, monkeypatch):
    from transformer_engine.common import recipe

    monkeypatch.delattr(recipe, "NVFP4BlockScaling")
    two = Two()
    with pytest.raises(ValueError, match=re.escape("te_recipe='nvfp4': Transformer Engine 2.20.0+standin has no "
                                                   "recipe.NVFP4BlockScaling. Install a newer Transformer Engine")):
        wrap_model(two, strategy="none", fp8="te", te_recipe="nvfp4")
    assert all(type(m).__module__.startswith("torch.") for m in two.modules() if m is not two), "nothing swapped"


def test_blockwise_refuses_a_torch_built_for_cuda_before_12_9(standin_te, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(FP8UnavailableError, match=re.escape("te_recipe='blockwise' (Float8BlockScaling) needs "
                                                            "PyTorch and Transformer Engine built for CUDA >= 12.9, "
                                                            "this torch is built for CUDA 12.8")):
        wrap_model(Two(), strategy="none", fp8="te", te_recipe="blockwise")
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    wrap_model(Two(), strategy="none", fp8="te", te_recipe="blockwise")  # 12.9: runs
    wrap_model(Two(), strategy="none", fp8="te", te_recipe="current")  # the gate is blockwise's alone


@pytest.mark.parametrize("target,recipe,runs", [("h100", "blockwise", True), ("h200", "blockwise", True),
                                                ("b200", "blockwise", True), ("l40s", "blockwise", False),
                                                ("b200", "nvfp4", True), ("gb200", "nvfp4", True),
                                                ("h100", "nvfp4", False), ("a100", "nvfp4", False)])
def test_planned_for_the_gpus_that_have_them_and_refused_naming_the_capability_elsewhere(target, recipe, runs):
    cfg = fp8dist.resolve_config(strategy="fsdp", fp8="te", te_recipe=recipe, fp8_select="all")
    model = build_llama("tiny")
    if not runs:
        need = "sm_100+ (Blackwell or newer)" if recipe == "nvfp4" else "sm_90+ (Hopper or newer)"
        with pytest.raises(FP8UnavailableError, match=re.escape(f"needs a CUDA GPU with {need}")) as caught:
            fp8dist.plan_precision(model, cfg, device=TARGETS[target], check_installed=False)
        way_out = f"fp8dist plan --target {'b200' if recipe == 'nvfp4' else 'h100'}"
        assert way_out in str(caught.value)
        assert ("te_recipe='blockwise' (Float8BlockScaling, sm_90+)" in str(caught.value)) == (target == "h100")
        return
    plan = fp8dist.plan_precision(model, cfg, device=TARGETS[target], check_installed=False)
    linears = [e for e in plan if e.module_type == "Linear"]
    assert linears and all(e.converted_to == "te.Linear" for e in linears if e.precision == "fp8")


def test_cli_plans_them_for_a_named_target_and_refuses_the_wrong_one(capsys):
    assert main(["plan", "--model-size", "tiny", "--fp8", "te", "--te-recipe", "nvfp4", "--target", "b200"]) == 0
    out = capsys.readouterr().out
    assert "NVFP4BlockScaling" in out and "te.Linear" in out
    assert main(["plan", "--model-size", "tiny", "--fp8", "te", "--te-recipe", "blockwise", "--target", "h100"]) == 0
    assert "Float8BlockScaling" in capsys.readouterr().out
    assert main(["plan", "--model-size", "tiny", "--fp8", "te", "--te-recipe", "nvfp4", "--target", "h100"]) != 0
    assert "te_recipe='nvfp4' (NVFP4BlockScaling) needs a CUDA GPU with sm_100+" in capsys.readouterr().err


def test_the_speed_model_predicts_them_only_where_it_has_the_recipe():
    te = get_backend("te")
    for recipe in ("blockwise", "nvfp4"):
        name, why = te.speed_recipe(fp8dist.resolve_config(fp8="te", te_recipe=recipe), TARGETS["b200"])
        from fp8dist.plan.speed import RECIPES

        if f"te_{recipe}" in RECIPES:  # another change may calibrate it
            assert (name, why) == (f"te_{recipe}", "")
        else:
            assert name is None and f"the speed model has no recipe 'te_{recipe}'" in why
    assert te.speed_recipe(fp8dist.resolve_config(fp8="te", te_recipe="mxfp8"), TARGETS["b200"]) == ("te_mxfp8", "")


def test_the_numerics_probe_refuses_casts_it_does_not_model_with_the_way_out():
    from fp8dist.train.data import Batches

    batches = [Batches(batch_size=2, seq_len=16, seed=0)[0]]
    for recipe, way_out in (("blockwise", "Probe with te_recipe='current'"),):  # nvfp4's: tests/test_nvfp4.py
        with pytest.raises(NotImplementedError, match=re.escape(f"te_recipe={recipe!r}: the numerics probe has no "
                                                                "model of") + f".*{re.escape(way_out)}"):
            fp8dist.measure_fp8_numerics(build_llama("tiny"), batches, fp8="te", te_recipe=recipe)


def test_fp8_format_is_said_to_have_no_effect_under_nvfp4():
    notes = fp8dist.resolve_config(fp8="te", te_recipe="nvfp4", fp8_format="E4M3").unread_notes()
    assert any(n.startswith("fp8_format='E4M3' has no effect here (read only when fp8 in ['te'] and te_recipe in "
                            "['delayed', 'current', 'mxfp8', 'blockwise']") for n in notes), notes
    assert not fp8dist.resolve_config(fp8="te", te_recipe="blockwise", fp8_format="E4M3").unread_notes()


# ---- TE's quantized weights under FSDP2 (fp8_weights: quantized_model_init, TE >= 2.10)

def _fp8_weights_rank(rank: int, world: int, fp8_weights: bool) -> dict:
    use_standins()
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe
    from helpers import train_losses

    reference = {n: p.detach().clone() for n, p in build_llama("tiny", seed=0).named_parameters()}
    model = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="te", te_recipe="current",
                       fp8_weights=fp8_weights)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, te.Linear)}
    full = {f"{n}.weight": m.weight.full_tensor() for n, m in linears.items()}  # FSDP2 DTensor shards
    expected = recipe.Float8CurrentScaling() if fp8_weights else None  # compared here: the parent has no stand-in
    copied = all(torch.equal(full[n], reference[n].to(full[n].dtype)) for n in full)
    return dict(quantized_init={n: m.quantized_init == expected for n, m in linears.items()}, copied=copied,
                losses=train_losses(model, rank, world, steps=2))


def test_fp8_weights_create_every_te_linear_under_quantized_model_init_with_the_recipe_under_fsdp2():
    """Through the stand-in (not TE: the stand-in keeps the weight in full, real TE quantizes it): each converted
    te.Linear is created inside ``te.quantized_model_init(recipe=<the run's recipe>)``, its weight the model's own,
    sharded by FSDP2, and trains; without the knob none is."""
    from dist_harness import run_ranks

    for fp8_weights in (True, False):
        for r in run_ranks(_fp8_weights_rank, fp8_weights):
            assert len(r["quantized_init"]) == 15 and r["copied"]
            assert all(r["quantized_init"].values())
            assert r["losses"][1] < r["losses"][0]


def test_fp8_weights_refused_where_they_cannot_run():
    for strategy in ("ddp", "fsdp1", "none", "deepspeed"):
        said = f"fp8_weights=True with strategy={strategy!r}: fp8dist wires Transformer Engine's quantized weights"
        with pytest.raises(ValueError, match=re.escape(said) + ".*Use strategy='fsdp'"):
            fp8dist.resolve_config(strategy=strategy, fp8="te", fp8_weights=True)
    with pytest.raises(ValueError, match=re.escape("fp8_weights=True with memory='lean': quantized weights need an "
                                                   "optimizer that keeps fp32 master weights") + ".*memory='standard'"):
        fp8dist.resolve_config(strategy="fsdp", fp8="te", fp8_weights=True, memory="lean")
    notes = fp8dist.resolve_config(strategy="fsdp", fp8="torchao", fp8_weights=True).unread_notes()
    assert notes == ["fp8_weights=True has no effect here (read only when fp8 in ['te']; fp8='torchao')."]


def test_fp8_weights_refuse_a_te_before_2_10_before_any_module_is_swapped(monkeypatch):
    monkeypatch.setenv("FP8DIST_TE_STANDIN_API", "2.8")
    use_standins()
    try:
        te_backend = get_backend("te")
        cfg = fp8dist.resolve_config(strategy="fsdp", fp8="te", fp8_weights=True, fp8_select="all")
        model = build_llama("tiny")
        plan = fp8dist.plan_precision(model, cfg, device=TARGETS["h100"], check_installed=False)
        with pytest.raises(ValueError, match=re.escape("fp8_weights=True: Transformer Engine 2.8.0+standin is older "
                                                       "than 2.10, whose quantized_model_init first works under FSDP2 "
                                                       "(TE issue #1688). Install Transformer Engine >= 2.10")):
            te_backend.convert(model, plan, cfg)
        assert all(type(m).__module__.startswith(("torch.", "transformers.")) for m in model.modules()), \
            "nothing swapped"
    finally:
        drop_standins()


def test_the_estimate_counts_fp8_weights_and_the_fp32_master_copy_they_need():
    """A converted weight: 1 byte (FP8) instead of the stored fp32, plus the optimizer's fp32 master (TE's FusedAdam
    master_weights); unconverted parameters as before. Derived from TE's documentation (TE cannot run here)."""
    def estimate(fp8_weights):
        return fp8dist.estimate_memory(build_llama("tiny"), strategy="fsdp", fp8="te", fp8_weights=fp8_weights,
                                       world_size=2, target="h100", fp8_select="all")

    plain, quantized = estimate(False), estimate(True)
    fp8_params = sum(e.params for e in fp8dist.plan_precision(
        build_llama("tiny"), fp8dist.resolve_config(strategy="fsdp", fp8="te", fp8_select="all"),
        device=TARGETS["h100"], check_installed=False).fp8)
    assert plain.bytes["parameters"] - quantized.bytes["parameters"] == 3 * fp8_params // 2  # 2 ranks, 4 -> 1 byte
    assert (plain.bytes["master_weights"], quantized.bytes["master_weights"]) == (0, 4 * fp8_params // 2)
    assert quantized.dtypes["parameters"] == "fp32/fp8" and quantized.dtypes["master_weights"] == "fp32"
    assert quantized.bytes["gradients"] == plain.bytes["gradients"]


def test_fp8_weights_say_the_optimizer_they_need_in_the_plan_and_once_at_conversion(standin_te):
    import transformer_engine.pytorch as te

    cfg = fp8dist.resolve_config(strategy="fsdp", fp8="te", fp8_weights=True, fp8_select="all")
    model = build_llama("tiny")
    plan = fp8dist.plan_precision(model, cfg, device=TARGETS["h100"], check_installed=False)
    assert "weights held quantized (quantized_model_init)" in str(plan)
    with pytest.warns(UserWarning, match=re.escape("the optimizer must keep fp32 master weights: build it as "
                                                   "te.optimizers.FusedAdam(model.parameters(), master_weights=True"))\
            as caught:
        get_backend("te").convert(model, plan, cfg)
    assert len([w for w in caught if "fp8_weights=True" in str(w.message)]) == 1
    assert all(m.quantized_init is not None for m in model.modules() if isinstance(m, te.Linear))
