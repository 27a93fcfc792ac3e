"""Ray Train: fp8dist's checkpoints go through ``ray.train.report`` (:func:`report_checkpoint`) and a restarted
worker group resumes from ``ray.train.get_checkpoint()`` (:func:`resume`).

Ray Train's ``TorchTrainer`` starts torch's default process group on every worker before the training function
runs; ``wrap_model`` called inside that function shards over it (or over ``mesh=``) as under torchrun. These two
functions are called inside the training function, on every worker::

    def train_func(config):
        model = fp8dist.wrap_model(build_model(), strategy="fsdp", fp8="torchao")
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        state = resume(model, optimizer)                  # None on a first start
        for step in range(state.step if state else 0, steps):
            ...                                           # forward, backward, optimizer.step()
            report_checkpoint({"loss": loss.item()}, model, optimizer, step=step + 1)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointError, CheckpointState, load_checkpoint, save_checkpoint
from ..checkpoint.io import from_rank0
from ..runtime.agree import on_all_ranks, rank_world
from ..pipeline.api import get_wrap_info

__all__ = ["INSTALL", "import_ray_train", "require_ray_train", "report_checkpoint", "resume"]

INSTALL = "pip install 'fp8dist[ray]'"
"""The command that installs the Ray Train version fp8dist is tested with."""

_SEEN = ".fp8dist-staging"  # rank 0 writes it into the staging folder; every worker must see it


def import_ray_train() -> Any:
    """The ``ray.train`` module; ImportError naming :data:`INSTALL` when Ray Train is not installed."""
    try:
        import ray.train
        import ray.train.torch  # noqa: F401  (the TorchTrainer half, which ray[train] brings)
    except ImportError as err:
        raise ImportError(f"fp8dist.integrations.ray needs Ray Train, which is not installed here ({err}): "
                          f"{INSTALL}.") from None
    return ray.train


def require_ray_train() -> Any:
    """The ``ray.train`` module, inside a Ray Train worker; raises ImportError naming :data:`INSTALL` when Ray is not
    installed, RuntimeError when called outside a ``TorchTrainer``'s training function."""
    train = import_ray_train()
    try:
        train.get_context().get_world_rank()
    except RuntimeError as err:  # Ray 2.60: "`get_context` cannot be used outside of a Ray Train training function"
        raise RuntimeError("fp8dist.integrations.ray's report_checkpoint and resume run inside the training function "
                           "of a ray.train.torch.TorchTrainer, on every worker; called elsewhere "
                           f"({type(err).__name__}: {err}). Train with TorchTrainer(train_func, ...).fit(), or use "
                           "fp8dist.save_checkpoint / load_checkpoint directly.") from None
    return train


def _staging_dir(staging: str | os.PathLike | None) -> Path:
    """A fresh folder for one checkpoint, made by rank 0 and seen by every worker (else CheckpointError)."""
    rank = rank_world()[0]

    def make() -> str:
        if staging is not None:
            Path(staging).mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix="fp8dist-ray-", dir=staging))
        (folder / _SEEN).touch()
        return str(folder)

    made = on_all_ranks("ray report_checkpoint (making a staging folder)", make if rank == 0 else None,
                        error=CheckpointError)
    folder = Path(from_rank0(made))
    where = "staging=" + (repr(str(staging)) if staging is not None else "None (this machine's temp folder)")

    def check() -> None:
        if not (folder / _SEEN).is_file():
            raise CheckpointError(f"worker {rank} does not see {folder}, which worker 0 made ({where}): the workers "
                                  "run on different machines. Pass report_checkpoint(..., staging=...) a folder on a "
                                  "filesystem every worker sees (NFS, a shared volume).")

    try:
        on_all_ranks("ray report_checkpoint (staging folder)", check, error=CheckpointError,
                     passthrough=(CheckpointError,))
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if rank == 0:  # seen by every worker: the checkpoint folder holds only the checkpoint
        (folder / _SEEN).unlink()
    return folder


def report_checkpoint(metrics: dict[str, Any], model: Any, optimizer: Any, *, step: int,
                      extra: dict[str, Any] | None = None, staging: str | os.PathLike | None = None) -> None:
    """Save an fp8dist checkpoint of ``model`` and ``optimizer`` at ``step`` and report it with ``metrics`` to Ray
    Train (``ray.train.report(metrics, checkpoint=...)``), which copies it into the run's storage. Call it on every
    worker, in the same steps, after ``optimizer.step()``: it is collective, like :func:`fp8dist.save_checkpoint`.

    Args:
        metrics: what Ray records with the checkpoint (worker 0's are kept).
        model: the model returned by ``wrap_model`` (DeepSpeed: the engine).
        optimizer: its optimizer (DeepSpeed: ``engine.optimizer``).
        step: optimizer steps done; :func:`resume` returns it as the batch to continue from.
        extra: JSON values kept with the checkpoint (``resume(...).extra``).
        staging: a folder every worker sees, where the checkpoint is written before Ray copies it; None: this
            machine's temp folder, which serves a cluster on one machine. The written copy is removed after Ray's.

    Ray's controller registers the checkpoint shortly after this returns: a worker group that fails at once may be
    restarted from the checkpoint before (the same losses follow, from an earlier step). Where that matters, call
    ``ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)``
    after it, which waits until Ray holds this one.

    Raises:
        ImportError: Ray is not installed (the message names ``pip install 'fp8dist[ray]'``).
        RuntimeError: not inside a Ray Train worker.
        CheckpointError: on every worker, when the save failed on any, or a worker does not see ``staging``.
    """
    train = require_ray_train()
    get_wrap_info(model)  # a model wrap_model did not return is refused before anything is written
    folder, lead = _staging_dir(staging), rank_world()[0] == 0
    try:
        save_checkpoint(folder, model, optimizer, step=step, extra=extra)
        # the folder is complete on a filesystem every worker sees: worker 0 hands it over for all of them
        train.report(metrics, checkpoint=train.Checkpoint.from_directory(str(folder)) if lead else None)
    finally:
        if lead:  # Ray's upload is done when report returns (its default synchronous mode)
            shutil.rmtree(folder, ignore_errors=True)


def resume(model: Any, optimizer: Any) -> CheckpointState | None:
    """Load the checkpoint Ray Train hands a restarted (or resumed) run, ``ray.train.get_checkpoint()``, into
    ``model`` and ``optimizer`` and restore each worker's RNG state. Call it on every worker, after ``wrap_model``
    and building the optimizer, before the first step.

    Returns:
        None when Ray has no checkpoint for this run (a first start); else the :class:`fp8dist.CheckpointState`:
        continue at batch ``state.step``.

    Raises:
        ImportError: Ray is not installed (the message names ``pip install 'fp8dist[ray]'``).
        RuntimeError: not inside a Ray Train worker.
        CheckpointError: the checkpoint does not load into this model (:func:`fp8dist.load_checkpoint` says why).
    """
    checkpoint = require_ray_train().get_checkpoint()
    get_wrap_info(model)
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:  # storage on this machine: the folder itself; else a download
        return load_checkpoint(folder, model, optimizer)
