"""The one table of what combines (fp8dist/config/rules.py): each rule is owned by the axis that imposes it, and every
consumer -- wrap_model, the CLI, the estimate, the bench's cells and the Accelerate translator -- refuses a
combination with the same words, derived from the table (the way out included), before anything changes."""

from __future__ import annotations

import warnings

import pytest

import fp8dist
from fp8dist.config import rules as combine
from fp8dist.cli import main
from fp8dist.fp8 import BACKENDS, get_backend
from fp8dist.memory_levels import LEVELS
from fp8dist.train.models import build_llama
from fp8dist.strategies import STRATEGIES

# (options, the same run as a file written by accelerate config)
CASES = {
    "MS-AMP under FSDP2": ({"strategy": "fsdp", "fp8": "msamp"},
                           {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}, "mixed_precision": "fp8",
                            "fp8_config": {"backend": "MSAMP"}}),
    "lean under DeepSpeed": ({"strategy": "deepspeed", "memory": "lean"},
                             {"distributed_type": "DEEPSPEED", "memory": "lean"}),
    "compile with Transformer Engine": ({"strategy": "fsdp", "fp8": "te", "compile": True},
                                        {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2},
                                         "mixed_precision": "fp8", "fp8_config": {"backend": "TE"},
                                         "dynamo_config": {"dynamo_backend": "INDUCTOR"}}),
}


@pytest.mark.parametrize("case", CASES)
def test_every_consumer_refuses_with_the_tables_words(case, tmp_path, capsys):
    options, accelerate = CASES[case]
    expected = combine.refusal_of(**options)
    assert expected is not None and expected.count(".") >= 2, "a reason and a way out"
    model = build_llama("tiny", seed=0)
    before = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ValueError) as err:
        fp8dist.wrap_model(model, **options)
    assert str(err.value) == expected
    assert [(n, type(m)) for n, m in model.named_modules()] == before, "refused before anything changed"
    with pytest.raises(ValueError) as err:
        fp8dist.estimate_memory(build_llama("tiny", seed=0), **options)
    assert str(err.value) == expected
    with pytest.raises(ValueError) as err:
        fp8dist.resolve_config(accelerate)
    assert str(err.value) == expected
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in options.items()]
    assert main(["plan", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"fp8dist plan: error: {expected}"


def test_the_bench_plans_only_cells_the_table_allows_and_refuses_the_rest():
    import argparse

    from fp8dist.bench.runner import check_cells, plan_cells, resolve_settings

    from fp8dist.cli import bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--strategies", "fsdp,fsdp1,deepspeed", "--fp8", "none", "--sizes", "tiny",
                              "--memory", "standard,lean", "--no-raw"])
    settings = resolve_settings(args, "cpu")
    lean = sorted(c.strategy for c in plan_cells(settings) if c.memory == "lean")
    assert lean == ["fsdp"], "fsdp1's flat parameters and DeepSpeed's own optimizer refuse the lean level"
    args.strategies, args.fp8, args.memory, args.compile = "deepspeed", "none", "standard", "on"
    settings = resolve_settings(args, "cpu")
    with pytest.raises(ValueError) as err:
        check_cells(plan_cells(settings), settings, "cpu")
    assert combine.refusal_of(strategy="deepspeed", compile=True) in str(err.value)


def test_each_rule_belongs_to_the_axis_that_imposes_it():
    """The table is what the axes own: every strategy, backend and memory level contributes its own rows and
    nothing else does; a rule involves its owner's choice or an option only its owner reads."""
    table = combine.table()
    axes = {**{f"strategy={n!r}": s for n, s in STRATEGIES.items()},
            **{f"fp8={n!r}": get_backend(n) for n in BACKENDS}, **{f"memory={n!r}": lv for n, lv in LEVELS.items()}}
    assert {owner for owner, _ in table} <= set(axes)
    for owner, rule in table:
        key = owner.split("=")[0]
        knobs = getattr(axes[owner], "Config", None)  # a backend's own knobs, in its Config
        own = {*axes[owner].options, *(getattr(knobs, "__dataclass_fields__", ()))}
        assert key in rule.keys or set(rule.keys) & own, (owner, rule.keys)
    # the rules it holds today, counted from the axes' own modules: one per refusal the README lists
    assert {owner for owner, _ in table} >= {"fp8='msamp'", "fp8='te'", "fp8='torchao'", "memory='lean'",
                                              "strategy='deepspeed'", "strategy='fsdp'"}


def test_a_derived_way_out_lists_only_what_the_whole_table_allows():
    """rowwise_with_gw_hp fails under autocast with bf16: each suggested value combines with the rest as given."""
    message = combine.refusal_of(strategy="ddp", fp8="torchao", torchao_recipe="rowwise_with_gw_hp")
    assert message.startswith("torchao_recipe='rowwise_with_gw_hp' with strategy='ddp' and param_dtype='bf16': ")
    # not the MXFP8 recipes (refused under autocast); NVFP4's Linear casts its operands to bf16 itself; auto never
    # picks rowwise_with_gw_hp where this rule applies
    assert "use torchao_recipe='tensorwise', 'rowwise', 'nvfp4' or 'auto'" in message
    for recipe in ("tensorwise", "rowwise", "nvfp4", "auto"):
        assert combine.refusal_of(strategy="ddp", fp8="torchao", torchao_recipe=recipe) is None
    assert "use strategy='fsdp', 'fsdp1' or 'deepspeed'" in message  # not 'none': it runs under autocast too
    assert "use param_dtype='fp32'" in message
    for strategy in ("fsdp", "fsdp1", "deepspeed"):
        assert combine.refusal_of(strategy=strategy, fp8="torchao", torchao_recipe="rowwise_with_gw_hp") is None


def test_unread_options_name_who_reads_them():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao", amax_history_len=16,
                           offload_param=True, torchao_moe_recipe="mxfp8")
    said = [str(w.message) for w in caught]
    assert any(m.startswith("amax_history_len=16 has no effect here (read only when fp8 in ['te'] and te_recipe in "
                            "['delayed']; fp8='torchao', te_recipe='delayed')") for m in said), said
    assert any(m.startswith("offload_param=True has no effect here (read only when strategy in ['deepspeed'] and "
                            "zero_stage in [3]") for m in said), said
    assert any("torchao_moe_recipe='mxfp8' has no effect: the model has no MoE experts" in m for m in said), said


def test_backends_never_read_the_strategys_name():
    """Every hook of every backend run with a config whose strategy name cannot be read: they decide on the
    strategy's facts (plan.facts) alone."""
    from types import SimpleNamespace

    from fp8dist.runtime.hardware import Hardware

    class Guarded(SimpleNamespace):
        def __getattribute__(self, name):
            if name == "strategy":
                raise AssertionError("an FP8 backend read the strategy's name")
            return super().__getattribute__(name)

    for name in BACKENDS:  # every eligible layer converts (fp8_select='all'): the tiny model is predicted slower on H100
        cfg = fp8dist.resolve_config(strategy="fsdp", fp8=name, fp8_select="all") if name != "msamp" else \
            fp8dist.resolve_config(strategy="ddp", fp8=name)
        plan = fp8dist.plan_precision(build_llama("tiny", seed=0), cfg, device=Hardware("cuda", (9, 0), "H100"),
                                      world_size=2, check_installed=False)
        guarded = SimpleNamespace(parallel=Guarded(**vars(cfg.parallel)), precision=cfg.precision)
        backend, model = get_backend(name), build_llama("tiny", seed=0)
        backend.describe(guarded, plan.facts)
        backend.model_exclusions(model, guarded)
        for fqn, module in model.named_modules():
            if backend.supports(module):
                backend.ineligible_reason(module, fqn, guarded, plan.hardware, plan.facts)
                backend.converted_class(module, guarded, plan.hardware)
        for rule in backend.rules:
            rule.applies(guarded, plan.facts)
        if name == "torchao":  # the one backend that runs here: its conversion and wiring too
            backend.convert(model, plan, guarded)
            backend.after_shard(model, model, plan, guarded, None)
            assert any(type(m).__name__ == "Float8Linear" for m in model.modules())
