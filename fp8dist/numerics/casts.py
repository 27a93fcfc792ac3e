"""The probe's operand layout: along which dim each operand of a Linear's GEMMs is summed (rowwise scales and MX
blocks run along it). The casts themselves are the backends' (:class:`~fp8dist.fp8.casts.CastEmulation`); the
built-in emulation, :class:`Cast`, is re-exported here where it was."""

from __future__ import annotations

from ..fp8.casts import Cast

__all__ = ["Cast", "CONTRACTION_DIM"]

CONTRACTION_DIM = {("input", "output"): -1, ("weight", "output"): 0, ("grad_output", "grad_input"): -1,
                   ("input", "grad_weight"): 0, ("weight", "grad_input"): -1, ("grad_output", "grad_weight"): 0}
"""The dim of the 2-D operand (x (M, K), W_t (K, N), g (M, N)) its GEMM sums over: rowwise scales and MX blocks run
along it (torchao's ``axiswise_dim``)."""
