"""The one table of dtype names: what configs call a dtype ("bf16"), what reports print, and other spellings. The
names are known without importing torch (the CLI's flags); :data:`DTYPES`, the torch dtypes, is built when first
read."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# DTYPES is built by the module's __getattr__ when first read
__all__ = ["DTYPES", "DTYPE_ALIASES", "DTYPE_NAMES", "torch_dtype", "dtype_name", "dtype_names",  # noqa: F822
           "dtype_bytes"]

_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # each short name's torch attribute

DTYPE_NAMES = tuple(_TORCH_NAMES)
"""The short names, in the order of :data:`DTYPES`: ``fp32``, ``bf16``, ``fp16``."""

DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
}
"""Other spellings of the short names (a torch dtype is read as its ``str``)."""


def __getattr__(name: str) -> Any:
    """``DTYPES``: ``{short name: torch dtype}``, built (torch imported) when first read."""
    if name != "DTYPES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _dtypes()


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {short: getattr(torch, attribute) for short, attribute in _TORCH_NAMES.items()}


@functools.cache
def _names() -> dict[torch.dtype, str]:
    import torch

    return {**{dtype: name for name, dtype in _dtypes().items()}, torch.float8_e4m3fn: "fp8 e4m3",
            torch.float8_e5m2: "fp8 e5m2"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name of :data:`DTYPES` ("bf16" -> torch.bfloat16); KeyError for another name."""
    return _dtypes()[name]


def dtype_name(dtype: torch.dtype | None) -> str:
    """The short name of a dtype as reports print it: fp32, bf16, fp8 e4m3, int64, ...; "none" for None."""
    return "none" if dtype is None else _names().get(dtype, str(dtype).removeprefix("torch."))


def dtype_names(dtypes: set[torch.dtype], empty: str = "none") -> str:
    """Several dtypes as one sorted "bf16/fp32" string; ``empty`` for none."""
    return "/".join(sorted(dtype_name(d) for d in dtypes)) or empty


def dtype_bytes(name: str) -> int:
    """Bytes per element of a short dtype name ("fp32" 4, "bf16" 2, "fp8" 1)."""
    import torch

    return 1 if name.startswith("fp8") else torch.finfo(torch_dtype(name)).bits // 8
