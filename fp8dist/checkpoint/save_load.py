"""Checkpoints for every strategy, written atomically: ``D/step_00000040/`` (meta.json, the engine's shards,
``rng_rank{R}.pt``, Transformer Engine's ``fp8_state_rank{R}.pt``) appears only by a rename from ``D/.tmp-step_*``,
then ``D/latest`` is replaced to name it; a crash at any moment leaves the previous checkpoint intact."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ..config.args import require_bool
from ..runtime.files import atomic_write_text, fsync_dir
from ..runtime.agree import on_all_ranks, rank_world
from ..pipeline.api import get_wrap_info
from ..strategies import Strategy
from .compat import check_loadable, check_optimizer, engine_record, optimizer_name
from .layout import find_checkpoint, latest_checkpoint, save_root, step_dirs, step_name
from .manifest import CHECKSUM, check_names, record_files, verify_files
from .io import (CheckpointError, axes_of, check_supported, dcp_failure, from_rank0, inside, read_state, rng_state,
                 set_rng_state, write_state)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointState", "CheckpointError"]

FORMAT = "fp8dist-checkpoint"
"""meta.json's ``format``: a directory whose meta.json says otherwise is not an fp8dist checkpoint."""
FORMAT_VERSION = 1
"""meta.json's ``format_version``; later fields are additions, so an older fp8dist still reads what it knows and
refuses only a higher version."""
_REFUSALS = (CheckpointError, FileNotFoundError)  # complete in themselves: every rank raises them as they are


@dataclass(frozen=True)
class CheckpointState:
    """What :func:`load_checkpoint` restored besides the model and optimizer."""

    step: int
    """Optimizer steps done when saved: batch ``step`` is the next one to train on."""
    extra: dict[str, Any]
    """The JSON values given to :func:`save_checkpoint` as ``extra`` ({} where none)."""
    path: Path
    """The checkpoint loaded (a ``step_*`` folder: what ``latest`` named where a directory was given)."""
    world_size: int
    """World size the checkpoint was saved with."""
    differences: tuple[str, ...] = ()
    """How the model loaded into differs from the saved one, all allowed: e.g. ``"strategy 'fsdp' -> 'ddp'"``."""


def _write_meta(tmp: Path, described: dict[str, Any], step: int, extra: dict[str, Any],
                files: tuple[dict[str, int], dict[str, str]]) -> None:
    from ..runtime.packages import __version__

    sizes, checksums = files
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "fp8dist_version": __version__,
            "torch_version": torch.__version__, "step": step, **described, "extra": extra, "files": sizes,
            "checksum": CHECKSUM, "checksums": checksums}
    atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1) + "\n")


def _read_meta(path: Path) -> dict[str, Any]:
    file = inside(path, "meta.json", "the file")
    if not file.is_file():
        raise CheckpointError(f"{path} has no meta.json: it is not a complete fp8dist checkpoint. Load the "
                              f"checkpoint directory (its 'latest' is followed) or one of its step_* folders.")
    try:
        meta = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is truncated or damaged ({err}); load an older checkpoint.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not an fp8dist checkpoint's meta.json (format {FORMAT!r} expected).")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path} was written by fp8dist {meta.get('fp8dist_version')} in checkpoint format "
                              f"{meta['format_version']}; this fp8dist reads format {FORMAT_VERSION}. Upgrade fp8dist.")
    check_names(path, meta)
    for rel, size in meta["files"].items():
        actual = (path / rel).stat().st_size if (path / rel).is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise CheckpointError(f"{path / rel} is {found}, expected {size} bytes: the checkpoint is truncated or "
                                  "damaged. Load an older checkpoint (its step_* folders).")
    return meta


def _discard(path: Path) -> None:
    """Remove a directory so that a crash half-way never leaves something that looks like a checkpoint; an interrupt
    (Ctrl-C while old checkpoints are pruned) lets the removal finish before it propagates, so no ``.trash-*`` folder
    is left behind (a kill leaves one, which the next save removes)."""
    trash = path.with_name(f".trash-{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    try:
        shutil.rmtree(trash)
    except BaseException:
        shutil.rmtree(trash, ignore_errors=True)
        raise


def _publish(tmp: Path, root: Path, name: str, keep_last: int | None) -> None:
    """Rename the finished save into place, then point ``latest`` at it, then prune."""
    final = root / name
    if final.exists():  # saving a step again after resuming from an older checkpoint
        _discard(final)
    os.rename(tmp, final)
    fsync_dir(root)
    atomic_write_text(root / "latest", name + "\n")
    if keep_last is not None:
        for old in step_dirs(root)[:-keep_last]:
            if old.name != name:
                _discard(old)


def _remove_leftovers(root: Path) -> None:
    """Saves that crashed before their rename, half-done removals, a ``latest`` killed while being written."""
    for leftover in list(root.glob(".tmp-step_*")) + list(root.glob(".trash-*")):
        shutil.rmtree(leftover, ignore_errors=True)
    for partial in root.glob(".latest.*"):
        partial.unlink(missing_ok=True)


def _check_save_args(step: Any, extra: Any, keep_last: Any, overwrite: Any) -> dict[str, Any]:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int (optimizer steps done so far).")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be a positive int, or None to keep every checkpoint.")
    require_bool("overwrite", overwrite)
    extra = dict(extra or {})
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as err:
        raise ValueError(f"extra={extra!r} must hold JSON values only (numbers, strings, lists, dicts): {err}. "
                         "Checkpoints never pickle arbitrary objects.") from None
    return extra


def _prepare(root: Path, tmp: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    tmp.mkdir()


def _write_rank(tmp: Path, model: nn.Module, optimizer: Any, strategy: Strategy, rank: int,
                trainable_only: bool) -> None:
    """This rank's part (DCP raises a failure of any rank on all: raised as that rank's), then its RNG state."""
    try:
        write_state(tmp, model, optimizer, strategy, trainable_only)
    except CheckpointException as err:
        raise dcp_failure(err) from None
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")


def _kept(root: Path) -> str:
    """What a failed save leaves, as the way-out sentence says it."""
    try:
        previous = latest_checkpoint(root)
    except (OSError, CheckpointError):
        previous = None
    return f"{previous} (named by latest) is intact" if previous else "no earlier checkpoint was there"


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Any, *, step: int,
                    extra: dict[str, Any] | None = None, keep_last: int | None = None,
                    overwrite: bool = False, trainable_only: bool = False) -> Path:
    """Save ``model`` (from :func:`fp8dist.wrap_model`), ``optimizer``, ``step``, every rank's RNG states and the
    FP8 state into ``path/step_{step:08d}``, atomically (a crash leaves the previous checkpoint and ``latest``
    intact). Call it on every rank, after ``optimizer.step()``.

    Args:
        path: the checkpoint directory (created if needed) on a filesystem every rank sees; a file, one checkpoint
            or a folder of another kind (a Hugging Face model) is refused before anything is written.
        model: the model (DeepSpeed: the engine) returned by ``wrap_model``.
        optimizer: its optimizer (DeepSpeed: ``engine.optimizer``; the engine saves it).
        step: optimizer steps done; also the data position to resume from.
        extra: JSON values to keep with the checkpoint (returned by :func:`load_checkpoint`).
        keep_last: keep only this many newest checkpoints; None keeps all.
        overwrite: replace a checkpoint of the same step (e.g. after resuming from an older one).
        trainable_only: leave the frozen parameters out (a LoRA fine-tune's base); not with a strategy that has
            its own checkpoint format (DeepSpeed).

    Returns:
        The checkpoint's directory.

    Raises:
        CheckpointError: on every rank, with the same message, when the save failed on any (nothing of it is
            kept: a read-only directory, a full disk), or the step exists.

    Example::

        save_checkpoint("ckpt", model, optimizer, step=step + 1, keep_last=3)
    """
    info = get_wrap_info(model)
    check_supported(info)
    extra = _check_save_args(step, extra, keep_last, overwrite)
    require_bool("trainable_only", trainable_only)
    (strategy, _), (rank, world) = axes_of(info), rank_world()
    lead = rank == 0
    root = on_all_ranks("save_checkpoint", lambda: save_root(path), error=CheckpointError,
                        passthrough=_REFUSALS)  # every rank writes there: checked on each
    name = step_name(step)
    tmp, final = root / f".tmp-{name}", root / name
    if not overwrite and from_rank0(final.is_dir() if lead else None):
        raise CheckpointError(f"{final} exists already: save_checkpoint(..., overwrite=True) replaces it (e.g. "
                              "after resuming from an older checkpoint), or save a step not saved yet.")
    described = {**engine_record(model, trainable_only), "optimizer": optimizer_name(optimizer)}  # same on every rank
    on_all_ranks(f"saving {final} (creating {tmp})", (lambda: _prepare(root, tmp)) if lead else None,
                 error=CheckpointError)
    try:
        write = lambda: _write_rank(tmp, model, optimizer, strategy, rank, trainable_only)  # noqa: E731
        on_all_ranks(f"saving {final} (writing {tmp})", write,
                     error=CheckpointError, way_out=f"Nothing of it was kept; {_kept(root)}. Free space on that "
                     "filesystem or save elsewhere (keep_last=N keeps fewer checkpoints).")
        files = on_all_ranks(f"saving {final} (checksums of {tmp})", lambda: record_files(tmp, rank, world),
                             error=CheckpointError, way_out=f"Nothing of it was kept; {_kept(root)}.")
        on_all_ranks(f"saving {final}", (lambda: (_write_meta(tmp, described, step, extra, files),
                                                  _publish(tmp, root, name, keep_last))) if lead else None,
                     error=CheckpointError, way_out=f"{_kept(root).capitalize()}.")
    except BaseException:  # a failure, a rank gone, Ctrl-C: nothing half-written is left
        if lead:
            _remove_partial(tmp)
        raise
    return final


def _remove_partial(tmp: Path) -> None:
    """Remove a save that did not finish; a second Ctrl-C (a terminal's reaches every rank, then the launcher passes
    its own on) does not cut the removal short."""
    while True:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            return
        except KeyboardInterrupt:
            continue


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Any, *,
                    drop_fp8_state: bool = False, verify: bool = True) -> CheckpointState:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``, in place, and restore
    this rank's RNG states. Call it on every rank, after ``wrap_model`` and building the optimizer.

    Every file the checkpoint names must lie inside its folder (no absolute path, ``..`` or symbolic link leading
    out), checked before any is opened. Every file's size and checksum and every tensor's name and shape are checked
    before anything loads; what may
    differ is decided from meta.json (:mod:`fp8dist.checkpoint.compat`): fsdp, fsdp1, ddp and none load into each
    other on any world size, torchao on or off (ranks the checkpoint had no RNG state for keep theirs); Transformer
    Engine's FP8 state only into modules that hold it; DeepSpeed only the same ZeRO stage, world size and FP8
    backend; the optimizer must be of the class saved. Anything else raises :class:`CheckpointError` on every rank,
    naming what was saved, what is loading and the way out. Nothing is unpickled beyond tensors and plain values.

    Args:
        path: a checkpoint directory (its ``latest`` is followed), or one of its ``step_*`` folders.
        model: the model (DeepSpeed: the engine) returned by ``wrap_model``.
        optimizer: its optimizer (DeepSpeed: ``engine.optimizer``); None loads the model's weights only
            (``differences`` says the optimizer state was left).
        drop_fp8_state: load without the checkpoint's FP8 state (``_extra_state``; e.g. a Transformer Engine
            checkpoint into a model without TE): FP8 scaling starts afresh.
        verify: check every file's CRC-32 before loading; a meta.json that records no checksum for a file, or a
            file it does not list, is refused. False loads a damaged or unchecked checkpoint knowingly.

    Returns:
        The :class:`CheckpointState`: ``step`` (resume the data at batch ``step``), ``extra`` and ``differences``.

    Raises:
        CheckpointError: on every rank alike: the checkpoint does not load into this model or optimizer, a file is
            missing, damaged or outside the folder (the message names what was saved, what is loading and the way
            out).
        FileNotFoundError: ``path`` does not exist or holds no checkpoint.
        TypeError: ``drop_fp8_state`` or ``verify`` is not a bool.

    Example::

        state = load_checkpoint("ckpt", model, optimizer)   # e.g. saved by fsdp on 8 ranks, loaded by ddp on 2
    """
    info = get_wrap_info(model)
    check_supported(info)
    require_bool("drop_fp8_state", drop_fp8_state)
    require_bool("verify", verify)
    (rank, world), (strategy, backend) = rank_world(), axes_of(info)
    checkpoint, meta = on_all_ranks("load_checkpoint", lambda: _found(path), error=CheckpointError,
                                    passthrough=_REFUSALS)
    decision, optimizer_note = on_all_ranks(
        f"loading {checkpoint}", lambda: (check_loadable(meta, model, checkpoint, drop_fp8_state=drop_fp8_state),
                                          check_optimizer(meta, optimizer, checkpoint)), error=CheckpointError,
        passthrough=_REFUSALS)
    if verify:  # after the checks on meta.json alone: reading every file is the costly one
        on_all_ranks(f"loading {checkpoint}", lambda: verify_files(checkpoint, meta, rank, world),
                     error=CheckpointError, passthrough=_REFUSALS)
    on_all_ranks(f"loading {checkpoint}", lambda: _read(checkpoint, model, optimizer, strategy, decision.fp8_state,
                                                        decision.trainable_only), error=CheckpointError)
    backend.after_load(model, info.fp8)
    rng = inside(checkpoint, f"rng_rank{rank}.pt", "the file")
    on_all_ranks(f"loading {rng}", lambda: set_rng_state(torch.load(rng, map_location="cpu", weights_only=True))
                 if rng.is_file() else None, error=CheckpointError)
    return CheckpointState(step=int(meta["step"]), extra=meta["extra"], path=checkpoint,
                           world_size=int(meta["world_size"]),
                           differences=decision.differences + ((optimizer_note,) if optimizer_note else ()))


def _found(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    checkpoint = find_checkpoint(path)
    return checkpoint, _read_meta(checkpoint)


_DAMAGED = ". Its files may be damaged; load an older checkpoint (its step_* folders)."


def _read(checkpoint: Path, model: nn.Module, optimizer: Any, strategy: Strategy, fp8_state: tuple[str, ...],
          trainable_only: bool) -> None:
    """Read the checkpoint into the model and optimizer; what goes wrong past the checks made before is damage."""
    try:
        read_state(checkpoint, model, optimizer, strategy, fp8_state, trainable_only)
    except CheckpointError:
        raise
    except CheckpointException as err:  # DCP's, a BaseException, raised on every rank
        raise dcp_failure(err, _DAMAGED) from err
    except Exception as err:
        raise CheckpointError(f"{type(err).__name__}: {err}{_DAMAGED}") from err
