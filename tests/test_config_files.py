"""Every file a user configures fp8dist with is read by one strict reader (fp8dist.config.files): a key given twice
in one mapping -- which JSON and PyYAML let win silently, the last one -- is an error naming the key and the file,
before anything changes; on the command line one line and exit 2."""

from __future__ import annotations

import json

import pytest

from fp8dist import cli, resolve_config, wrap_model
from fp8dist.train.models import build_llama, read_model_config

LLAMA = '"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, ' \
        '"num_hidden_layers": 1, "num_attention_heads": 2'

# (file name, text, what the message must hold)
DUPLICATES = [
    ("ours.yaml", "strategy: fsdp\nfp8: torchao\nstrategy: ddp\n",
     ["config file '{path}' is not valid YAML: line 3, column 1: the key 'strategy' is given twice in one mapping "
      "(first at line 1): YAML would keep the last silently. Keep one."]),
    ("nested.yml", "fsdp_config:\n  fsdp_version: 2\n  fsdp_version: 1\ndistributed_type: FSDP\n",
     ["config file '{path}' is not valid YAML: line 3, column 3: the key 'fsdp_version' is given twice"]),
    ("ours.json", '{"strategy": "fsdp", "fp8": "torchao", "strategy": "ddp"}',
     ["config file '{path}' gives the key 'strategy' twice in one object ('fsdp', then 'ddp'): JSON would keep the "
      "last silently. Keep one."]),
    ("accelerate.json", '{"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, "fsdp_version": 1}}',
     ["config file '{path}' gives the key 'fsdp_version' twice in one object (2, then 1)"]),
]


@pytest.mark.parametrize("name, text, expected", DUPLICATES, ids=[d[0] for d in DUPLICATES])
def test_a_config_file_with_a_key_twice_is_refused_in_python_and_on_the_command_line(tmp_path, capsys, name, text,
                                                                                    expected):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        resolve_config(path)
    for line in expected:
        assert line.format(path=path) in str(err.value), str(err.value)
    assert cli.main(["plan", "--config", str(path)]) == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and expected[0].format(path=path) in stderr, stderr


def test_yaml_merge_keys_still_merge(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("strategy: fsdp\nfp8: &fp8 none\nparam_dtype: bf16\n")
    assert resolve_config(path).parallel.strategy == "fsdp"
    from fp8dist.config.files import read_config_text

    path.write_text("base: &b {fsdp_version: 2}\nfsdp_config:\n  <<: *b\n  fsdp_version: 1\n")
    assert read_config_text(path) == {"base": {"fsdp_version": 2}, "fsdp_config": {"fsdp_version": 1}}


def test_a_deepspeed_json_with_a_key_twice_is_refused_before_the_model_changes(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "stage": 3}}')
    model = build_llama("tiny", seed=0)
    before = [(p, p.dtype) for p in model.parameters()]
    with pytest.raises(ValueError, match=r"DeepSpeed config '.*ds.json' gives the key 'stage' twice in one object "
                                         r"\(2, then 3\)"):
        wrap_model(model, strategy="deepspeed", ds_config=str(path), optimizer={"type": "AdamW", "lr": 1e-3})
    assert [(p, p.dtype) for p in model.parameters()] == before


def test_a_deepspeed_json_optimizer_block_is_checked_as_any_optimizer_spec(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": "3e-4", "torch_adam": True}}}))
    model = build_llama("tiny", seed=0)
    with pytest.raises(ValueError, match=r"DeepSpeed config '.*ds.json': optimizer lr='3e-4' is a str: "
                                         r"torch.optim.AdamW takes a number"):
        wrap_model(model, strategy="deepspeed", ds_config=str(path))


def test_a_model_config_with_a_key_twice_is_refused(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{" + LLAMA + ', "hidden_size": 64}')
    with pytest.raises(ValueError, match=r"model config '.*config.json' gives the key 'hidden_size' twice in one "
                                         r"object \(32, then 64\)"):
        read_model_config(str(path))
    assert cli.main(["estimate", "--model-config", str(path)]) == 2
    assert "gives the key 'hidden_size' twice" in capsys.readouterr().err
    path.write_text("{" + LLAMA + "}")
    assert read_model_config(str(path)).hidden_size == 32
