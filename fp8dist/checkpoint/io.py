"""What each engine writes into a checkpoint and reads back, unpickling nothing unsafe: torch.distributed.checkpoint
(DCP) of ``get_state_dict`` with modules' ``_extra_state`` per rank beside it, or a strategy's own format (DeepSpeed's
files checked for foreign classes first); and every rank's RNG states as plain tensors and numbers."""

from __future__ import annotations

import io
import pickle
import random
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..fp8 import FP8Backend, get_backend
from ..runtime.agree import RankFailure, rank_world
from ..strategies import Strategy, get_strategy

DCP = "dcp"
"""meta.json's ``engine`` for a checkpoint in torch.distributed.checkpoint's format, which every strategy without a
format of its own writes (and any of them reads back, at any world size)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged or does not match the model it is loaded into (says what differs)."""


def inside(folder: Path, name: Any, entry: str) -> Path:
    """``folder / name`` for a file name a checkpoint gives (meta.json's maps, DCP's ``.metadata``, ``latest``, the
    fixed names fp8dist reads): every reader passes each name through here before it opens or stats the file.

    Args:
        folder: the checkpoint's folder (``latest``: the checkpoint directory).
        name: the name as the checkpoint gives it: a relative path, ``/``-separated.
        entry: what gives the name, for the message: "meta.json's 'files' entry", "the file".

    Raises:
        CheckpointError: naming the entry and ``folder`` when the name is not a relative path, is absolute, climbs
            out with ``..`` or leads outside ``folder`` through a symbolic link (only the links are read).
    """
    relative = PurePosixPath(name) if isinstance(name, str) and "\0" not in name else None
    if relative is None or relative.parts in ((), (".",)):
        why = "is not the name of a file"
    elif relative.is_absolute():
        why = "is an absolute path"
    elif ".." in relative.parts:
        why = "climbs out of the folder ('..')"
    elif not _resolves_inside(folder, relative):
        why = "leads out of the folder through a symbolic link"
    else:
        return folder / relative
    raise CheckpointError(f"{folder}: {entry} {name!r} {why}. A checkpoint names only files inside its own folder, "
                          "so none was read. It was edited by hand or not written by fp8dist: load another "
                          "checkpoint.")


def _resolves_inside(folder: Path, relative: PurePosixPath) -> bool:
    try:
        return (folder / relative).resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):  # a loop of links (RuntimeError before Python 3.13)
        return False


def no_dist() -> bool:
    """strategy="none" runs without a process group: DCP then reads and writes as a single process."""
    return not (dist.is_available() and dist.is_initialized())


def dcp_failure(err: BaseException, then: str = "") -> RankFailure:
    """DCP's ``CheckpointException`` (a ``BaseException``, raised on every rank) as its first failing rank's own
    error in one line (``OSError: [Errno 28] No space left on device``), ``then`` appended."""
    failures = getattr(err, "failures", None) or {}
    rank = min(failures) if failures else rank_world()[0]
    exc = failures[rank][0] if failures else err
    return RankFailure(rank, f"{type(exc).__name__}: {exc}{then}")


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (picklable; the other ranks' are ignored). Collective: call it on every
    rank in the same order; the value as it is for one process."""
    if rank_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ranks_values(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank. Collective: call it on every rank in the
    same order."""
    if rank_world()[1] == 1:
        return [value]
    values: list[Any] = [None] * rank_world()[1]
    dist.all_gather_object(values, value)
    return values


def checkpoint_format(strategy: Strategy) -> str:
    """What meta.json records as ``engine``: the strategy's own checkpoint format, else DCP."""
    return strategy.checkpoint.format if strategy.checkpoint is not None else DCP


def axes_of(info) -> tuple[Strategy, FP8Backend]:
    """The strategy and the FP8 backend of a wrapped model's :class:`~fp8dist.pipeline.api.WrapInfo`."""
    return get_strategy(info.config.parallel.strategy), get_backend(info.config.precision.fp8)


def check_supported(info) -> None:
    """Raise where the wrapped model's axes cannot checkpoint: NotImplementedError for an FP8 backend that refuses
    (its ``checkpoint_refusal``), CheckpointError for a strategy without a process group launched on several
    processes (each would write the same checkpoint)."""
    strategy, backend = axes_of(info)
    if backend.checkpoint_refusal:
        raise NotImplementedError(f"checkpointing fp8={backend.name!r} is not supported yet: "
                                  f"{backend.checkpoint_refusal}.")
    if not strategy.process_group and info.env.world_size > 1:
        raise CheckpointError(f"strategy={strategy.name!r} in a {info.env.world_size}-process launch: every process "
                              "trains its own copy and would write the same checkpoint. Use one process, or "
                              "strategy='ddp'.")


def rng_state() -> dict[str, Any]:
    """This process's random number generator states: torch's and Python's, and CUDA's and NumPy's where present,
    as plain tensors and numbers only, so that they load with ``weights_only=True``; :func:`set_rng_state` restores
    them."""
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


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the random number generators from ``state`` (as :func:`rng_state` took them): torch's, Python's,
    and CUDA's and NumPy's where saved and present."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))


def _options(trainable_only: bool) -> Any:
    """DCP's state-dict options: ``trainable_only`` saves and loads without the frozen parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
               trainable_only: bool = False) -> dict[str, Any]:
    """The model's (and optimizer's) state dicts by plain names, in the layout checkpoints hold."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model, options=_options(trainable_only))}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
    _transpose_states(optim_sd, model)
    return {"model": model_sd, "optim": optim_sd}


def _transpose_states(optim_sd: dict[str, Any], model: nn.Module) -> None:
    """Transposed views of the 2-D optimizer states of parameters held transposed (a Conv1D run by Transformer
    Engine), so a checkpoint loads with or without it; a new dict each (the optimizer shares the old)."""
    from ..strategies.local_shards import local_params

    names = {n for p in local_params(model) if p.transposed for n in p.names}
    for name in names & set(optim_sd.get("state", {})):
        optim_sd["state"][name] = {key: _transposed(value) if isinstance(value, torch.Tensor) and value.dim() == 2
                                   else value for key, value in optim_sd["state"][name].items()}


def _transposed(value: torch.Tensor) -> torch.Tensor:
    """``value.t()``; a ShardedTensor (FSDP1's optimizer state, no ``t``) rebuilt from this rank's transposed
    shards without a collective, as FSDP1 builds its own."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata

    if not isinstance(value, ShardedTensor):
        return value.t()
    flip = lambda m: ShardMetadata(m.shard_offsets[::-1], m.shard_sizes[::-1], m.placement)  # noqa: E731
    meta = value.metadata()
    shards = [Shard(s.tensor.t().contiguous(), flip(s.metadata)) for s in value.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata([flip(m) for m in meta.shards_metadata], torch.Size(meta.size[::-1]),
                                      meta.tensor_properties), process_group=value._process_group)


def _pop_extra_state(model_sd: dict[str, Any]) -> dict[str, Any]:
    """Take the modules' ``_extra_state`` (TE's FP8 scales) out of a model state dict: its size changes once FP8
    has run, which DCP's in-place loading into a fresh model cannot follow, so it is saved per rank beside."""
    return {k: model_sd.pop(k) for k in [k for k in model_sd if k.split(".")[-1] == "_extra_state"]}


def model_layout(model: nn.Module, strategy: Strategy,
                 trainable_only: bool = False) -> tuple[dict[str, list[int]], list[str]]:
    """Global shape of every tensor of the model's state dict by plain name, and its ``_extra_state`` entries, as
    ``strategy`` saves them (its own format's layout where it has one); ``trainable_only``: the trainable
    parameters' only. Collective under FSDP1: call it on every rank."""
    if strategy.checkpoint is not None:
        return strategy.checkpoint.layout(model)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_options(trainable_only))
    extra = sorted(_pop_extra_state(state))
    return {k: list(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}, extra


def write_state(tmp: Path, model: nn.Module, optimizer: Any, strategy: Strategy, trainable_only: bool = False) -> None:
    """Write the model's and optimizer's state into the folder ``tmp`` on every rank: the strategy's own checkpoint
    engine where it has one (DeepSpeed), else torch DCP (``trainable_only``: only the trained parameters and their
    optimizer state, as a LoRA checkpoint keeps)."""
    if strategy.checkpoint is not None:
        strategy.checkpoint.save(model, tmp)
        return
    import torch.distributed.checkpoint as dcp

    state = _dcp_state(model, optimizer, trainable_only)
    # as tensors (older TE versions give a BytesIO), so that they load with weights_only=True
    extra_state = {k: torch.frombuffer(bytearray(v.getvalue()), dtype=torch.uint8) if isinstance(v, io.BytesIO) else v
                   for k, v in _pop_extra_state(state["model"]).items() if v is not None}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=no_dist())
    if extra_state:  # after DCP's collectives: a failure here is this rank's alone, shared by the caller
        torch.save(extra_state, tmp / f"fp8_state_rank{rank_world()[0]}.pt")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: read with only DCP's metadata classes, torch sizes and dtypes allowed."""

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
    """DCP's file reader, its ``.metadata`` read through :class:`_MetadataUnpickler` before DCP starts."""
    import torch.distributed.checkpoint as dcp

    with open(inside(path, ".metadata", "the file"), "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    for info in (getattr(metadata, "storage_data", None) or {}).values():  # the files DCP reads next
        inside(path, getattr(info, "relative_path", None), "the .metadata entry")

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


def _read_own(path: Path, model: nn.Module, optimizer: Any, own: Any) -> None:
    """The strategy's own format, whose files the engine unpickles: each checked first for undeclared classes."""
    for file in own.files(path):
        inside(path, file.relative_to(path).as_posix(), "the engine's file")
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(file))) - own.pickled
        if unsafe:
            raise CheckpointError(f"{file} refers to {sorted(unsafe)}, which a checkpoint {own.saved_as} never "
                                  "contains: refusing to unpickle it.")
    refusal = own.load(model, path, optimizer=optimizer is not None)
    if refusal:
        raise CheckpointError(refusal)


def read_state(path: Path, model: nn.Module, optimizer: Any, strategy: Strategy, fp8_state: tuple[str, ...],
               trainable_only: bool = False) -> None:
    """Load the checkpoint at ``path`` into ``model`` and ``optimizer`` (None: the model only) as ``strategy``
    reads it (its own engine, else DCP); of the modules' ``_extra_state`` only the ``fp8_state`` entries (the others
    keep their own); ``trainable_only``: the checkpoint holds the trainable parameters only. Collective: call it on
    every rank, once :func:`~fp8dist.checkpoint.compat.check_loadable` has allowed the load."""
    if strategy.checkpoint is not None:
        _read_own(path, model, optimizer, strategy.checkpoint)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    saved: dict[str, Any] = {}
    if fp8_state:  # this rank's FP8 state, or rank 0's when the checkpoint had fewer ranks; read before DCP's
        # collectives, so that a failure here hangs no peer
        mine = inside(path, f"fp8_state_rank{rank_world()[0]}.pt", "the file")
        first = inside(path, "fp8_state_rank0.pt", "the file")
        saved = torch.load(mine if mine.is_file() else first, map_location="cpu", weights_only=True)
    reader = _safe_reader(path)
    state = _dcp_state(model, optimizer, trainable_only)
    own = _pop_extra_state(state["model"])
    dcp.load(state, storage_reader=reader, planner=_safe_planner(), no_dist=no_dist())
    state["model"].update(own)
    state["model"].update({k: saved[k] for k in fp8_state if k in saved})
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=_options(trainable_only))
        return
    _transpose_states(state["optim"], model)  # back to the parameters' own layout
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(trainable_only))

