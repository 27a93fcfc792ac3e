"""``fp8dist train``'s own inputs that a user's file or folder makes bad: a --model-config (or --pretrained
config.json) transformers rejects or cannot build as a causal LM, a --data path that is not a regular file, a
--data-cache that is a file, --tensorboard without its package: one line naming the file, the problem and the way
out, exit 2, before any process starts; and --text-field over plain text said once as an option with no effect."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fp8dist.cli import main

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 4}
BERT = {"model_type": "bert", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4}

CONFIGS = [
    ("heads not dividing hidden", {**LLAMA, "num_attention_heads": 5},
     ("c.json: transformers rejects this llama config: The hidden size (64) is not a multiple of the number of "
      "attention heads (5). Fix that value in the file.",)),
    ("a string where an int belongs", {**LLAMA, "hidden_size": "64"},
     ("c.json: transformers rejects this llama config: Field 'hidden_size' expected int, got str (value: '64')",)),
    ("a float where an int belongs", {**LLAMA, "num_hidden_layers": 1.5},
     ("Field 'num_hidden_layers' expected int, got float",)),
    ("unknown model_type", {**LLAMA, "model_type": "lama"},
     ("c.json: model_type='lama' is not a model family this transformers knows (did you mean 'llama'?)",)),
    ("a model transformers cannot build", {"model_type": "gpt2", "n_embd": 64, "n_head": 5, "n_layer": 1,
                                           "vocab_size": 256},
     ("c.json: transformers cannot build a gpt2 model from it: `embed_dim` must be divisible by num_heads",)),
    ("a family with no causal LM", {"model_type": "t5", "vocab_size": 256},
     ("c.json: model_type 't5' has no causal-LM model in transformers", "families AutoModelForCausalLM builds, e.g. "
                                                                          "llama, mistral")),
    ("an encoder", BERT, ("c.json: BertLMHeadModel (bert) with \"is_decoder\": false attends both ways",
                          "Set \"is_decoder\": true in the config")),
    ("an encoder of another family", {**BERT, "model_type": "roberta", "pad_token_id": 1},
     ("RobertaForCausalLM (roberta) with \"is_decoder\": false attends both ways",)),
]


@pytest.fixture(autouse=True)
def _transformers_logs_off():
    """transformers' own log lines (a config's out-of-range eos id, BERT's is_decoder hint) go to a stream handler
    made once per process, which an earlier test's captured stderr may have closed: off here, the error line is
    fp8dist's."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity(level)


def _refused(argv: list[str], capsys) -> str:
    """The one error line of ``fp8dist ARGV`` (exit 2, no traceback, before any process starts)."""
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and "starting" not in out, err
    assert len(lines) == 1 and lines[0].startswith(f"fp8dist {argv[0]}: error: "), err
    return lines[0]


@pytest.mark.parametrize("case_id,config,texts", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_a_model_config_transformers_rejects_is_one_line(case_id, config, texts, tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(config))
    line = _refused(["train", "--model-config", str(tmp_path / "c.json"), "--nproc", "1", "--steps", "1"], capsys)
    for text in texts:
        assert text in line, line


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_plan_and_estimate_read_a_model_config_the_same_way(command, tmp_path, capsys):
    (tmp_path / "c.json").write_text(json.dumps(BERT))
    assert "attends both ways" in _refused([command, "--model-config", str(tmp_path / "c.json")], capsys)


def test_a_pretrained_directory_whose_config_transformers_rejects_is_one_line(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**LLAMA, "num_attention_heads": 5}))
    line = _refused(["train", "--pretrained", str(tmp_path / "model"), "--nproc", "1"], capsys)
    assert f"pretrained={str(tmp_path / 'model')!r}: transformers cannot read its config.json (The hidden size (64) " \
           "is not a multiple of the number of attention heads (5)). Fix the file" in line, line


def _special(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / kind
    if kind == "loop":
        path.symlink_to(path)
    elif kind == "fifo":
        os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind,text", [
    ("loop", "cannot be opened (Symlink loop from"),
    ("fifo", "is a FIFO (named pipe): only regular files are read"),
])
def test_data_that_is_not_a_regular_file_is_one_line_and_leaves_no_cache(kind, text, tmp_path, capsys):
    path = _special(tmp_path, kind)
    line = _refused(["train", "--data", str(path), "--tokenizer", str(tmp_path / "tok"), "--data-cache",
                     str(tmp_path / "cache" / "tokens"), "--nproc", "1"], capsys)
    assert f"data file {str(path)!r} " in line and text.split(" (")[0] in line, line
    if kind == "fifo":
        assert text in line, line
    assert not (tmp_path / "cache").exists()


def test_a_data_cache_that_is_a_file_names_the_flag(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("The cat sees a small boat.\n")
    (tmp_path / "cache").write_text("")
    line = _refused(["train", "--data", str(tmp_path / "notes.txt"), "--tokenizer", str(tmp_path / "tok"),
                     "--data-cache", str(tmp_path / "cache"), "--nproc", "1"], capsys)
    assert f"data_cache={str(tmp_path / 'cache')!r} (--data-cache) is a file, not a directory: pass --data-cache a " \
           "directory (made if missing)" in line, line


@pytest.mark.parametrize("files", [{"tokenizer_config.json": '{"tokenizer_class": 5}'},
                                   {"tokenizer.json": "{", "tokenizer_config.json": "{}"}])
def test_a_tokenizer_folder_transformers_cannot_read_is_one_line(files, tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    for name, text in files.items():
        (tmp_path / "tok" / name).write_text(text)
    (tmp_path / "notes.txt").write_text("The cat sees a small boat.\n")
    line = _refused(["train", "--data", str(tmp_path / "notes.txt"), "--tokenizer", str(tmp_path / "tok"),
                     "--data-cache", str(tmp_path / "cache"), "--nproc", "1"], capsys)
    assert f"tokenizer {str(tmp_path / 'tok')!r}: transformers cannot read it as a tokenizer (" in line, line
    assert not (tmp_path / "cache").exists()


def test_tensorboard_that_cannot_be_imported_is_one_line(tmp_path):
    """tensorboard made unimportable in a fresh interpreter (its distribution may still be installed)."""
    code = (f"import sys; sys.modules['tensorboard'] = None; from fp8dist.cli import main; "
            f"sys.exit(main(['train', '--tensorboard', {str(tmp_path / 'tb')!r}, '--nproc', '1', '--strategy', "
            f"'none', '--steps', '1', '--fp8', 'none']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("fp8dist train")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines == [f"fp8dist train: error: tensorboard={str(tmp_path / 'tb')!r} needs the tensorboard package, which "
                     "cannot be imported here (import of tensorboard halted; None in sys.modules): pip install "
                     "'fp8dist[tensorboard]' (or leave --tensorboard out; --metrics-file needs nothing)."], proc.stderr
    assert "step" not in proc.stdout and not (tmp_path / "tb").exists()


def test_text_field_over_plain_text_is_said_once_as_an_option_with_no_effect(tmp_path):
    from text_corpus import write_text_corpus

    made = write_text_corpus(tmp_path)
    argv = ["train", "--data", str(made.text), "--tokenizer", str(made.tokenizer), "--text-field", "body",
            "--data-cache", str(tmp_path / "cache"), "--nproc", "1", "--strategy", "none", "--fp8", "none",
            "--steps", "1", "--batch-size", "2", "--seq-len", "32"]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert main(argv) == 0
    notes = [str(w.message) for w in said if "text_field" in str(w.message)]
    assert notes == ["text_field='body' has no effect here (read only from JSON-lines files, .jsonl, .ndjson, .json; "
                     "the data is plain text: corpus.txt)."]
