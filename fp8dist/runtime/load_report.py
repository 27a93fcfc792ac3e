"""The record of what loading a pretrained directory read on a rank: made by the pipeline's loaders
(:func:`fp8dist.pipeline.pretrained.load_pretrained`, :func:`fp8dist.pipeline.fp8_base.load_fp8_base`), passed on by
a strategy's fill, kept in ``WrapInfo.pretrained``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadReport"]


@dataclass(frozen=True)
class LoadReport:
    """What loading a pretrained directory read on this rank (:attr:`fp8dist.pipeline.api.WrapInfo.pretrained`)."""

    path: str
    """The directory loaded."""
    bytes_read: int
    """Tensor bytes this rank read from the files."""
    checkpoint_bytes: int
    """Tensor bytes of the whole checkpoint."""
    dequantized: str = ""
    """What of an FP8 checkpoint was dequantized into the parameters ("" for none), as said in a warning."""
    held_fp8: int = 0
    """FP8 weights kept as the checkpoint's e4m3 bits (a LoRA base loaded in FP8: :mod:`fp8dist.pipeline.fp8_base`)."""
