"""STAND-IN of transformer_engine.pytorch: modules compute in plain precision; fp8_autocast records its calls.

``AUTOCAST_CALLS`` lists (enabled, recipe, group) per fp8_autocast entry; ``Linear.fp8_forwards`` counts forwards
that ran with FP8 enabled.
"""

import contextlib

from torch import nn

from . import distributed  # noqa: F401

AUTOCAST_CALLS: list = []
_STATE = {"enabled": False}


@contextlib.contextmanager
def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
    AUTOCAST_CALLS.append((enabled, fp8_recipe, fp8_group))
    previous = _STATE["enabled"]
    _STATE["enabled"] = enabled
    try:
        yield
    finally:
        _STATE["enabled"] = previous


class Linear(nn.Linear):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda", **kwargs):
        super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)
        self.fp8_forwards = 0

    def forward(self, inp):
        if _STATE["enabled"]:
            self.fp8_forwards += 1
        return super().forward(inp)


class LayerNorm(nn.LayerNorm):
    def __init__(self, hidden_size, eps=1e-5, params_dtype=None, device="cuda", **kwargs):
        super().__init__(hidden_size, eps=eps, dtype=params_dtype, device=device)


class RMSNorm(nn.RMSNorm):
    def __init__(self, hidden_size, eps=1e-5, params_dtype=None, device="cuda", **kwargs):
        super().__init__(hidden_size, eps=eps, dtype=params_dtype, device=device)
