"""The precision plan: every entry and reason right, conversion never stops at the first odd layer, gates are
clear errors or an announced fallback, and every knob is reachable the same way from Python, YAML and the CLI."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fp8dist import FP8Config, get_plan, plan_precision, resolve_config, wrap_model
from fp8dist.cli import main
from fp8dist.config.schema import flat_fields
from fp8dist.runtime.packages import supported_range
from fp8dist.train.models import build_llama
from fp8dist.plan.precision import FP8UnavailableError

pytest.importorskip("torchao", reason="torchao is not installed")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.first = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 40)       # 40 % 16 != 0
        self.mid = nn.Linear(40, 64)       # 40 % 16 != 0
        self.keep = nn.Linear(64, 64)      # the user filter keeps this one
        self.fine = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 64)

    def forward(self, ids):
        x = self.mid(self.odd(self.first(self.embed(ids))))
        return self.head(self.norm(self.fine(self.keep(x))))


def test_every_entry_and_reason_and_conversion_goes_past_odd_layers():
    model = wrap_model(Odd(), strategy="none", fp8="torchao", fp8_filter=lambda m, fqn: fqn != "keep")
    plan = {e.name: e for e in get_plan(model)}
    assert list(plan) == ["embed", "first", "odd", "mid", "keep", "fine", "norm", "head"]
    expect = {
        "embed": ("fp32", "Embedding is not converted by torchao"),
        "first": ("bf16", "first Linear, kept in high precision (keep_first_last_linear=True)"),
        "odd": ("bf16", "out_features=40 not divisible by 16 (FP8 GEMM tiles)"),
        "mid": ("bf16", "in_features=40 not divisible by 16 (FP8 GEMM tiles)"),
        "keep": ("bf16", "excluded by fp8_filter"),
        "fine": ("fp8", "converted by torchao"),
        "norm": ("fp32", "LayerNorm is not converted by torchao"),
        "head": ("bf16", "last Linear, kept in high precision (keep_first_last_linear=True)"),
    }
    assert {n: (e.precision, e.reason) for n, e in plan.items()} == expect
    assert [n for n, m in model.named_modules() if isinstance(m, Float8Linear)] == ["fine"]
    assert plan["fine"].module_type == "Linear" and plan["fine"].params == 64 * 64 + 64
    text = str(get_plan(model))
    rows = {line.split()[0]: line for line in text.splitlines()[1:]}
    assert "FP8 1 layer / 4,160 params" in text and "excluded by fp8_filter" in rows["keep"]
    assert rows["blocks:"] == "blocks: activation checkpointing none, compile off (auto: off on cpu (compiling costs " \
                              "more than it saves there))"
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()


def test_first_last_can_be_converted_and_patterns_exclude():
    model = wrap_model(Odd(), strategy="none", fp8="torchao", keep_first_last_linear=False,
                       fp8_exclude=["ke*"])
    plan = get_plan(model)
    assert plan.by_name("first").precision == "fp8" and plan.by_name("head").precision == "fp8"
    assert plan.by_name("keep").reason == "matches fp8_exclude 'ke*'"


def test_fsdp_fallback_precision_is_param_dtype():
    plan = plan_precision(build_llama("tiny"), resolve_config(strategy="fsdp", fp8="torchao"),
                          device=torch.device("cpu"))
    assert {e.precision for e in plan if e.precision != "fp8"} == {"bf16"}
    assert len(plan.fp8) == 13 and len(plan) == 21


def test_torchao_missing_is_a_clear_error_or_an_announced_fallback(monkeypatch):
    monkeypatch.setattr("fp8dist.fp8.torchao.torchao_installed", lambda: False)
    hint = re.escape(f"(pip install 'torchao{supported_range('torchao')}')")  # the range pyproject.toml declares
    with pytest.raises(FP8UnavailableError, match="fp8='torchao' cannot run here: torchao is not installed " + hint):
        wrap_model(build_llama("tiny"), strategy="none", fp8="torchao")
    with pytest.warns(UserWarning, match="every layer trains in the strategy's bf16 mixed precision"):
        model = wrap_model(build_llama("tiny"), strategy="none", fp8="torchao", on_unsupported="fallback")
    assert not get_plan(model).fp8 and "fallback: torchao is not installed" in str(get_plan(model))
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


@pytest.mark.parametrize("options,message", [
    (dict(fp8="fp6"), "fp8='fp6' is not valid; choose one of: 'te', 'torchao', 'msamp'"),
    (dict(fp8="te", fp8_format="E5M2"), "fp8_format='E5M2' is not supported.*'HYBRID'.*'E4M3'"),
    (dict(fp8="te", margin=-1), "margin=-1 must be at least 0"),
    (dict(fp8="te", amax_history_len=0), "amax_history_len=0 must be at least 1"),
    (dict(fp8="te", amax_compute_algo="mean"), "amax_compute_algo='mean' is not valid; choose one of: 'max', "
                                               "'most_recent'"),
    (dict(fp8="te", te_recipe="mxfp4"), "te_recipe='mxfp4' is not valid"),
    (dict(fp8="te", override_linear_precision=(True,)), "must be a list of 3 booleans, got 1"),
    (dict(fp8="torchao", torchao_recipe="rowwise", fp8_all_gather=True), "FP8 only with the tensorwise recipe"),
    (dict(fp8="torchao", on_unsupported="ignore"), "on_unsupported='ignore' is not valid"),
    (dict(fp8="torchao", torchao_recipe="rowwise_with_gw_hp"), "mixes the autocast dtype with fp32.*'fsdp'"),
])
def test_bad_fp8_values_fail_before_any_backend_is_touched(options, message):
    # TE is not installed here: the value is reported first all the same
    with pytest.raises(ValueError, match=message):
        wrap_model(build_llama("tiny"), strategy="ddp", **options)


def test_accelerate_yaml_keys(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text("mixed_precision: fp8\nfp8_config:\n  backend: TE\n  fp8_format: E4M3\n  amax_history_len: 32\n"
                    "  amax_compute_algo: most_recent\n  margin: 2\n  interval: 1\n"
                    "  override_linear_precision: [false, false, true]\n  use_autocast_during_eval: true\n"
                    "strategy: fsdp1\n")
    p = resolve_config(path).precision
    assert (p.fp8, p.fp8_format, p.amax_history_len, p.amax_compute_algo, p.margin) == ("te", "E4M3", 32,
                                                                                          "most_recent", 2)
    assert p.override_linear_precision == (False, False, True) and p.use_autocast_during_eval is True
    ao = resolve_config({"mixed_precision": "fp8", "fp8_config": {"backend": "AO"}})
    assert ao.precision.fp8 == "torchao" and ao.parallel.param_dtype == "bf16"
    ms = resolve_config({"mixed_precision": "fp8", "strategy": "ddp", "fp8_config": {"backend": "MSAMP",
                                                                                      "opt_level": "O1"}})
    assert (ms.precision.fp8, ms.precision.opt_level) == ("msamp", "O1")
    no = resolve_config({"mixed_precision": "no"})
    assert no.precision.fp8 is None and no.parallel.param_dtype == "fp32"
    with pytest.raises(ValueError, match="mixed_precision: fp8 needs a backend"):
        resolve_config({"mixed_precision": "fp8"})
    with pytest.raises(ValueError, match="fp8_config.backend='XE'.*'TE', 'AO', 'MSAMP'"):
        resolve_config({"mixed_precision": "fp8", "fp8_config": {"backend": "XE"}})
    with pytest.raises(ValueError, match="key 'amax_history' in fp8_config.*Did you mean 'amax_history_len'"):
        resolve_config({"fp8_config": {"backend": "TE", "amax_history": 3}})
    with pytest.raises(ValueError, match="fp8_config.backend sets fp8='te' but the file also says fp8='torchao'"):
        resolve_config({"fp8": "torchao", "fp8_config": {"backend": "TE"}})


def test_every_fp8_knob_is_a_keyword_a_yaml_key_and_a_cli_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    for _, f in flat_fields(FP8Config):  # each backend's knobs, flat
        assert f"--{f.name.replace('_', '-')}" in help_text
    yaml_path = tmp_path / "k.yaml"
    yaml_path.write_text("fp8: te\namax_history_len: 7\n")
    assert resolve_config(yaml_path).precision.amax_history_len == 7
    assert resolve_config(fp8="te", amax_history_len=7).precision.amax_history_len == 7


def test_knob_of_another_backend_is_reported():
    with pytest.warns(UserWarning, match=r"amax_history_len=16 has no effect here \(read only when fp8 in \['te'\]"):
        wrap_model(build_llama("tiny"), strategy="none", fp8="torchao", amax_history_len=16)


def test_fp8dist_plan_cli(tmp_path, capsys):
    """In-process (cli.main): the console script itself is run by tests/test_train.py."""
    assert main(["plan", "--strategy", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert ("precision plan: fp8=torchao (recipe tensorwise, module_swap (auto), FP8 all-gather on), "
            "strategy=fsdp") in out
    assert "FP8 13 layers / 376,832 params (82.0%)" in out
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "vocab_size": 100, "hidden_size": 200, "intermediate_size": 512, '
                   '"num_hidden_layers": 1, "num_attention_heads": 4}')
    # without --ignore-hardware this is an error (a row of tests/test_bad_inputs.py's CLI table)
    assert main(["plan", "--model-config", str(cfg), "--fp8", "te", "--ignore-hardware"]) == 0
    out = capsys.readouterr().out
    assert "in_features=200 and out_features=200 not divisible by 16" in out
    assert "te.RMSNorm" in out


def test_under_autocast_the_plan_says_bf16_for_every_gemm_not_only_nn_linear():
    """ddp/none run the forward under autocast, which casts every matmul: Mixtral's router and fused experts and
    GPT-2's Conv1D compute in bf16 like nn.Linear; embeddings and norms stay fp32."""
    from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM

    mixtral = MixtralForCausalLM(MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               num_local_experts=4))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=1, n_head=4, n_positions=64))
    expected = {mixtral: {"model.layers.0.mlp.gate": "bf16", "model.layers.0.mlp.experts": "bf16",
                          "model.layers.0.self_attn.q_proj": "bf16", "model.embed_tokens": "fp32",
                          "model.layers.0.input_layernorm": "fp32", "model.norm": "fp32"},
                gpt2: {"transformer.h.0.attn.c_attn": "bf16", "transformer.h.0.mlp.c_fc": "bf16",
                       "transformer.wte": "fp32", "transformer.wpe": "fp32", "transformer.h.0.ln_1": "fp32"}}
    for model, precisions in expected.items():
        for strategy in ("ddp", "none"):
            plan = plan_precision(model, resolve_config(strategy=strategy), device=torch.device("cpu"))
            assert {name: plan.by_name(name).precision for name in precisions} == precisions
