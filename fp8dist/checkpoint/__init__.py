"""Checkpoints for every strategy (``save_load``: layout, meta.json, atomic publish; ``io``: what each engine
writes and reads back; ``compat``: what loads into what, across strategies and FP8 on/off), and the export to
Hugging Face safetensors (``hf``: :func:`~fp8dist.checkpoint.hf.save_pretrained`)."""

from .save_load import CheckpointError, CheckpointState, latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointState", "CheckpointError"]
