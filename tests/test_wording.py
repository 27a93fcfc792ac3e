"""Wording (issue 40, item 17): counts and nouns agree in every message (one helper), the token cache line says
what was tokenized now, --save-pretrained writes the checkpoint's dtype, a warning on the command line is one line,
and the package's license metadata is in the form setuptools no longer deprecates."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from fp8dist import save_pretrained
from fp8dist.train.models import build_llama


def test_counts_and_nouns_agree_in_every_message() -> None:
    """One rule for plurals (fp8dist.config.text.plural): no message of the library writes "file(s)" or "batch(es)"."""
    import io
    import tokenize

    import fp8dist
    from fp8dist.config.text import plural
    from fp8dist.train.schedule import describe_schedule

    assert [plural(1, "step"), plural(2, "step"), plural(0, "file"), plural(2, "process"), plural(1024, "window")] \
        == ["1 step", "2 steps", "0 files", "2 processes", "1,024 windows"]
    assert describe_schedule("cosine", 2).startswith("linear warm-up over 1 step, then")  # was "over 1 steps"
    strings = (tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING))
    found = []
    for path in sorted(Path(fp8dist.__file__).parent.rglob("*.py")):
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            text = re.sub(r"\{[^{}]*\}", "", token.string)  # an f-string's fields are code: len(s) is no plural
            if token.type in strings and re.search(r"[a-z]\((?:s|es)\)", text):
                found.append(f"{path.name}:{token.start[0]}: {token.string.strip()[:60]}")
    assert found == [], "use fp8dist.config.text.plural:\n" + "\n".join(found)


def test_the_token_cache_line_says_what_was_tokenized_now(tmp_path: Path) -> None:
    """A first tokenization says "tokenized now"; a launcher's ranks, reading what it cached, say when."""
    from fp8dist.train.data import load_text_corpus, make_corpus, train_tokenizer

    (tmp_path / "a.txt").write_text(make_corpus(40, seed=0))
    (tmp_path / "b.txt").write_text(make_corpus(40, seed=1))
    train_tokenizer([make_corpus(40, seed=0)], tmp_path / "tok", vocab_size=300)
    load = lambda *names: load_text_corpus([tmp_path / n for n in names], tokenizer=tmp_path / "tok",  # noqa: E731
                                           cache_dir=tmp_path / "cache").describe()
    assert load("a.txt").startswith("1 file, ")
    first = load_text_corpus([tmp_path / "b.txt"], tokenizer=tmp_path / "tok", cache_dir=tmp_path / "other")
    assert first.describe().endswith("; tokenized now)") and "token cache" not in first.describe()
    again = load("a.txt", "b.txt")  # a.txt cached above, b.txt not in this cache yet
    assert again.startswith("2 files, ") and "; 1 file tokenized now, 1 read from the token cache (tokenized " in again
    assert re.search(r"; read from the token cache \(tokenized \d+ s ago\)\)$", load("a.txt", "b.txt"))


def test_save_dtype_defaults_to_the_checkpoints_and_a_warning_is_one_line(tmp_path: Path) -> None:
    """--save-pretrained writes the dtype the --pretrained checkpoint holds (as-loaded, the default), bf16 from
    scratch, or the --save-dtype asked; and a warning on the command line is one line, not a source line of
    fp8dist's code (amax_history_len has no effect under torchao: the command warns)."""
    from safetensors import safe_open

    from fp8dist.checkpoint.hf import export_dtype
    from cli_helpers import run

    source = tmp_path / "fp32-model"
    save_pretrained(build_llama("tiny", seed=0), source, dtype="fp32")
    save_pretrained(build_llama("tiny", seed=0), tmp_path / "bf16-model", dtype="bf16")
    assert [export_dtype("as-loaded", source), export_dtype("as-loaded", tmp_path / "bf16-model"),
            export_dtype("as-loaded", None), export_dtype("fp16", source)] == ["fp32", "bf16", "bf16", "fp16"]
    out = tmp_path / "out"
    done = run(["fp8dist", "train", "--strategy", "none", "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                "--pretrained", str(source), "--save-pretrained", str(out), "--amax-history-len", "16"])
    assert done.returncode == 0, done.stderr
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}  # was BF16 whatever the checkpoint held
    assert f"save_pretrained: wrote {out} (" in done.stdout and ", fp32) in " in done.stdout
    warned = [line for line in done.stderr.splitlines() if "amax_history_len=16" in line]
    assert warned == ["fp8dist train: warning: amax_history_len=16 has no effect here (read only when fp8 in ['te'] "
                      "and te_recipe in ['delayed']; fp8='torchao', te_recipe='delayed')."], done.stderr
    assert ".py:" not in done.stderr and "wrap_model(" not in done.stderr, done.stderr  # no file, line or source


def test_the_package_metadata_names_its_license_as_an_spdx_expression(tmp_path: Path) -> None:
    """pyproject.toml's license is an SPDX string with its file (setuptools deprecated the table form, and its
    builds would stop in 2027): the metadata says License-Expression, ships LICENSE, and the build warns of nothing."""
    from cli_helpers import ROOT

    build = ("from setuptools import build_meta; import sys; "
             "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    done = subprocess.run([sys.executable, "-W", "always", "-c", build, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    metadata = (tmp_path / done.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert "Warning" not in done.stderr and "deprecated" not in done.stderr, done.stderr


def test_fp8_on_an_amx_cpu_runs_atens_gemm_and_says_so() -> None:
    """fp8dist train turns oneDNN off where its FP8 GEMM is the reference kernel (an AMX CPU) and says so in one
    line; elsewhere nothing changes. Run in a process without the suite's own switch (tests/site)."""
    code = ("import torch, json; from fp8dist.runtime.env import aten_cpu_fp8_gemms; "
            "line = aten_cpu_fp8_gemms(); print(json.dumps([line, torch.backends.mkldnn.enabled]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    line, enabled = json.loads(done.stdout.splitlines()[-1])
    flags = next((set(row.split()) for row in Path("/proc/cpuinfo").read_text().splitlines()
                  if row.startswith("flags")), set())
    if flags & {"amx_int8", "amx_fp16"}:
        assert line.startswith("cpu: oneDNN off for this process") and enabled is False
    else:
        assert line is None and enabled is True
