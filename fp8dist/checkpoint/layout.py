"""What a path given as a checkpoint directory is, decided once for every entry that takes one: a file, one
checkpoint (a ``step_*`` folder holding meta.json), a folder of another kind (a Hugging Face model) or a checkpoint
directory (``step_*`` folders and ``latest``; or nothing yet)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..runtime.files import check_output_path, wrong_kind
from ..strategies import STRATEGIES
from .io import CheckpointError, inside

__all__ = ["step_name", "step_dirs", "latest_checkpoint", "save_root", "find_checkpoint", "job_root",
           "job_checkpoints"]

META = "meta.json"
_STEP = re.compile(r"step_(\d+)")

# (globs that mark a folder of another kind, what it is, the way out); a strategy's own format adds its own
_OTHER_KINDS = (
    (("config.json", "*.safetensors", "pytorch_model.bin"), "a Hugging Face model folder",
     "load it as pretrained weights (fp8dist train --pretrained, from_pretrained)"),
    ((".metadata",), "a torch.distributed.checkpoint folder that fp8dist.save_checkpoint did not write (no meta.json)",
     "load it with torch.distributed.checkpoint"),
)


def step_name(step: int) -> str:
    """The folder name of the checkpoint saved after ``step`` steps (``step_00000042``: names sort by step)."""
    return f"step_{step:08d}"


def _step_of(path: Path) -> int | None:
    match = _STEP.fullmatch(path.name)
    return int(match.group(1)) if match else None


def step_dirs(root: Path) -> list[Path]:
    """The ``step_*`` folders of ``root``, oldest step first."""
    found = [p for p in root.glob("step_*") if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=_step_of)


def _refuse_foreign(given: str | os.PathLike) -> Path:
    """``given`` as a Path; CheckpointError for a file, a folder inside a checkpoint, or one of another kind."""
    path = Path(given)
    mismatch = wrong_kind(path, name="path", directory=True)
    if mismatch is not None:
        raise CheckpointError(mismatch)
    checkpoint = next((p for p in (path, *path.parents) if _one_checkpoint(p)), None)  # path is it, or inside it
    if checkpoint is not None and checkpoint != path:
        raise CheckpointError(f"'{path}' is inside the checkpoint '{checkpoint}': pass that checkpoint, or the "
                              f"checkpoint directory above it ('{checkpoint.parent}').")
    if checkpoint is None and path.is_dir() and not step_dirs(path):  # DeepSpeed's folders have a `latest` too
        own = [s.checkpoint.written_by_hand for s in STRATEGIES.values() if s.checkpoint is not None]
        for marks, what, way_out in (*_OTHER_KINDS, *own):
            found = next((hit.name for mark in marks for hit in sorted(path.glob(mark))), None)
            if found is not None:
                raise CheckpointError(f"'{path}' is {what} ({found}), not an fp8dist checkpoint directory: {way_out}; "
                                      "checkpoints go to a directory of their own.")
    return path


def _one_checkpoint(path: Path) -> bool:
    return (path / META).is_file()


def latest_checkpoint(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint (what ``path/latest`` names); None when there is none yet (``path`` missing
    or empty).

    Raises:
        CheckpointError: ``path`` is a file, one checkpoint (a ``step_*`` folder: pass the directory above it), a
            folder of another kind, or its ``latest`` names a folder that is not there.
    """
    root = _refuse_foreign(path)
    if _one_checkpoint(root):
        raise CheckpointError(f"'{root}' is one checkpoint, not a checkpoint directory: its newest checkpoint is "
                              f"named in '{root.parent / 'latest'}' (pass '{root.parent}').")
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not inside(root, name, "the 'latest' entry").is_dir():
        raise CheckpointError(f"{pointer} names {name!r}, which is not in {root}: the directory was changed by hand.")
    return root / name


def save_root(path: str | os.PathLike) -> Path:
    """``path`` as the checkpoint directory to save into (it may not exist yet), else CheckpointError."""
    root = _refuse_foreign(path)
    if _one_checkpoint(root):
        raise CheckpointError(f"'{root}' is one checkpoint, not a checkpoint directory: saving into it would put "
                              f"checkpoints inside a checkpoint. Save into the directory above it ('{root.parent}').")
    try:
        check_output_path(root, name="path", directory=True)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    return root


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint to load: ``path`` when it is one, else what ``path/latest`` names (the newest complete one).

    Raises:
        FileNotFoundError: ``path`` does not exist, or holds no checkpoint.
        CheckpointError: ``path`` is a file, a folder inside a checkpoint, or a directory of another kind (a
            DeepSpeed or Hugging Face directory written by hand).
    """
    root = _refuse_foreign(path)
    if not root.exists():
        raise FileNotFoundError(f"checkpoint '{root}' does not exist.")
    if _one_checkpoint(root):
        return root
    found = latest_checkpoint(root)
    if found is None:
        raise FileNotFoundError(f"{root} holds no checkpoint (no 'latest' file and no meta.json). Pass a directory "
                                "that save_checkpoint wrote, or one of its step_* folders.")
    return found


def job_root(path: str | os.PathLike) -> Path:
    """The checkpoint directory a training job given ``path`` saves into: ``dir`` for ``dir/step_N``."""
    given = Path(path)
    return given.parent if _one_checkpoint(given) else given


def job_checkpoints(path: str | os.PathLike) -> tuple[Path, Path | None]:
    """A training job's ``checkpoint_dir`` as (the directory it saves into, the checkpoint it resumes from or None).
    ``dir/step_N`` resumes from itself and saves into ``dir``; it must be the newest there (a run from an older step
    would replace the newer ones, and the same command would later restart from step N). Call it once, before the
    job's first step.

    Raises:
        CheckpointError: ``dir/step_N`` is not the newest checkpoint of ``dir``, or a checkpoint not named
            ``step_NNNNNNNN``; ``path`` is a file, inside a checkpoint, or a directory of another kind.
    """
    given = _refuse_foreign(path)
    if not _one_checkpoint(given):
        return given, latest_checkpoint(given)
    root, step = job_root(given), _step_of(given)
    if step is None:
        raise CheckpointError(f"'{given}' is one checkpoint outside a checkpoint directory (its name is not "
                              "step_NNNNNNNN): move it into a directory of its own as step_NNNNNNNN (its step), and "
                              "pass that directory.")
    newer = [p.name for p in step_dirs(root) if _step_of(p) > step]
    if newer:
        raise CheckpointError(
            f"'{given}' is step {step} of '{root}', which holds newer checkpoints ({', '.join(newer)}): continue "
            f"from the newest with '{root}', or to go back to step {step} move the newer step folders out of "
            f"'{root}' first (this run would replace them).")
    return root, given
