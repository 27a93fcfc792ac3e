"""torchao_recipe='auto': the plan picks each layer's recipe (the one predicted fastest among those torchao's module
swap mixes in one model), each row says which and why, and the conversion runs exactly that recipe per layer:
losses equal torchao's convert_to_float8_training called once per recipe by hand, on 2 FSDP2 ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import run_ranks
from helpers import hand_wired_fsdp2, one_thread, train_losses  # noqa: F401 (one_thread: a fixture)
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

from fp8dist import get_plan, plan_precision, wrap_model  # noqa: E402
from fp8dist.config.resolve import resolve_config  # noqa: E402
from fp8dist.runtime.hardware import Hardware, parse_target  # noqa: E402
from fp8dist.plan.speed import predict_linear  # noqa: E402
from fp8dist.train.models import llama_config  # noqa: E402

MIXED = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _plan(model, target, **options):
    cfg = resolve_config(**{"fp8": "torchao", "strategy": "fsdp", "torchao_recipe": "auto", **options})
    return plan_precision(model, cfg, device=target, world_size=8, check_installed=False)


def _meta_llama(size: str):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(llama_config(size))


def test_the_1b_plan_on_h100_mixes_recipes_and_each_row_says_which_and_why():
    plan = _plan(_meta_llama("1b"), parse_target("h100"), micro_batch_size=1, seq_len=2048)
    picked = {e.recipe for e in plan.fp8}
    assert picked == {"tensorwise", "rowwise_with_gw_hp"}, "attention and MLP shapes pick different recipes"
    for e in plan.fp8:  # the pick is the fastest of the three, predicted at this run's 2,048 tokens
        m = plan.by_name(e.name)
        best = max(MIXED, key=lambda r: predict_linear(2048, e.predicted[0].k, e.predicted[0].n, target="h100",
                                                        recipe=r).speedup)
        assert e.recipe == best and e.predicted[0].recipe == best and e.speedup >= 1
        assert f"recipe {best}, the fastest predicted (else " in m.reason and "predicted " in m.reason
    kept = [e for e in plan if e.precision != "fp8" and e.predicted]
    assert kept and all("the fastest of tensorwise, rowwise, rowwise_with_gw_hp" in e.reason and e.recipe is None
                        and e.speedup < 1 for e in kept), "bf16 where no recipe pays, saying the best one's figure"
    assert "\nrecipes: torchao_recipe='auto': each layer runs the recipe predicted fastest on H100" in str(plan)
    assert plan.selection.to_dict()["recipes"] == plan.selection.recipes
    assert plan.selection.step.recipe == "auto" and "(auto, " in str(plan)


def test_auto_without_a_gpu_is_tensorwise_everywhere_and_says_so():
    plan = _plan(_meta_llama("tiny"), Hardware("cpu"))
    assert plan.fp8 and {e.recipe for e in plan.fp8} == {"tensorwise"}
    assert all("recipe tensorwise, the first of tensorwise, rowwise, rowwise_with_gw_hp" in e.reason
               for e in plan.fp8)
    assert any("no GPU to predict for, so every eligible layer runs tensorwise" in n for n in plan.notes)


def test_auto_under_autocast_leaves_out_the_recipe_that_fails_there():
    """DDP runs the forward under autocast: rowwise_with_gw_hp's weight-gradient GEMM fails there (a Rule of that
    recipe), so auto never picks it."""
    plan = _plan(_meta_llama("1b"), parse_target("h100"), strategy="ddp", micro_batch_size=1, seq_len=2048)
    assert plan.fp8 and {e.recipe for e in plan.fp8} <= {"tensorwise", "rowwise"}
    assert "among tensorwise, rowwise (the recipes" in plan.selection.recipes


def test_auto_through_the_weight_wrapper_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match="torchao_recipe='auto' mixes recipes through torchao's module swap") as error:
        wrap_model(_meta_llama("tiny"), strategy="fsdp", fp8="torchao", torchao_recipe="auto",
                   torchao_api="weight_wrapper")
    assert "Use torchao_api='module_swap' (or 'auto') with torchao_recipe='auto'" in str(error.value)


class _ScaleShapes(TorchDispatchMode):
    """Per Linear, how many scales its forward FP8 GEMM's input has: 1 per tensor, one per row (64 rows here)."""

    def __init__(self, model):
        super().__init__()
        self.current, self.seen, self.handles = None, {}, []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                self.handles += [module.register_forward_pre_hook(lambda m, a, n=name: setattr(self, "current", n)),
                                 module.register_forward_hook(lambda m, a, o: setattr(self, "current", None))]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # torchao's FP8 GEMM: aten.mm on two Float8TrainingTensors (as fp8dist.fp8.weight_wrapper.FP8Gemms counts)
        fp8 = {type(a).__name__ for a in args[:2]} == {"Float8TrainingTensor"}
        if func is torch.ops.aten.mm.default and fp8 and self.current is not None:
            self.seen.setdefault(self.current, args[0]._scale.numel())
        return func(*args, **(kwargs or {}))


def _mixed_llama():
    """One Llama block whose attention (1024 x 1024) and MLP (1024 x 4096) are predicted fastest under different
    recipes on an H100 at 8,192 tokens (rowwise_with_gw_hp 1.26x vs tensorwise 1.07x; tensorwise 1.43x vs 1.41x)."""
    from transformers import LlamaForCausalLM

    config = llama_config("tiny")
    config.update(dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=1, num_attention_heads=8,
                       num_key_value_heads=8))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def _mixed_case(rank: int, world: int) -> dict:
    import fp8dist.plan.selection as selection
    from fp8dist.runtime.hardware import find_gpu
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    # wrap_model plans for the device it runs on (a CPU here, where auto is tensorwise everywhere): predict as for
    # an H100 instead, to get the plan a GPU run would get, and train it here
    h100 = find_gpu(parse_target("h100"))
    selection.find_gpu = lambda hardware: h100
    base = _mixed_llama()
    ours = wrap_model(copy.deepcopy(base), strategy="fsdp", fp8="torchao", torchao_recipe="auto",
                      micro_batch_size=4, seq_len=2048, compile=False)
    picked = {e.name: e.recipe for e in get_plan(ours).fp8}
    ref = copy.deepcopy(base)
    for recipe in sorted(set(picked.values())):  # torchao by hand: one conversion per recipe, its layers' filter
        config = (Float8LinearConfig(enable_fsdp_float8_all_gather=True) if recipe == "tensorwise" else
                  Float8LinearConfig.from_recipe_name(recipe))
        names = {n for n, r in picked.items() if r == recipe}
        convert_to_float8_training(ref, config=config, module_filter_fn=lambda m, fqn, names=names: fqn in names)
    hand_wired_fsdp2(ref, world)
    losses = train_losses(ours, rank, world)  # the scale precompute of the FP8 all-gather: hooked to the step
    gathered = {n: type(ours.get_submodule(n).weight._local_tensor).__name__ for n in picked}
    ids = torch.randint(0, 256, (2, 32))
    with _ScaleShapes(ours) as shapes:
        ours(input_ids=ids, labels=ids)
    ref_losses = train_losses(ref, rank, world, after_step=lambda: precompute_float8_dynamic_scale_for_fsdp(ref))
    return dict(ours=losses, ref=ref_losses, picked=picked, scales=shapes.seen, gathered=gathered,
                report=str(fp8dist_report(ours)))


def fp8dist_report(model):
    from fp8dist import report

    return report(model)


def test_a_mixed_plan_trains_equal_to_torchao_by_hand_each_layer_on_its_recipe():
    for r in run_ranks(_mixed_case):
        assert set(r["picked"].values()) == {"tensorwise", "rowwise_with_gw_hp"}
        assert r["ours"] == r["ref"]
        assert set(r["scales"]) == set(r["picked"]), "every planned layer ran an FP8 GEMM, no other"
        for name, recipe in r["picked"].items():  # forward GEMM's input scale: one per tensor, or one per row
            assert r["scales"][name] == (1 if recipe == "tensorwise" else 64), name
            fp8_gathered = r["gathered"][name] == "WeightWithDynamicFloat8CastTensor"
            assert fp8_gathered == (recipe == "tensorwise"), f"{name}: FP8 all-gather for tensorwise layers only"
        assert "tensorwise" in r["report"] and "axiswise" in r["report"], "the report shows both recipes"
        assert "fp8 e4m3 (FP8 all-gather of 3 of 6 weights, the others in the param dtype)" in r["report"]


def test_compare_recipes_shows_the_mix_beside_each_recipe(capsys):
    """On a B200, auto's GEMM time is at most any mixable recipe's (each layer takes the fastest of them, or bf16);
    MXFP8 and NVFP4 are listed as whole-model answers."""
    from fp8dist.cli import main

    argv = ["plan", "--model-size", "1b", "--target", "b200", "--fp8", "torchao", "--torchao-recipe", "auto",
            "--micro-batch-size", "1", "--seq-len", "2048", "--compare-recipes"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index(next(line for line in out if line.startswith("recipes compared on B200"))) + 3
    table = {line.split()[0]: float(line.split()[1]) for line in out[start:]}
    assert list(table) == ["bf16", *MIXED, "mxfp8", "nvfp4", "auto"]
    assert table["auto"] <= min(table[r] for r in MIXED) < table["bf16"]


def test_the_probe_casts_each_layer_by_its_own_recipe(one_thread):
    """Under auto the probe emulates each planned layer's own recipe: the MLP (tensorwise) measures exactly what a
    tensorwise probe measures, the attention (rowwise_with_gw_hp) is cast per row."""
    from fp8dist import measure_fp8_numerics

    model, ids = _mixed_llama(), torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    options = dict(target="h100", micro_batch_size=4, seq_len=2048)
    mixed = measure_fp8_numerics(model, [ids], torchao_recipe="auto", **options)
    tensorwise = {layer.name: layer for layer in measure_fp8_numerics(model, [ids], **options).layers}
    plan = _plan(model, parse_target("h100"), micro_batch_size=4, seq_len=2048, fp8_select="all")
    picked = {e.name: e.recipe for e in plan.fp8}
    assert set(picked.values()) == {"tensorwise", "rowwise_with_gw_hp"} and len(mixed.layers) == len(picked)
    for layer in mixed.layers:
        casts = [c.cast for c in layer.casts]
        if picked[layer.name] == "tensorwise":
            assert layer.output.sqnr_db == tensorwise[layer.name].output.sqnr_db and casts == [
                c.cast for c in tensorwise[layer.name].casts]
        else:
            assert "e4m3 rowwise pow2" in casts and not any("e5m2" in c for c in casts), layer.name


def test_auto_on_a_cpu_trains_as_tensorwise():
    """No GPU to predict for: auto is the one-recipe answer, tensorwise on every eligible layer, step for step."""
    from fp8dist.train.models import build_llama

    base = build_llama("tiny", seed=0)
    with pytest.warns(UserWarning, match="no GPU to predict for, so every eligible layer runs tensorwise"):
        auto = wrap_model(copy.deepcopy(base), strategy="none", fp8="torchao", torchao_recipe="auto")
    tensorwise = wrap_model(copy.deepcopy(base), strategy="none", fp8="torchao", torchao_recipe="tensorwise")
    assert {e.recipe for e in get_plan(auto).fp8} == {"tensorwise"}
    assert train_losses(auto, 0, 1) == train_losses(tensorwise, 0, 1)
