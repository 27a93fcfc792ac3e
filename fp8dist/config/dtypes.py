"""The one table of dtype names: what configs call a dtype ("bf16"), what reports print, and other spellings."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "DTYPE_ALIASES", "torch_dtype", "dtype_name", "dtype_names", "dtype_bytes"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
}
"""Other spellings of the short names (a torch dtype is read as its ``str``)."""

_NAMES = {**{dtype: name for name, dtype in DTYPES.items()}, torch.float8_e4m3fn: "fp8 e4m3",
          torch.float8_e5m2: "fp8 e5m2"}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def dtype_name(dtype: torch.dtype | None) -> str:
    """The short name of a dtype as reports print it: fp32, bf16, fp8 e4m3, int64, ...; "none" for None."""
    return "none" if dtype is None else _NAMES.get(dtype, str(dtype).removeprefix("torch."))


def dtype_names(dtypes: set[torch.dtype], empty: str = "none") -> str:
    """Several dtypes as one sorted "bf16/fp32" string."""
    return "/".join(sorted(dtype_name(d) for d in dtypes)) or empty


def dtype_bytes(name: str) -> int:
    """Bytes per element of a short dtype name ("fp32" 4, "bf16" 2, "fp8" 1)."""
    return 1 if name.startswith("fp8") else torch.finfo(DTYPES[name]).bits // 8
