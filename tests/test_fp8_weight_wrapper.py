"""torchao's weight-wrapper API (``quantize_`` with ``Float8TrainingOpConfig``), for real on CPU.

Losses must equal the same torchao API wired by hand, step for step; every layer the plan calls FP8 must be seen
running torchao's FP8 GEMM (counted per module); a layer whose forward bypasses the wrapper (Falcon's
``x @ self.weight.T``) must never be counted FP8 on the wrapper's word.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from dist_harness import run_ranks
from helpers import gemms_per_module, hand_wired_fsdp2, train_losses
from torch import nn

pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")

from torchao.prototype.moe_training.config import Float8TrainingOpConfig  # noqa: E402
from torchao.quantization import quantize_  # noqa: E402

from fp8dist import get_plan, wrap_model  # noqa: E402
from fp8dist.config.rules import refusal_of  # noqa: E402
from fp8dist.fp8.weight_wrapper import FP8Gemms, unproven_fp8  # noqa: E402
from fp8dist.train.models import build_llama  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _hand_wrapped(model: nn.Module, recipe: str) -> nn.Module:
    """torchao's weight wrapper as its API reads: every nn.Linear but the first and the last."""
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    keep = {linears[0], linears[-1]}
    quantize_(model, Float8TrainingOpConfig(float8_linear_recipe=recipe),
              filter_fn=lambda m, fqn: type(m) is nn.Linear and fqn not in keep)
    return model



def _fsdp_case(rank: int, world: int) -> dict:
    base = build_llama("tiny", seed=0)
    out = {}
    for recipe in RECIPES:
        ours = wrap_model(copy.deepcopy(base), strategy="fsdp", fp8="torchao", torchao_api="weight_wrapper",
                          torchao_recipe=recipe)
        ref = hand_wired_fsdp2(_hand_wrapped(copy.deepcopy(base), recipe), world)
        plan = get_plan(ours)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
        per_module, counter = gemms_per_module(ours, ids)
        total = counter.count
        out[recipe] = dict(
            ours=train_losses(ours, rank, world), ref=train_losses(ref, rank, world),
            plan={e.name: e.converted_to for e in plan.fp8}, per_module=per_module, total=total,
            local=type(ours.model.layers[1].self_attn.q_proj.weight.to_local()).__name__,
            classes={type(m).__name__ for n, m in ours.named_modules() if n in {e.name for e in plan.fp8}},
            header=str(plan).splitlines()[0])
    with torch.device("meta"):  # a meta model: FSDP2 materializes the wrapped weights, which stay wrapped
        meta = build_llama("tiny", seed=0)
    meta = wrap_model(meta, strategy="fsdp", fp8="torchao", torchao_api="weight_wrapper")
    out["meta"] = gemms_per_module(meta, ids)[1].count
    out["fsdp1_by_hand"] = _fsdp1_by_hand(base)
    return out


def _fsdp1_by_hand(base: nn.Module) -> int:
    """FP8 GEMMs of the wrapper under FSDP1 wired by hand: the evidence behind the rule that refuses it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision

    model = FSDP(_hand_wrapped(copy.deepcopy(base), "tensorwise"), use_orig_params=True,
                 device_id=torch.device("cpu"), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with FP8Gemms() as gemms:
        model(input_ids=ids, labels=ids).loss.backward()
    return gemms.count


def test_fsdp2_weight_wrapper_matches_hand_wired_and_every_fp8_layer_runs_fp8():
    for rank, by_recipe in enumerate(run_ranks(_fsdp_case)):
        assert by_recipe.pop("meta") == 3 * 13, "a meta model's wrapped weights run FP8 once materialized"
        assert by_recipe.pop("fsdp1_by_hand") == 0, "FSDP1 drops the wrapper silently: hence the rule"
        for recipe, r in by_recipe.items():
            assert r["ours"] == r["ref"], (rank, recipe)
            assert len(r["plan"]) == 13 and set(r["plan"].values()) == {"Float8 weight wrapper"}
            assert r["classes"] == {"Linear"}, "the wrapper keeps each module's class"
            assert r["local"] == "Float8TrainingWeightWrapperTensor", "FSDP2 shards the wrapped weight"
            assert {n for n, c in r["per_module"].items() if c} == set(r["plan"]), "FP8 exactly where planned"
            assert set(r["per_module"][n] for n in r["plan"]) == {1}, "one FP8 forward GEMM per planned layer"
            gemms = 2 if recipe == "rowwise_with_gw_hp" else 3  # its weight-gradient GEMM runs in high precision
            assert r["total"] == gemms * 13, (recipe, r["total"])
            assert f"recipe {recipe}, weight_wrapper, FP8 all-gather off" in r["header"]


def _ddp_case(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    base = build_llama("tiny", seed=0)
    ours = wrap_model(copy.deepcopy(base), strategy="ddp", fp8="torchao", torchao_api="weight_wrapper")
    ref = DDP(_hand_wrapped(copy.deepcopy(base), "tensorwise"))
    return dict(ours=train_losses(ours, rank, world),
                ref=train_losses(ref, rank, world, autocast_dtype=torch.bfloat16),
                fp8=len(get_plan(ours).fp8))


def test_ddp_weight_wrapper_matches_hand_wired():
    for rank, r in enumerate(run_ranks(_ddp_case)):
        assert r["ours"] == r["ref"], f"rank {rank}"
        assert r["fp8"] == 13


def test_single_process_weight_wrapper_matches_hand_wired():
    torch.set_num_threads(1)
    base = build_llama("tiny", seed=0)
    ours = wrap_model(copy.deepcopy(base), strategy="none", fp8="torchao", torchao_api="weight_wrapper",
                      torchao_recipe="rowwise")
    ref = _hand_wrapped(copy.deepcopy(base), "rowwise")
    assert train_losses(ours, 0, 1) == train_losses(ref, 0, 1, autocast_dtype=torch.bfloat16)


def test_falcon_bypasses_the_wrapper_and_fp8dist_swaps_those_layers_instead():
    """FalconLinear computes x @ self.weight.T: the transpose unwraps torchao's weight, so quantize_ alone trains
    Falcon in bf16 without an error (the losses equal bf16's to every digit). fp8dist sees it on its probe, swaps
    those layers for Float8Linear, says so, and every layer it calls FP8 runs an FP8 GEMM."""
    from test_fp8_families import FALCON_FIRST, falcon_tiny

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    bf16 = falcon_tiny()(input_ids=ids, labels=ids).loss.item()
    hand = _hand_wrapped(falcon_tiny(), "tensorwise")
    with FP8Gemms() as gemms:
        assert hand(input_ids=ids, labels=ids).loss.item() == bf16, "the wrapper alone is bypassed: bf16"
    assert gemms.count == 0

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = wrap_model(falcon_tiny(), strategy="none", fp8="torchao", torchao_api="weight_wrapper")
    said = [str(w.message) for w in caught if "unwraps torchao's weight wrapper" in str(w.message)]
    assert len(said) == 1 and "(FalconLinear)" in said[0] and "Float8Linear" in said[0]
    plan = get_plan(ours)
    rows = {e.name: (e.precision, e.converted_to) for e in plan if e.module_type == "FalconLinear"}
    assert rows.pop(FALCON_FIRST) == ("bf16", None)
    assert set(rows.values()) == {("fp8", "Float8Linear (its forward bypasses the weight wrapper)")}
    per_module, counter = gemms_per_module(ours, ids)
    total = counter.count
    assert {n for n, c in per_module.items() if c} == set(rows) and total == 3 * len(rows) == 21

    with torch.device("meta"):  # planned on a meta model: the probe runs on small CPU copies, same verdict
        meta = falcon_tiny()
    from fp8dist import plan_precision, resolve_config

    meta_plan = plan_precision(meta, resolve_config(strategy="none", fp8="torchao", torchao_api="weight_wrapper"),
                               device=torch.device("cpu"))
    assert [(e.name, e.precision, e.converted_to) for e in meta_plan] == \
        [(e.name, e.precision, e.converted_to) for e in plan]


def test_a_converted_layer_that_runs_no_fp8_gemm_is_found():
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    quantize_(model, Float8TrainingOpConfig(float8_linear_recipe="tensorwise"), filter_fn=lambda m, fqn: fqn == "0")
    assert unproven_fp8(model, ["0", "1"]) == ["1"]


def test_auto_is_the_module_swap_on_this_torchao_and_the_plan_says_so():
    from torchao.float8.float8_linear import Float8Linear

    model = wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao")
    assert "(recipe tensorwise, module_swap (auto), FP8 all-gather off)" in str(get_plan(model))
    assert isinstance(model.model.layers[1].self_attn.q_proj, Float8Linear)


@pytest.mark.parametrize("options,words", [
    (dict(strategy="fsdp", fp8_all_gather=True),
     ("torchao_api='weight_wrapper' with fp8_all_gather=True", "torchao_api='module_swap'")),
    (dict(strategy="fsdp1"), ("torchao_api='weight_wrapper' with strategy='fsdp1'", "flat parameters")),
    (dict(strategy="deepspeed"), ("torchao_api='weight_wrapper' with strategy='deepspeed'", "Couldn't swap")),
])
def test_what_the_weight_wrapper_cannot_do_is_refused_with_the_way_out(options, words):
    found = refusal_of(fp8="torchao", torchao_api="weight_wrapper", **options)
    assert found is not None and all(w in found for w in words), found
    assert refusal_of(fp8="torchao", torchao_api="weight_wrapper", strategy="fsdp") is None


def test_a_wrapped_models_state_dict_holds_plain_tensors_that_load_into_a_plain_llama():
    ours = wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao", torchao_api="weight_wrapper")
    state = ours.state_dict()
    assert {type(t).__name__ for t in state.values()} == {"Tensor"}
    plain = build_llama("tiny", seed=1)
    assert str(plain.load_state_dict(state, strict=True)) == "<All keys matched successfully>"
    assert torch.equal(plain.model.layers[1].mlp.up_proj.weight, state["model.layers.1.mlp.up_proj.weight"])


def _resume_case(rank: int, world: int, path: str) -> dict:
    from fp8dist import load_checkpoint, save_checkpoint
    from helpers import optimizer_losses

    base = build_llama("tiny", seed=0)
    runs = []
    for _ in range(2):
        model = wrap_model(copy.deepcopy(base), strategy="fsdp", fp8="torchao", torchao_api="weight_wrapper")
        runs.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    (model, opt), (again, opt_again) = runs
    optimizer_losses(model, opt, rank, world, 2)
    save_checkpoint(path, model, opt, step=2)
    load_checkpoint(path, again, opt_again)
    return dict(on=optimizer_losses(model, opt, rank, world, 2, start=2),
                resumed=optimizer_losses(again, opt_again, rank, world, 2, start=2),
                local=type(again.model.layers[1].mlp.up_proj.weight.to_local()).__name__)


def test_fsdp2_weight_wrapper_resumes_from_a_checkpoint_exactly(tmp_path):
    for r in run_ranks(_resume_case, str(tmp_path / "ckpt")):
        assert r["resumed"] == r["on"] and r["local"] == "Float8TrainingWeightWrapperTensor"


def test_a_model_wrapped_by_hand_is_refused_naming_the_wrapped_weight():
    hand = _hand_wrapped(build_llama("tiny", seed=0), "tensorwise")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight of LlamaForCausalLM is "
                                         r"already a Float8TrainingWeightWrapperTensor from torchao \(converted by "
                                         r"hand\).*fp8='torchao'"):
        wrap_model(hand, strategy="none", fp8="torchao", torchao_api="weight_wrapper")


@pytest.mark.parametrize("api", ["module_swap", "weight_wrapper"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_and_api_runs_an_fp8_gemm_in_exactly_the_planned_layers(api, recipe):
    # rowwise_with_gw_hp under autocast needs fp32 params (the combination table's rule)
    dtype = dict(param_dtype="fp32") if recipe == "rowwise_with_gw_hp" else {}
    model = wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao", torchao_api=api,
                       torchao_recipe=recipe, **dtype)
    planned = {e.name for e in get_plan(model).fp8}
    per_module, counter = gemms_per_module(model, torch.randint(0, 256, (2, 16)))
    total = counter.count
    assert len(planned) == 13 and {n for n, c in per_module.items() if c} == planned
    assert set(per_module[n] for n in planned) == {1}
    assert total == (2 if recipe == "rowwise_with_gw_hp" else 3) * 13  # gw_hp: its weight gradient in bf16


def test_planned_where_torchao_is_not_installed_only_nn_linears_own_forward_counts_as_reached(monkeypatch):
    from test_fp8_families import falcon_tiny

    import fp8dist.fp8.torchao as backend
    from fp8dist import plan_precision, resolve_config

    monkeypatch.setattr(backend, "torchao_installed", lambda: False)
    plan = plan_precision(falcon_tiny(), resolve_config(strategy="none", fp8="torchao", torchao_api="weight_wrapper",
                                                        keep_first_last_linear=False),
                          device=torch.device("cpu"), check_installed=False)
    targets = {e.module_type: e.converted_to for e in plan.fp8}
    assert targets == {"FalconLinear": backend.BYPASSED, "Linear": backend.WRAPPED}


def _falcon_fsdp_case(rank: int, world: int) -> dict:
    from test_fp8_families import FALCON_STEPS, falcon_tiny

    out = {}
    for api in ("module_swap", "weight_wrapper"):  # both gather bf16 weights: the same torchao FP8 GEMMs
        model = wrap_model(falcon_tiny(), strategy="fsdp", fp8="torchao", torchao_api=api, fp8_all_gather=False,
                           keep_first_last_linear=False)  # the tied output head too: wrapped, still tied
        out[api] = dict(losses=train_losses(model, rank, world, steps=FALCON_STEPS),
                        tied=model.lm_head.weight is model.transformer.word_embeddings.weight,
                        targets=sorted({e.converted_to for e in get_plan(model).fp8}))
    return out


def test_falcon_under_fsdp2_trains_with_the_wrapper_exactly_as_with_the_module_swap():
    """Falcon mixes both: FalconLinears swapped (the wrapper would be bypassed), the tied lm_head wrapped; the
    losses equal the module swap's with bf16 all-gather step for step, and the head stays tied."""
    for r in run_ranks(_falcon_fsdp_case):
        swap, wrapper = r["module_swap"], r["weight_wrapper"]
        assert wrapper["losses"] == swap["losses"] and wrapper["tied"] and swap["tied"]
        assert wrapper["targets"] == ["Float8 weight wrapper", "Float8Linear (its forward bypasses the weight wrapper)"]


def _hsdp_case(rank: int, world: int) -> dict:
    from test_hsdp import REPLICAS, _hand_wired_hsdp

    base = build_llama("tiny", seed=0)
    out = {}
    for recipe in ("tensorwise", "rowwise"):
        ours = wrap_model(copy.deepcopy(base), strategy="fsdp", fp8="torchao", torchao_api="weight_wrapper",
                          torchao_recipe=recipe, replicate_degree=REPLICAS)
        ref = _hand_wired_hsdp(_hand_wrapped(copy.deepcopy(base), recipe), fp8=None)  # quantize_, then 2-D mesh
        weight = ours.model.layers[1].self_attn.q_proj.weight
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
        per_module, counter = gemms_per_module(ours, ids)
        out[recipe] = dict(ours=train_losses(ours, rank, world), ref=train_losses(ref, rank, world),
                           plan={e.name: e.converted_to for e in get_plan(ours).fp8}, per_module=per_module,
                           total=counter.count, placements=[repr(p) for p in weight.placements],
                           local=type(weight.to_local()).__name__)
    return out


def test_hsdp_weight_wrapper_matches_quantize_then_fully_shard_on_a_2d_mesh_and_every_fp8_layer_runs_fp8():
    from test_hsdp import REPLICAS, SHARDS

    for rank, by_recipe in enumerate(run_ranks(_hsdp_case, world_size=REPLICAS * SHARDS)):
        for recipe, r in by_recipe.items():
            assert r["ours"] == r["ref"], (rank, recipe)
            assert r["placements"] == ["Replicate()", "Shard(dim=0)"], "HSDP: replicated x sharded"
            assert r["local"] == "Float8TrainingWeightWrapperTensor", "each shard stays wrapped"
            assert len(r["plan"]) == 13 and set(r["plan"].values()) == {"Float8 weight wrapper"}
            assert {n for n, c in r["per_module"].items() if c} == set(r["plan"]), "FP8 exactly where planned"
            assert set(r["per_module"][n] for n in r["plan"]) == {1} and r["total"] == 3 * 13, (recipe, r["total"])
