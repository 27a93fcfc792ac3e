"""The Hugging Face ``Trainer`` with checkpoints a model from ``fp8dist.wrap_model`` can take.

``transformers.Trainer`` trains such a model as it is (``wrap_model`` marks it as already distributed). What it
cannot do is write it: its ``save_model`` runs ``save_pretrained`` on rank 0 alone (FSDP2's shards need every rank
to gather them; a DDP wrapper's state dict names every weight ``module.*``) and it saves rank 0's optimizer state
for all ranks. :class:`FP8DistTrainer` is ``Trainer`` with those three steps done by fp8dist, on every rank:
``save_model`` writes a Hugging Face directory (:func:`fp8dist.save_pretrained`), a checkpoint holds the model and
optimizer as :func:`fp8dist.save_checkpoint` writes them, and ``resume_from_checkpoint`` loads them back
(:func:`fp8dist.load_checkpoint`). Everything else is Trainer's own."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers

from ..checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from ..checkpoint.hf import save_pretrained

__all__ = ["FP8DistTrainer", "CHECKPOINT_FOLDER"]

CHECKPOINT_FOLDER = "fp8dist"
"""The folder inside each of Trainer's ``checkpoint-N`` directories that holds fp8dist's checkpoint."""
_SCHEDULER = "scheduler.pt"  # Trainer's name for its scheduler's state


class FP8DistTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a model from ``fp8dist.wrap_model`` (strategy "fsdp", "ddp" or "none") that
    saves and resumes it: pass the model as returned and use it as Trainer. ``save_model`` must run on every rank
    (Trainer's own checkpoints do; call ``trainer.save_model(dir)`` on every rank too). Example::

        model = fp8dist.wrap_model(model, strategy="fsdp", fp8="torchao")
        trainer = FP8DistTrainer(model=model, args=TrainingArguments(...), train_dataset=dataset)
        trainer.train(resume_from_checkpoint=True)
        trainer.save_model("out")  # AutoModelForCausalLM.from_pretrained("out") reads it
    """

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model as a Hugging Face directory (bf16 weights, FP8 layers as their high-precision weights),
        its processing class and Trainer's arguments, to ``output_dir`` (default ``args.output_dir``); every rank
        calls it."""
        out = output_dir if output_dir is not None else self.args.output_dir
        save_pretrained(self.model_wrapped, out)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(out)
            torch.save(self.args, os.path.join(out, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # overwrite: Trainer rewrites its checkpoint-N folder when a resumed run reaches step N again
        save_checkpoint(Path(output_dir) / CHECKPOINT_FOLDER, self.model_wrapped, _torch_optimizer(self.optimizer),
                        step=self.state.global_step, overwrite=True)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing here: the model loads with its optimizer, from fp8dist's checkpoint, once both exist."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        found = latest_checkpoint(Path(checkpoint) / CHECKPOINT_FOLDER)
        if found is None:
            raise ValueError(f"{checkpoint} holds no fp8dist checkpoint ({CHECKPOINT_FOLDER}/): resume from a "
                             "checkpoint FP8DistTrainer wrote, or start without resume_from_checkpoint.")
        load_checkpoint(found, self.model_wrapped, _torch_optimizer(self.optimizer))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True))


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (its ``optimizer``), or ``optimizer``."""
    return getattr(optimizer, "optimizer", optimizer)
