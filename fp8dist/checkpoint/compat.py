"""What loads into what: the engine data a checkpoint's meta.json records, checked against the model it is loaded
into before anything is read. DCP saves every strategy without a format of its own under the same plain names, so
those load into each other; a strategy's own format decides what loads into it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config.text import listing, plural
from ..fp8 import BACKENDS, get_backend
from ..memory_levels import STANDARD
from ..pipeline.api import get_wrap_info
from ..strategies import STRATEGIES, get_strategy
from .io import DCP, CheckpointError, checkpoint_format, inside, model_layout


@dataclass(frozen=True)
class LoadDecision:
    """What :func:`check_loadable` allows: the ``_extra_state`` entries to load, how this model differs from the
    saved one, and whether the checkpoint holds the trainable parameters only."""

    fp8_state: tuple[str, ...]
    """The saved ``_extra_state`` keys to load (none with ``drop_fp8_state``)."""
    differences: tuple[str, ...]
    """How this model differs from the saved one, all allowed (``CheckpointState.differences``)."""
    trainable_only: bool = False
    """Whether the checkpoint holds the trainable parameters only (a LoRA fine-tune's adapters)."""


def engine_record(model: nn.Module, trainable_only: bool = False) -> dict[str, Any]:
    """The engine data meta.json records and loading decides on: strategy, checkpoint format, FP8 backend, world
    size, the FP8 state keys and every saved parameter's shape, the memory level (and ``trainable_only``). ``model``:
    what ``wrap_model`` returned. Call it on every rank while saving (FSDP1's state dict hooks run on all).

    Raises:
        CheckpointError: ``trainable_only`` under a strategy that cannot save the trainable parameters alone (the
            message names those that can).
        ValueError: ``model`` was not returned by ``wrap_model`` (:func:`fp8dist.get_wrap_info`).
    """
    info = get_wrap_info(model)
    cfg = info.config
    strategy = get_strategy(cfg.parallel.strategy)
    refusal = trainable_only_refusal(strategy, info.plan.facts) if trainable_only else None
    if refusal:
        raise CheckpointError(f"trainable_only=True: {refusal}, or save every weight (trainable_only=False).")
    shapes, fp8_state = model_layout(model, strategy, trainable_only)
    own = strategy.checkpoint.record(cfg) if strategy.checkpoint is not None else {}  # DeepSpeed: zero_stage
    return {"strategy": strategy.name, "engine": checkpoint_format(strategy),
            "fp8": cfg.precision.fp8 if info.plan.fp8 else None, **own,
            "world_size": info.env.world_size, "fp8_state": fp8_state, "parameters": shapes,
            "memory": cfg.parallel.memory, **({"trainable_only": True} if trainable_only else {})}


def trainable_only_refusal(strategy: Any, facts: Any) -> str | None:
    """Why ``trainable_only`` checkpoints cannot be saved under ``strategy``, ending with the strategies that can
    (the caller ends the sentence); None: they can."""
    fits = [repr(n) for n, s in STRATEGIES.items() if s.checkpoint is None and not s.facts(None).flat_params]
    way_out = f"Train the adapters with strategy {', '.join(fits)}"  # the caller ends the sentence
    if strategy.checkpoint is not None:
        return (f"strategy {strategy.name!r} saves {strategy.checkpoint.saved_as}, which fp8dist cannot restrict to "
                f"the trainable parameters. {way_out}")
    if facts.flat_params:  # a rank may hold no trainable element; DCP then steps its empty optimizer alone: a hang
        return (f"strategy {strategy.name!r} shards flat parameters, so a rank may hold none of the trainable ones, "
                f"and torch.distributed.checkpoint cannot save an optimizer with no state there. {way_out}")
    return None


def _saved_fp8_state(meta: dict[str, Any], path: Path) -> list[str]:
    """meta.json's ``fp8_state``; older checkpoints hold it in their rank-0 file only."""
    if "fp8_state" in meta:
        return list(meta["fp8_state"])
    file = inside(path, "fp8_state_rank0.pt", "the file")
    return sorted(torch.load(file, map_location="cpu", weights_only=True)) if file.is_file() else []


def _layout_diffs(saved: dict[str, list[int]], ours: dict[str, list[int]]) -> list[str]:
    shapes = [f"{n}: shape {tuple(saved[n])} in the checkpoint, {tuple(ours[n])} in this model"
              for n in saved if n in ours and list(saved[n]) != list(ours[n])]
    diffs = shapes[:4] + ([f"{len(shapes) - 4} more shapes differ"] if len(shapes) > 4 else [])
    for names, where in (([n for n in saved if n not in ours], "the checkpoint"),
                         ([n for n in ours if n not in saved], "this model")):
        if names:
            diffs.append(f"{plural(len(names), 'tensor')} only in {where}: {listing(names)}")
    return diffs


def _strategies_of(fmt: str) -> str:
    """"'fsdp', 'fsdp1', 'ddp' or 'none'": the strategies a checkpoint of format ``fmt`` loads into."""
    names = [repr(name) for name, s in STRATEGIES.items() if checkpoint_format(s) == fmt]
    return ", ".join(names[:-1]) + (" or " if len(names) > 1 else "") + names[-1]


def _engine_refusal(meta: dict[str, Any], now: dict[str, Any], path: Path) -> str:
    """Formats differ: what was saved and what is loading, each as its format's owner says it, and the way out."""
    saver = STRATEGIES.get(meta["strategy"])
    own = saver.checkpoint if saver is not None else None
    if own is not None:
        saved, way_out = f", {own.saved_as}", own.way_out(meta, path)
    elif meta["engine"] != DCP:  # a strategy not registered here
        saved, way_out = f" (its own format {meta['engine']!r})", f"load it into strategy={meta['strategy']!r}"
    else:
        saved, way_out = " (torch.distributed.checkpoint)", (
            f"load it into strategy {_strategies_of(DCP)}, or turn it into one file with torch's converter (python -m "
            f"torch.distributed.checkpoint.format_utils dcp_to_torch {path} OUT.pt), load its 'model' entries into "
            "the model before wrap_model and start a new optimizer; or save from the strategy you load into")
    own = get_strategy(now["strategy"]).checkpoint
    loading = own.loads_only if own is not None else \
        f"this model uses strategy {now['strategy']!r} (torch.distributed.checkpoint)"
    return (f"{path} was saved with strategy {meta['strategy']!r}{saved}; {loading}, and fp8dist does not convert "
            f"between the two. Way out: {way_out}.")


def _fp8_state_refusal(meta: dict[str, Any], now: dict[str, Any], lost: list[str], path: Path) -> str:
    modules = [k.removesuffix("._extra_state") for k in lost]
    backend = get_backend(meta["fp8"]) if meta.get("fp8") in BACKENDS else None  # None: none, or not registered
    owned = backend is not None and backend.extra_state is not None  # the saving backend says what it keeps
    what = backend.extra_state if owned else "module extra state (`_extra_state`, e.g. FP8 scales)"
    model = f"strategy {now['strategy']!r}, fp8 {now['fp8']!r}"
    into = (f"a model with fp8={backend.name!r} (strategy {_strategies_of(DCP)}, any world size)" if owned
            else "a model with those modules")
    return (f"{path} holds {what} of {plural(len(lost), 'module')} ({listing(modules)}) that this model ({model}) "
            f"has no place for: loading would drop it silently. Way out: load it into {into}, or pass "
            "drop_fp8_state=True to load the weights and optimizer without it (FP8 scaling then starts afresh).")


def check_loadable(meta: dict[str, Any], model: nn.Module, path: Path, *, drop_fp8_state: bool) -> LoadDecision:
    """CheckpointError (what was saved, what is loading, the way out) when the checkpoint cannot load soundly into
    ``model``; else which FP8 state to load and what differs."""
    trainable_only = bool(meta.get("trainable_only"))
    now = engine_record(model, trainable_only)
    saved_engine = meta.get("engine") or checkpoint_format(get_strategy(meta["strategy"]))  # not recorded before
    if saved_engine != now["engine"]:
        raise CheckpointError(_engine_refusal({**meta, "engine": saved_engine}, now, path))
    layout = _layout_diffs(meta.get("parameters", {}), now["parameters"])
    if layout:
        raise CheckpointError(f"{path} does not match this model: {'; '.join(layout)}. Load it into the model "
                              "architecture and size it was saved from.")
    saved_memory = meta.get("memory", STANDARD.name)  # not recorded before memory levels: the standard one
    if saved_memory != now["memory"]:
        raise CheckpointError(
            f"{path} was saved with memory={saved_memory!r} and this model uses memory="
            f"{now['memory']!r}: the optimizer states differ in kind (fp32 AdamW moments vs torchao's 8-bit ones) and "
            f"fp8dist does not convert them. Load it into a model wrapped with memory={saved_memory!r}"
            "; to change level, take the weights only (python -m torch.distributed.checkpoint.format_utils "
            "dcp_to_torch) into the model before wrap_model and start a new optimizer.")
    own = get_strategy(now["strategy"]).checkpoint
    if own is not None:  # the format decides what loads (DeepSpeed: the same stage, world size, FP8 backend)
        refusal = own.mismatch(meta, now, path)
        if refusal:
            raise CheckpointError(refusal)
        return LoadDecision(fp8_state=(), differences=(), trainable_only=trainable_only)
    saved_state, ours = _saved_fp8_state(meta, path), set(now["fp8_state"])
    lost = [k for k in saved_state if k not in ours]
    if lost and not drop_fp8_state:
        raise CheckpointError(_fp8_state_refusal(meta, now, lost, path))
    load = () if drop_fp8_state else tuple(k for k in saved_state if k in ours)
    differences = [f"{k} {meta.get(k)!r} -> {now[k]!r}" for k in ("strategy", "fp8", "world_size")
                   if meta.get(k) != now[k]]
    if trainable_only:
        differences.append("the checkpoint holds the trainable parameters only: the frozen ones keep this model's "
                           "values")
    if drop_fp8_state and saved_state:
        differences.append(f"the checkpoint's FP8 state of {plural(len(saved_state), 'module')} dropped "
                           "(drop_fp8_state=True)")
    fresh = [k for k in now["fp8_state"] if k not in load]
    if fresh:
        differences.append(f"this model's FP8 state of {plural(len(fresh), 'module')} starts afresh"
                           + ("" if drop_fp8_state else " (none in the checkpoint)"))
    return LoadDecision(fp8_state=load, differences=tuple(differences), trainable_only=trainable_only)


def optimizer_name(optimizer: Any) -> str | None:
    """The optimizer's class as meta.json records it; None for no optimizer."""
    return None if optimizer is None else type(optimizer).__name__


def check_optimizer(meta: dict[str, Any], optimizer: Any, path: Path) -> str | None:
    """CheckpointError when ``optimizer`` cannot take the saved optimizer state (another class, or none saved);
    the difference to report when ``optimizer`` is None and state was saved."""
    if "optimizer" not in meta:
        return None
    saved, now = meta["optimizer"], optimizer_name(optimizer)
    if now is None:
        return f"the checkpoint's {saved} optimizer state not loaded (optimizer=None)" if saved else None
    if saved is None:
        raise CheckpointError(f"{path} holds no optimizer state (it was saved with optimizer=None) and a {now} was "
                              f"passed: pass optimizer=None to load the model weights only (the {now} starts afresh).")
    if saved != now:
        raise CheckpointError(f"{path} holds the state of a {saved} optimizer and this optimizer is a {now}: one "
                              f"cannot fill the other. Build a {saved} to resume exactly, or pass optimizer=None to "
                              f"load the model weights only and start the {now} afresh.")
    return None
