"""Checkpoints for every strategy (``save_load``), and the export to Hugging Face safetensors (``hf``)."""

from .save_load import CheckpointError, CheckpointState, latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "CheckpointState", "CheckpointError"]
