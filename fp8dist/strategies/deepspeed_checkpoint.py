"""DeepSpeed's own engine checkpoint (ZeRO's partitions and fp32 masters, which ``get_state_dict`` cannot read): what
:mod:`fp8dist.checkpoint` writes, reads and compares for strategy "deepspeed"; the policy (atomicity, checksums,
refusing foreign pickled classes) stays there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..config.text import plural

__all__ = ["ZeROCheckpoint"]


class ZeROCheckpoint:
    """A strategy's own checkpoint format: the members the checkpoint tool reads of any such object."""

    format = "deepspeed"
    """What meta.json records as ``engine``: a checkpoint loads only into a strategy of the same format."""
    tag = "deepspeed"  # the folder DeepSpeed writes inside the checkpoint
    saved_as = "in DeepSpeed's own checkpoint format"  # how refusals name this format, and this engine
    loads_only = "this model is a DeepSpeed engine, which loads only DeepSpeed's own checkpoint format"
    pickled = frozenset({"deepspeed.utils.tensor_fragment.fragment_address",
                         "deepspeed.runtime.zero.config.ZeroStageEnum",
                         "deepspeed.runtime.fp16.loss_scaler.LossScaler"})
    """The classes besides tensors the engine's files hold: DeepSpeed unpickles them, so any other is refused."""
    written_by_hand = (("zero_to_fp32.py", "global_step*", "mp_rank_*_model_states.pt"), "a DeepSpeed engine "
                       "checkpoint folder", "load it with the DeepSpeed engine's own load_checkpoint")
    """(globs that mark a folder the engine wrote itself, what it is, what to do instead): ``save_checkpoint``
    refuses to write into one."""

    def record(self, cfg: Any) -> dict[str, Any]:
        """What meta.json records besides the strategy, and :meth:`mismatch` compares."""
        return {"zero_stage": cfg.parallel.zero_stage}

    def layout(self, model: nn.Module) -> tuple[dict[str, list[int]], list[str]]:
        """Every parameter's full shape (ZeRO-3's ``ds_shape``) and the names of the ``_extra_state`` entries."""
        module = model.module  # an _extra_state entry where nn.Module.state_dict writes one: get_extra_state overridden
        extra = [f"{n}._extra_state" if n else "_extra_state" for n, m in module.named_modules()
                 if type(m).get_extra_state is not nn.Module.get_extra_state]
        return {n: list(getattr(p, "ds_shape", p.shape)) for n, p in module.named_parameters()}, sorted(extra)

    def files(self, path: Path) -> list[Path]:
        """The files :meth:`load` unpickles."""
        return sorted((path / self.tag).glob("*.pt"))

    def save(self, model: nn.Module, path: Path) -> None:
        """The engine's own ``save_checkpoint`` into ``path`` under fp8dist's tag (every rank calls it)."""
        model.save_checkpoint(str(path), tag=self.tag, save_latest=False)

    def load(self, model: nn.Module, path: Path, *, optimizer: bool) -> str | None:
        """Load into the engine (its optimizer's state too when ``optimizer``); the refusal when there is none."""
        loaded, _ = model.load_checkpoint(str(path), tag=self.tag, load_optimizer_states=optimizer,
                                          load_lr_scheduler_states=optimizer)
        return None if loaded is not None else f"DeepSpeed found no checkpoint in {path / self.tag}."

    def mismatch(self, saved: dict[str, Any], now: dict[str, Any], path: Path) -> str | None:
        """Why the checkpoint (its meta.json ``saved``) cannot load into this engine (``now``); None: it can."""
        keys = ("zero_stage", "world_size", "fp8")
        diffs = [f"{k}: checkpoint {saved.get(k)!r}, this model {now[k]!r}" for k in keys if saved.get(k) != now[k]]
        if not diffs:
            return None
        return (f"{path} does not match this model: {'; '.join(diffs)}. A DeepSpeed checkpoint loads into the ZeRO "
                "stage, world size and FP8 backend it was saved with. Way out: convert it with DeepSpeed's "
                "ds_to_universal (python -m deepspeed.checkpoint.ds_to_universal) and load the universal checkpoint "
                "with DeepSpeed, or turn it into a full fp32 state dict with its zero_to_fp32.py script.")

    def way_out(self, saved: dict[str, Any], path: Path) -> str:
        """How to use a checkpoint of this format in a strategy of another."""
        return (f"load it into strategy={saved['strategy']!r} with zero_stage={saved['zero_stage']} on "
                f"{plural(saved['world_size'], 'rank')}, or turn it into a full fp32 state dict with DeepSpeed's "
                f"script (python {path}/zero_to_fp32.py {path} OUT_DIR --tag {self.tag}), load that into the model "
                "before wrap_model and start a new optimizer")
