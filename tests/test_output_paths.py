"""Every place fp8dist writes a path the user gave checks it before any work (issue 40, item 5): a table of each
output entry, command line and Python, against each way a path cannot be written. The error names the path given
(not a temporary file), and no work happened: no training step, no measurement, no file left behind.

The unwritable folder is under /sys: sysfs refuses new files to everyone, root included (a chmod'ed folder stops
no root, and these tests run as root in CI), so the check is a real write that fails, on any Linux host.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8dist import resolve_config, save_checkpoint, save_pretrained, wrap_model
from fp8dist.cli import main
from fp8dist.train.data import train_tokenizer
from fp8dist.train.metrics import MetricsWriter
from fp8dist.train.models import build_llama
from fp8dist.train.job import TrainConfig, run_training

UNWRITABLE = Path("/sys/fp8dist-output-check")
"""A folder no one can create, root included (see the module's docstring)."""


@dataclass(frozen=True)
class Entry:
    """One output entry: ``write(path)`` gives it ``path`` (a command's exit code, or what the call returned);
    ``directory``: whether it writes a directory there."""

    id: str
    directory: bool
    write: Callable[[Path], Any]
    cli: bool = True


def _cli(*argv: str) -> Callable[[Path], Any]:
    def write(path: Path) -> int:
        return main([a.replace("PATH", str(path)) for a in argv])
    return write


_TRAIN = ("train", "--strategy", "none", "--steps", "1", "--batch-size", "2", "--seq-len", "16")

_NONE = resolve_config({"strategy": "none"})
_MODEL: dict[str, Any] = {}


def _wrapped() -> tuple[Any, Any]:
    """A tiny Llama with torchao FP8 layers and its optimizer (built once: each call reuses it)."""
    if not _MODEL:
        model = wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao")
        _MODEL["model"] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return _MODEL["model"]


def _texts_that_count() -> Any:
    """Texts to train a tokenizer on that say, by raising, that the training started."""
    raise AssertionError("the tokenizer's training started before its directory was checked")
    yield "never"


def _telemetry(path: Path) -> Any:
    from fp8dist.numerics import FP8Telemetry

    model, optimizer = _wrapped()
    return FP8Telemetry(model, every=1, jsonl=path, optimizer=optimizer).close()


ENTRIES = [
    Entry("train --save-pretrained", True, _cli(*_TRAIN, "--save-pretrained", "PATH")),
    Entry("train --checkpoint-dir", True, _cli(*_TRAIN, "--checkpoint-dir", "PATH")),
    Entry("train --metrics-file", False, _cli(*_TRAIN, "--metrics-file", "PATH")),
    Entry("train --tensorboard", True, _cli(*_TRAIN, "--tensorboard", "PATH")),
    Entry("train --fp8-health-file", False, _cli(*_TRAIN, "--fp8", "torchao", "--fp8-health-file", "PATH")),
    Entry("probe --json", False, _cli("probe", "--batches", "1", "--batch-size", "1", "--seq-len", "16", "--json",
                                      "PATH")),
    Entry("ds-config -o", False, _cli("ds-config", "--hidden-size", "64", "-o", "PATH")),
    Entry("bench --out", True, _cli("bench", "--strategies", "none", "--fp8", "none", "--sizes", "tiny", "--steps",
                                    "4", "--no-raw", "--no-plot", "--out", "PATH")),
    Entry("run_training(save_pretrained=)", True,
          lambda p: run_training(_NONE, TrainConfig(steps=1, batch_size=2, seq_len=16, save_pretrained=str(p))),
          cli=False),
    Entry("run_training(metrics_file=)", False,
          lambda p: run_training(_NONE, TrainConfig(steps=1, batch_size=2, seq_len=16, metrics_file=str(p))),
          cli=False),
    Entry("save_pretrained()", True, lambda p: save_pretrained(_wrapped()[0], p), cli=False),
    Entry("save_checkpoint()", True, lambda p: save_checkpoint(p, *_wrapped(), step=1), cli=False),
    Entry("FP8Telemetry(jsonl=)", False, _telemetry, cli=False),
    Entry("train_tokenizer(directory)", True, lambda p: train_tokenizer(_texts_that_count(), p), cli=False),
    Entry("MetricsWriter(path)", False, lambda p: MetricsWriter(p).close(), cli=False),
    Entry("MetricsWriter(tensorboard_dir=)", True, lambda p: MetricsWriter(tensorboard_dir=p).close(), cli=False),
]


def _wrong_kind(tmp: Path, directory: bool) -> tuple[Path, str]:
    """A file where a directory is meant, or a directory where a file is meant."""
    path = tmp / "taken"
    if directory:
        path.write_text("a file the user keeps\n")
        return path, "is a file, and a directory is meant"
    path.mkdir()
    return path, "is a directory, and a file is meant"


def _under_a_file(tmp: Path, directory: bool) -> tuple[Path, str]:
    """Folders above the path cannot be created: one of them is a regular file."""
    (tmp / "notes.txt").write_text("a file the user keeps\n")
    return tmp / "notes.txt" / "run" / "out", f"cannot be created: {str(tmp / 'notes.txt')!r} is not a directory"


def _unwritable(tmp: Path, directory: bool) -> tuple[Path, str]:
    """The nearest existing folder refuses new files."""
    try:
        fd, made = tempfile.mkstemp(dir="/sys")
    except OSError:
        return UNWRITABLE / "out", "cannot be written: creating a file in '/sys' failed"
    os.close(fd)
    os.unlink(made)
    pytest.skip("needs a Linux /sys, where no one can create a file")


CASES = {"wrong kind": _wrong_kind, "under a file": _under_a_file, "unwritable folder": _unwritable}


def _tree(root: Path) -> dict[str, Any]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.id for e in ENTRIES])
def test_an_output_path_is_checked_before_any_work(entry: Entry, case: str, tmp_path: Path, capsys,
                                                   monkeypatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    path, problem = CASES[case](work, entry.directory)
    before = _tree(work)
    if entry.cli:
        assert entry.write(path) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1, err  # one line, no traceback
        message = lines[0]
    else:
        with pytest.raises(ValueError) as caught:
            entry.write(path)
        out, message = capsys.readouterr().out, str(caught.value)
    assert repr(str(path)) in message and problem in message, message
    assert "Pass" in message or "pass" in message, message  # the way out
    assert ".tmp" not in message and "fp8dist-write-check" not in message, message  # no temporary name
    assert "step " not in out and "fp8dist train:" not in out and "cells on" not in out, out  # no work started
    assert _tree(work) == before  # nothing written, nothing left half-made, the user's file intact


def test_atomic_write_names_the_target_not_its_temporary_file(tmp_path: Path) -> None:
    from fp8dist.runtime.files import atomic_write

    def disk_full(tmp: str) -> None:
        raise OSError(28, "No space left on device", tmp)

    with pytest.raises(OSError) as caught:
        atomic_write(tmp_path / "result.json", disk_full)
    assert caught.value.filename == str(tmp_path / "result.json") and caught.value.errno == 28
    assert "result.json'" in str(caught.value) and ".result.json." not in str(caught.value)
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError) as caught:  # renamed over a directory: the temporary name was the one said
        atomic_write(tmp_path / "folder", lambda tmp: Path(tmp).write_text("{}"))
    assert caught.value.filename == str(tmp_path / "folder"), caught.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]  # the temporary file removed

