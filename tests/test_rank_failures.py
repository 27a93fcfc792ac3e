"""A failure on one rank alone (its disk, its mount, its part of a tensor) raises the same clear error on every
rank instead of leaving the others waiting forever in the next collective: save_checkpoint, load_checkpoint,
pretrained= and an error a training rank raises under a launcher. 2 real gloo ranks, every case in one spawn."""

from __future__ import annotations

import contextlib
import errno
import io
import resource
import signal
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dist_harness import run_ranks


def _error(call) -> tuple[str, str]:
    """(class name, message) of what ``call`` raised; never a BaseException that escapes ``except Exception``."""
    try:
        call()
    except Exception as err:
        return type(err).__name__, str(err)
    return "nothing raised", ""


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """Writes past ``nbytes`` fail in this process as on a full disk (EFBIG instead of ENOSPC), from the kernel."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write returns EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _checkpoint_cases(rank: int, world: int, root: str) -> dict:
    import fp8dist.checkpoint.save_load as save_load
    from fp8dist import load_checkpoint, save_checkpoint, wrap_model

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = wrap_model(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)), strategy="fsdp")  # a shard per rank
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    ckpt = Path(root) / "ckpt"
    save_checkpoint(ckpt, model, opt, step=1)
    out: dict = {}

    def read_only(directory: Path) -> None:  # rank 0 alone touches the directory first: a read-only mount
        raise OSError(errno.EROFS, "Read-only file system", str(directory))

    leftovers = save_load._remove_leftovers
    if rank == 0:
        save_load._remove_leftovers = read_only
    out["read-only"] = _error(lambda: save_checkpoint(ckpt, model, opt, step=2))
    save_load._remove_leftovers = leftovers
    with _file_size_limit(4096) if rank == 1 else contextlib.nullcontext():  # rank 1's shard is ~25 KB
        out["disk full"] = _error(lambda: save_checkpoint(ckpt, model, opt, step=2))
    out["left after"] = sorted(p.name for p in ckpt.iterdir())
    out["existing step"] = _error(lambda: save_checkpoint(ckpt, model, opt, step=1))
    out["overwrite"] = save_checkpoint(ckpt, model, opt, step=1, overwrite=True).name
    out["elsewhere"] = _error(lambda: load_checkpoint(ckpt if rank == 0 else Path(root) / "not-mounted", model, opt))
    out["model only"] = load_checkpoint(ckpt, model, None).differences
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out["sgd"] = _error(lambda: load_checkpoint(ckpt, model, sgd))
    out["loaded"] = load_checkpoint(ckpt, model, opt).step
    return out


def _pretrained_cases(rank: int, world: int, path: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from fp8dist import wrap_model

    def meta(dtype):
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)

    out = {"non-finite": _error(lambda: wrap_model(meta(torch.float32), strategy="fsdp", pretrained=path))}
    for dtype in (torch.bfloat16, torch.float32):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            error = _error(lambda: wrap_model(meta(dtype), strategy="fsdp", pretrained=str(Path(path).parent /
                                                                                          "clean")))
        out[dtype] = error, [str(w.message) for w in caught if "no fp32 master" in str(w.message)]
    return out


def _launched_rank_error(rank: int, world: int) -> tuple[int, str]:
    """``fp8dist train --replicate-degree 3`` as torchrun's ranks run it (their process group is the harness's)."""
    import fp8dist.cli.train as cli_train
    from fp8dist import resolve_config
    from fp8dist.train.job import TrainConfig

    def exit_now(code: int):
        raise SystemExit(code)

    cli_train._exit_now = exit_now  # the rank's os._exit, kept from ending the harness's process
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exited:
        cli_train._run_launched(resolve_config(strategy="fsdp", replicate_degree=3), TrainConfig(steps=1), rank)
    return exited.value.code, stderr.getvalue()


def _all_cases(rank: int, world: int, root: str, pretrained: str) -> dict:
    return {**_checkpoint_cases(rank, world, root), **_pretrained_cases(rank, world, pretrained),
            "launched": _launched_rank_error(rank, world)}


def _nan_in_rows(src: Path, dst: Path, name: str, rows: slice) -> int:
    """``dst``: ``src`` with NaN written into ``rows`` of tensor ``name``; returns how many values."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    tensors[name][rows] = float("nan")
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return tensors[name][rows].numel()


def test_one_rank_failing_alone_fails_every_rank_with_the_same_clear_error(tmp_path):
    import fp8dist
    from fp8dist.train.models import build_llama

    clean = tmp_path / "clean"
    fp8dist.save_pretrained(build_llama("tiny", seed=1), clean, dtype=torch.float32)
    # FSDP2 shards dim 0: lm_head's rows 128..255 are rank 1's, so rank 1 alone reads the NaN
    bad_values = _nan_in_rows(clean, tmp_path / "damaged", "lm_head.weight", slice(250, 256))
    results = run_ranks(_all_cases, str(tmp_path), str(tmp_path / "damaged"), timeout=300)
    for key in ("read-only", "disk full", "existing step", "elsewhere", "sgd", "non-finite"):
        assert results[0][key] == results[1][key], f"{key}: every rank raises the same error"
    r = results[0]
    step2 = tmp_path / "ckpt" / "step_00000002"
    tmp = tmp_path / "ckpt" / ".tmp-step_00000002"
    assert r["read-only"] == ("CheckpointError", f"saving {step2} (creating {tmp}) failed on rank 0: OSError: "
                                                 f"[Errno 30] Read-only file system: '{tmp_path / 'ckpt'}'")
    kind, message = r["disk full"]
    assert kind == "CheckpointError"  # an Exception: torch's CheckpointException is a BaseException
    assert message.startswith(f"saving {step2} (writing {tmp}) failed on rank 1: OSError: [Errno 27] File too "
                              "large. Nothing of it was kept; ")
    assert f"{tmp_path / 'ckpt' / 'step_00000001'} (named by latest) is intact" in message and "\n" not in message
    assert r["left after"] == ["latest", "step_00000001"], "the partial .tmp-step_00000002 is removed"
    assert r["existing step"] == ("CheckpointError", f"{tmp_path / 'ckpt' / 'step_00000001'} exists already: "
                                  "save_checkpoint(..., overwrite=True) replaces it (e.g. after resuming from an older "
                                  "checkpoint), or save a step not saved yet.")
    assert r["overwrite"] == "step_00000001" and r["loaded"] == 1
    assert r["elsewhere"][0] == "FileNotFoundError"
    assert r["elsewhere"][1] == (f"load_checkpoint failed on rank 1: checkpoint '{tmp_path / 'not-mounted'}' does not "
                                 "exist.")
    assert r["model only"] == ("the checkpoint's AdamW optimizer state not loaded (optimizer=None)",)
    assert r["sgd"][0] == "CheckpointError" and "holds the state of a AdamW optimizer and this optimizer is a SGD" in \
        r["sgd"][1] and "pass optimizer=None" in r["sgd"][1]
    assert r["non-finite"] == ("PretrainedError", f"loading pretrained='{tmp_path / 'damaged'}' failed on rank 1: "
                               f"{tmp_path / 'damaged' / 'model.safetensors'} holds non-finite values (NaN or inf) in "
                               f"lm_head.weight: {bad_values:,} of the {128 * 128:,} values read: the file is damaged, "
                               "or the model had diverged when it was saved. Load a copy saved before that, or copy "
                               "the file again.")
    for result in results:  # a model built in bf16 would train bf16 weights with no master: refused before loading
        (kind, message), warned = result[torch.bfloat16]
        assert kind == "ValueError" and "trainable bf16 parameters" in message and "dtype=torch.float32" in message
        assert warned == [] and result[torch.float32] == (("nothing raised", ""), [])
    (code0, err0), (code1, err1) = results[0]["launched"], results[1]["launched"]
    assert (code0, code1) == (2, 2) and err1 == ""
    assert err0.startswith("fp8dist train: error: replicate_degree=3 does not split world size 2") and \
        err0.count("\n") == 1, "rank 0 says it in one line"
