"""The config schema: defaults defined once, kwargs / YAML / CLI all land in it, bad values are clear errors."""

from __future__ import annotations

import pytest
import torch

import fp8dist
from fp8dist import Config, FP8Config, StrategyConfig, resolve_config, wrap_model
from fp8dist.cli import main
from fp8dist.config.schema import flat_fields
from fp8dist.train.job import TrainConfig


def test_defaults_are_bf16_params_fp32_reduce_fp32_buffers_fsdp2():
    cfg = resolve_config()
    assert cfg.parallel == StrategyConfig(strategy="fsdp", param_dtype="bf16", reduce_dtype="fp32",
                                          buffer_dtype="fp32")
    assert cfg.precision.fp8 is None


@pytest.mark.parametrize("given", [torch.bfloat16, "bfloat16", "BF16", "torch.bfloat16"])
def test_dtype_spellings_normalize(given):
    assert StrategyConfig(param_dtype=given).param_dtype == "bf16"


def test_fp8_none_string_means_no_fp8():
    assert FP8Config(fp8="none").fp8 is None


@pytest.mark.parametrize("key,value,expected", [
    ("strategy", "fdsp", ["strategy='fdsp'", "'fsdp1'", "'ddp'", "Did you mean 'fsdp'"]),
    ("param_dtype", "int8", ["param_dtype='int8'", "'fp32', 'bf16', 'fp16'"]),
    ("reduce_dtype", "fp64", ["reduce_dtype='fp64'", "'fp32', 'bf16', 'fp16'"]),
    ("buffer_dtype", 3, ["buffer_dtype=3", "'fp32'"]),
    ("reshard_after_forward", "maybe", ["reshard_after_forward='maybe'", "true or false (also yes/no, 1/0)"]),
    ("zero_stage", "4", ["zero_stage='4'", "1, 2, 3"]),
    ("fp8_exclude", 5, ["fp8_exclude=5", "a list of names", "['lm_head', '*.mlp.*']", "not int"]),
    ("fp8_exclude", {"lm_head": True}, ["fp8_exclude={'lm_head': True}", "a list of names", "not dict"]),
    ("override_linear_precision", [True, False], ["a list of 3 booleans, got 2"]),
    ("fp8", "fp8e4", ["fp8='fp8e4'", "'te', 'torchao', 'msamp'"]),
])
def test_bad_values_name_field_value_and_choices(key, value, expected):
    with pytest.raises(ValueError) as err:
        resolve_config(**{key: value})
    for text in expected:
        assert text in str(err.value)


def test_unknown_option_is_an_error_with_a_suggestion():
    with pytest.raises(ValueError, match=r"reduce_dtpye.*Did you mean 'reduce_dtype'"):
        wrap_model(torch.nn.Linear(4, 4), strategy="fsdp", reduce_dtpye="bf16")


def test_yaml_file_then_keyword_overrides(tmp_path):
    path = tmp_path / "fp8dist.yaml"
    path.write_text("strategy: fsdp1\nparam_dtype: fp32\nblock_classes: [LlamaDecoderLayer]\n")
    cfg = resolve_config(path, param_dtype="bf16")
    assert cfg.parallel.strategy == "fsdp1"
    assert cfg.parallel.param_dtype == "bf16"  # the keyword wins over the file
    assert cfg.parallel.block_classes == ("LlamaDecoderLayer",)
    assert Config.from_dict(cfg.to_dict()) == cfg


def test_yaml_unknown_key_and_bad_value_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("strategy: fsdp\nparam_dtpye: bf16\n")
    with pytest.raises(ValueError, match=r"param_dtpye.*bad\.yaml.*Did you mean 'param_dtype'"):
        resolve_config(path)
    path.write_text("reduce_dtype: int4\n")
    with pytest.raises(ValueError, match=r"reduce_dtype='int4'"):
        resolve_config(path)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        resolve_config(tmp_path / "missing.yaml")


def test_cli_flags_come_from_the_dataclasses(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for cls in (StrategyConfig, FP8Config, TrainConfig):
        for _, f in flat_fields(cls):  # FP8Config's: each backend's knobs, flat
            assert f"--{f.name.replace('_', '-')}" in help_text
    assert "(default: fsdp)" in help_text and "(default: fp32)" in help_text
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--strategy", "fdsp"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --strategy: strategy='fdsp' is not valid; choose one of: 'none', 'ddp', 'fsdp'" in err
    assert "Did you mean 'fsdp'?" in err


# Python, files and the command line read every value the same way
SAME_VALUES = [
    ("strategy", "FSDP", "fsdp"), ("param_dtype", "bfloat16", "bf16"), ("param_dtype", "BF16", "bf16"),
    ("fp8_format", "hybrid", "HYBRID"), ("opt_level", "o1", "O1"), ("fp8", "none", None), ("fp8", "TorchAO", "torchao"),
    ("zero_stage", "3", 3), ("micro_batch_size", "4", 4), ("gradient_clipping", "0.5", 0.5),
    ("reshard_after_forward", "no", False), ("reshard_after_forward", "Yes", True), ("reshard_after_forward", "0", False),
    ("override_linear_precision", ["false", "yes", "1"], (False, True, True)),
    ("fp8_exclude", "lm_head", ("lm_head",)),
]


@pytest.mark.parametrize("key,given,expected", SAME_VALUES)
def test_python_files_and_flags_normalize_the_same_way(key, given, expected, tmp_path):
    from fp8dist.config.schema import flat_fields

    section = "parallel" if key in {f.name for _, f in flat_fields(StrategyConfig)} else "precision"
    assert getattr(getattr(Config.from_dict({key: given}), section), key) == expected
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: {given!r}\n" if not isinstance(given, list) else f"{key}: {given}\n")
    assert resolve_config(path).to_dict()[key] == (list(expected) if isinstance(expected, tuple) else expected)


@pytest.mark.parametrize("argv,expected", [
    (["--override-linear-precision", "false", "false", "false"], (False, False, False)),
    (["--override-linear-precision", "yes", "no", "1"], (True, False, True)),
    (["--keep-first-last-linear", "false"], False),
    (["--keep-first-last-linear", "no"], False),
    (["--keep-first-last-linear"], True),
    (["--no-keep-first-last-linear"], False),
    (["--fp8-all-gather", "none"], None),
    (["--strategy", "FSDP1"], "fsdp1"),
    (["--param-dtype", "bfloat16"], "bf16"),
])
def test_cli_bool_and_choice_flags_parse_like_python(argv, expected, monkeypatch):
    from fp8dist import cli

    seen = {}
    monkeypatch.setattr(cli.plan, "run", lambda args: seen.update(vars(args)) or 0)
    assert main(["plan", *argv]) == 0
    key = argv[0].removeprefix("--").removeprefix("no-").replace("-", "_")
    assert Config.from_dict({key: seen[key]}).to_dict()[key] == (list(expected) if isinstance(expected, tuple)
                                                                 else expected)


@pytest.mark.parametrize("argv,message", [
    (["--override-linear-precision", "false", "maybe", "true"], "override_linear_precision='maybe' must be true or false"),
    (["--override-linear-precision", "false", "false"], "expected 3 arguments"),
    (["--keep-first-last-linear", "perhaps"], "keep_first_last_linear='perhaps' must be true or false"),
    (["--no-keep-first-last-linear", "true"], "unrecognized arguments: true"),
])
def test_cli_bad_bool_flags_exit_2_naming_the_choices(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_train_config_rejects_bad_numbers():
    with pytest.raises(ValueError, match="steps=0 must be at least 1"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="model_size='huge'.*'tiny', 'small', 'medium'"):
        TrainConfig(model_size="huge")


def test_public_api_is_explicit():
    assert "wrap_model" in fp8dist.__all__
    for name in fp8dist.__all__:
        assert hasattr(fp8dist, name)
