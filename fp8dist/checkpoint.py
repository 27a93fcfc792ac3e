"""Checkpoints for every strategy: model, optimizer, step, RNG states and FP8 state, written atomically.

A checkpoint directory ``D`` (on a filesystem every rank sees) holds::

    D/step_00000040/        one complete checkpoint; it only ever appears by a rename
        meta.json           strategy, FP8 backend, world size, parameter shapes, step, extra, every file's size
        .metadata __R_0.distcp   torch.distributed.checkpoint (fsdp, fsdp1, ddp, none): each rank writes its part
        deepspeed/          DeepSpeed's own engine checkpoint (strategy="deepspeed")
        rng_rank{R}.pt      rank R's RNG states: torch CPU and CUDA, python, numpy
    D/latest                name of the newest complete checkpoint, replaced atomically after the rename
    D/.tmp-step_00000040/   a save in progress, or one that crashed: never loaded, removed by the next save

FP8 state: Transformer Engine keeps scales and amax history in each module's ``_extra_state``, which is part of
the model state dict and saved with it. torchao's dynamic scaling keeps no state; the FP8 weight scales that
FSDP2's FP8 all-gather precomputes are recomputed from the loaded weights. MS-AMP is not supported yet.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from .api import get_wrap_info

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointState", "CheckpointError"]

FORMAT = "fp8dist-checkpoint"
FORMAT_VERSION = 1
_DS_TAG = "deepspeed"
# test hook: the save of this step pauses between writing and renaming until the process is killed
_PAUSE_ENV = "FP8DIST_TEST_PAUSE_BEFORE_RENAME"


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged or does not match the model it is loaded into (says what differs)."""


@dataclass(frozen=True)
class CheckpointState:
    """What :func:`load_checkpoint` restored besides the model and optimizer."""

    step: int
    """Optimizer steps done when saved; the data position (batch ``step`` is the next one to train on)."""
    extra: dict[str, Any]
    """The ``extra`` dict given to :func:`save_checkpoint`."""
    path: Path
    """The checkpoint directory loaded."""
    world_size: int
    """World size the checkpoint was saved with."""


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _no_dist() -> bool:
    """strategy="none" runs without a process group: DCP then reads and writes as a single process."""
    return not (dist.is_available() and dist.is_initialized())


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def _from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if _rank_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _engine(strategy: str) -> str:
    return "deepspeed" if strategy == "deepspeed" else "dcp"


def _check_supported(info) -> None:
    cfg = info.config
    if cfg.precision.fp8 == "msamp":
        raise NotImplementedError("checkpointing fp8='msamp' is not supported yet: MS-AMP's optimizer keeps "
                                  "ScalingTensor state that fp8dist cannot yet save safely. Use fp8='te' or "
                                  "'torchao', or MS-AMP's own checkpointing.")
    if cfg.parallel.strategy == "none" and info.env.world_size > 1:
        raise CheckpointError(f"strategy='none' in a {info.env.world_size}-process launch: every process trains "
                              "its own copy and would write the same checkpoint. Use one process, or strategy='ddp'.")


# ---- RNG states: per rank, plain tensors and numbers only, so they load with weights_only=True

def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))


# ---- the model and optimizer: torch.distributed.checkpoint, or DeepSpeed's engine checkpoint

def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _is_extra_state(key: str) -> bool:
    return key == "_extra_state" or key.endswith("._extra_state")


def _pop_extra_state(model_sd: dict[str, Any]) -> dict[str, Any]:
    """Take the modules' ``_extra_state`` (Transformer Engine: FP8 scales and amax history) out of a model state
    dict. It is saved per rank beside the DCP shards: its size changes once FP8 has run, which DCP's in-place
    loading into a fresh model's (smaller) state cannot follow."""
    extra = {k: model_sd.pop(k) for k in [k for k in model_sd if _is_extra_state(k)]}
    return {k: torch.frombuffer(bytearray(v.getvalue()), dtype=torch.uint8) if isinstance(v, io.BytesIO) else v
            for k, v in extra.items() if v is not None}


def _shapes(model: nn.Module, strategy: str) -> dict[str, list[int]]:
    """Global shape of every parameter (and, for DCP, every tensor of the model state dict) by its plain name."""
    if strategy == "deepspeed":  # ZeRO-3 partitions parameters; ds_shape is the full shape
        return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in model.module.named_parameters()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: list(v.shape) for k, v in get_model_state_dict(model).items()
            if isinstance(v, torch.Tensor) and not _is_extra_state(k)}


def _write_state(tmp: Path, model: nn.Module, optimizer: Any, strategy: str) -> None:
    if strategy == "deepspeed":
        model.save_checkpoint(str(tmp), tag=_DS_TAG, save_latest=False)
        return
    import torch.distributed.checkpoint as dcp

    state = _dcp_state(model, optimizer)
    extra_state = _pop_extra_state(state["model"])
    if extra_state:
        torch.save(extra_state, tmp / f"fp8_state_rank{_rank_world()[0]}.pt")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=_no_dist())


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: read it with only DCP's metadata classes, torch sizes and dtypes allowed."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
              ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module in self._MODULES and not name.startswith("__")) or (module, name) in self._NAMES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise CheckpointError(f"the checkpoint's .metadata refers to {module}.{name}, which a DCP checkpoint "
                                  "never contains: refusing to unpickle it.")
        return super().find_class(module, name)


def _safe_reader(path: Path):
    """DCP's file reader, reading ``.metadata`` through :class:`_MetadataUnpickler` (checked before DCP starts)."""
    import torch.distributed.checkpoint as dcp

    with open(path / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if getattr(metadata, "storage_meta", None) is not None:
                metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _safe_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._nested_dict import set_element

    class SafePlanner(DefaultLoadPlanner):
        """Non-tensor entries (optimizer hyperparameters) load with ``weights_only=True``, not plain pickle."""

        def load_bytes(self, read_item, value) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafePlanner()


# DeepSpeed's own checkpoint files hold these classes besides tensors; DeepSpeed loads them with plain pickle,
# so every file is checked first and anything else is refused.
_DS_GLOBALS = {"deepspeed.utils.tensor_fragment.fragment_address", "deepspeed.runtime.zero.config.ZeroStageEnum",
               "deepspeed.runtime.fp16.loss_scaler.LossScaler"}


def _read_state(path: Path, model: nn.Module, optimizer: Any, strategy: str) -> None:
    if strategy == "deepspeed":
        for file in sorted((path / _DS_TAG).glob("*.pt")):
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(file))) - _DS_GLOBALS
            if unsafe:
                raise CheckpointError(f"{file} refers to {sorted(unsafe)}, which fp8dist's DeepSpeed checkpoints "
                                      "never contain: refusing to unpickle it.")
        loaded, _ = model.load_checkpoint(str(path), tag=_DS_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
        if loaded is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {path / _DS_TAG}.")
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    reader = _safe_reader(path)
    state = _dcp_state(model, optimizer)
    expected = _pop_extra_state(state["model"])
    dcp.load(state, storage_reader=reader, planner=_safe_planner(), no_dist=_no_dist())
    if expected:  # this rank's FP8 state, or rank 0's when the checkpoint had fewer ranks
        mine = path / f"fp8_state_rank{_rank_world()[0]}.pt"
        state["model"].update(torch.load(mine if mine.is_file() else path / "fp8_state_rank0.pt", weights_only=True))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _after_load_fp8(model: nn.Module, info) -> None:
    """torchao + FSDP2 FP8 all-gather: the precomputed weight scales belong to the old weights; recompute them."""
    if info.config.precision.fp8 != "torchao" or not info.plan.fp8:
        return
    from .fp8.torchao import fp8_all_gather

    if fp8_all_gather(info.config):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


# ---- meta.json: what was saved, checked against the model before anything is loaded

def _describe(model: nn.Module) -> dict[str, Any]:
    info = get_wrap_info(model)
    cfg = info.config
    fp8 = cfg.precision.fp8 if info.plan.fp8 else None
    return {"strategy": cfg.parallel.strategy, "fp8": fp8,
            "zero_stage": cfg.parallel.zero_stage if cfg.parallel.strategy == "deepspeed" else None,
            "world_size": info.env.world_size}


def _manifest(directory: Path) -> dict[str, int]:
    """Size of every file under ``directory``, each synced to disk."""
    files = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        files[file.relative_to(directory).as_posix()] = file.stat().st_size
    return files


def _write_meta(tmp: Path, model: nn.Module, step: int, extra: dict[str, Any], shapes: dict[str, list[int]]) -> None:
    from . import __version__

    described = _describe(model)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "fp8dist_version": __version__,
            "torch_version": torch.__version__, "step": step, **described,
            "engine": _engine(described["strategy"]), "extra": extra, "parameters": shapes, "files": _manifest(tmp)}
    _write_atomic(tmp / "meta.json", json.dumps(meta, indent=1) + "\n")


def _write_atomic(target: Path, text: str) -> None:
    part = target.with_name(f".{target.name}.part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, target)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_meta(path: Path) -> dict[str, Any]:
    file = path / "meta.json"
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
    for rel, size in meta["files"].items():
        actual = (path / rel).stat().st_size if (path / rel).is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise CheckpointError(f"{path / rel} is {found}, expected {size} bytes: the checkpoint is truncated or "
                                  "damaged. Load an older checkpoint (its step_* folders).")
    return meta


def _check_matches(meta: dict[str, Any], model: nn.Module, path: Path) -> None:
    """Raise CheckpointError naming every difference between the checkpoint and ``model``."""
    now = _describe(model)
    keys = ["strategy", "fp8", "zero_stage"] + (["world_size"] if now["strategy"] == "deepspeed" else [])
    diffs = [f"{k}: checkpoint {meta.get(k)!r}, this model {now[k]!r}" for k in keys if meta.get(k) != now[k]]
    saved, ours = meta.get("parameters", {}), _shapes(model, now["strategy"])
    shapes = [f"{n}: shape {tuple(saved[n])} in the checkpoint, {tuple(ours[n])} in this model"
              for n in saved if n in ours and list(saved[n]) != list(ours[n])]
    diffs += shapes[:4] + ([f"{len(shapes) - 4} more shapes differ"] if len(shapes) > 4 else [])
    for names, where in (([n for n in saved if n not in ours], "the checkpoint"),
                         ([n for n in ours if n not in saved], "this model")):
        if names:
            diffs.append(f"{len(names)} tensor(s) only in {where}: {', '.join(names[:3])}"
                         + (", ..." if len(names) > 3 else ""))
    if diffs:
        shown = "; ".join(diffs)
        hint = (" DeepSpeed checkpoints load on the world size they were saved with (convert with DeepSpeed's "
                "ds_to_universal to change it)." if now["strategy"] == "deepspeed" else "")
        raise CheckpointError(f"{path} does not match this model: {shown}. Load it into the model, strategy and FP8 "
                              f"backend it was saved from.{hint}")


# ---- the directory: latest pointer, publish by rename, retention

def _step_dirs(root: Path) -> list[Path]:
    found = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in directory ``path`` (what its ``latest`` names); None when there is none."""
    root = Path(path)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not (root / name).is_dir():
        raise CheckpointError(f"{pointer} names {name!r}, which is not in {root}: the directory was changed by hand.")
    return root / name


def _resolve(path: str | os.PathLike) -> Path:
    root = Path(path)
    if (root / "meta.json").exists():
        return root
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint {str(root)!r} does not exist.")
    found = latest_checkpoint(root)
    if found is None:
        raise FileNotFoundError(f"{root} holds no checkpoint (no 'latest' file and no meta.json). Pass a directory "
                                "that save_checkpoint wrote, or one of its step_* folders.")
    return found


def _discard(path: Path) -> None:
    """Remove a directory so that a crash half-way never leaves something that looks like a checkpoint."""
    trash = path.with_name(f".trash-{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)


def _publish(tmp: Path, root: Path, name: str, keep_last: int | None) -> None:
    """Rename the finished save into place, then point ``latest`` at it, then prune (rank 0 only)."""
    final = root / name
    if final.exists():  # saving a step again after resuming from an older checkpoint
        _discard(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    _write_atomic(root / "latest", name + "\n")
    _fsync_dir(root)
    if keep_last is not None:
        for old in _step_dirs(root)[:-keep_last]:
            if old.name != name:
                _discard(old)


def _remove_leftovers(root: Path) -> None:
    """Saves that crashed before their rename, and half-done removals."""
    for leftover in list(root.glob(".tmp-step_*")) + list(root.glob(".trash-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def _check_save_args(step: Any, extra: Any, keep_last: Any) -> dict[str, Any]:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative int (optimizer steps done so far).")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r} must be a positive int, or None to keep every checkpoint.")
    extra = dict(extra or {})
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as err:
        raise ValueError(f"extra={extra!r} must hold JSON values only (numbers, strings, lists, dicts): {err}. "
                         "Checkpoints never pickle arbitrary objects.") from None
    return extra


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Any, *, step: int,
                    extra: dict[str, Any] | None = None, keep_last: int | None = None) -> Path:
    """Save ``model`` (from :func:`fp8dist.wrap_model`), ``optimizer``, ``step``, every rank's RNG states and the
    FP8 state into ``path/step_{step:08d}``, atomically. Call it on every rank, after ``optimizer.step()``.

    Each rank writes its own shard (torch.distributed.checkpoint; DeepSpeed: the engine's own checkpoint) into a
    temporary directory; once every rank has finished, rank 0 renames it into place, then points ``path/latest``
    at it, then removes the oldest beyond ``keep_last``. A crash at any moment leaves the previous checkpoint
    intact and ``latest`` naming it.

    Args:
        path: the checkpoint directory (created if needed), on a filesystem every rank sees.
        model: the model (DeepSpeed: the engine) returned by ``wrap_model``.
        optimizer: its optimizer (DeepSpeed: ``engine.optimizer``; the engine saves it).
        step: optimizer steps done; also the data position to resume from.
        extra: JSON values to keep with the checkpoint (returned by :func:`load_checkpoint`).
        keep_last: keep only this many newest checkpoints; None keeps all.

    Returns:
        The checkpoint's directory.

    Example::

        save_checkpoint("ckpt", model, optimizer, step=step + 1, keep_last=3)
    """
    info = get_wrap_info(model)
    _check_supported(info)
    extra = _check_save_args(step, extra, keep_last)
    strategy, (rank, _) = info.config.parallel.strategy, _rank_world()
    root, name = Path(path), f"step_{step:08d}"
    tmp = root / f".tmp-{name}"
    shapes = _shapes(model, strategy)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)
        tmp.mkdir()
    _barrier()
    _write_state(tmp, model, optimizer, strategy)
    torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    _barrier()  # every rank's part is on disk
    error = None
    if rank == 0:
        try:
            _write_meta(tmp, model, step, extra, shapes)
            if os.environ.get(_PAUSE_ENV) == str(step):
                print(f"fp8dist checkpoint: test hook {_PAUSE_ENV}: pausing before renaming {tmp}", flush=True)
                time.sleep(3600)
            _publish(tmp, root, name, keep_last)
        except Exception as err:  # every rank raises, none hangs waiting for rank 0
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"{type(err).__name__}: {err}"
    error = _from_rank0(error)
    if error is not None:
        raise CheckpointError(f"saving {root / name} failed on rank 0: {error}")
    return root / name


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Any) -> CheckpointState:
    """Load a checkpoint written by :func:`save_checkpoint` into ``model`` and ``optimizer``, in place, and restore
    this rank's RNG states. Call it on every rank, after ``wrap_model`` and building the optimizer.

    ``path`` is the checkpoint directory (its ``latest`` is followed) or one ``step_*`` folder. The checkpoint is
    checked before anything is loaded: strategy, FP8 backend, ZeRO stage and every parameter's shape must match,
    and every file must be complete; otherwise :class:`CheckpointError` says what differs. fsdp, fsdp1, ddp and
    none load on any world size (DCP reshards); ranks the checkpoint had no RNG state for keep theirs. DeepSpeed
    needs the world size it was saved with. Nothing is unpickled beyond tensors and plain values (DCP metadata
    through an allow-list, ``weights_only=True``; DeepSpeed's files are checked for foreign classes first).

    Returns:
        The :class:`CheckpointState`: ``step`` (resume the data at batch ``step``) and ``extra``.
    """
    info = get_wrap_info(model)
    _check_supported(info)
    checkpoint = _resolve(path)
    meta = _read_meta(checkpoint)
    _check_matches(meta, model, checkpoint)
    try:
        _read_state(checkpoint, model, optimizer, info.config.parallel.strategy)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"could not load {checkpoint}: {type(err).__name__}: {err}. Its files may be damaged; "
                              "load an older checkpoint (its step_* folders).") from err
    _after_load_fp8(model, info)
    rng = checkpoint / f"rng_rank{_rank_world()[0]}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
    return CheckpointState(step=int(meta["step"]), extra=meta["extra"], path=checkpoint,
                           world_size=int(meta["world_size"]))
