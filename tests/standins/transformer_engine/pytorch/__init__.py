"""STAND-IN of transformer_engine.pytorch: modules compute in plain precision; the autocast records its calls.

``AUTOCAST_CALLS`` lists (enabled, recipe, group, the name called) per autocast entry; ``Linear.fp8_forwards``
counts forwards that ran with FP8 enabled; ``Linear.quantized_init`` is the recipe of the ``quantized_model_init``
it was created under (TE 2.20's signature; real TE then holds its weight quantized, the stand-in in full), else
None. TE 2.20's ``autocast`` exists unless the stand-in is TE 2.8's (see the
package docstring); ``fp8_autocast`` warns there as TE's deprecated shim does.
"""

import contextlib
import warnings

from torch import nn

from .. import API
from . import distributed  # noqa: F401

AUTOCAST_CALLS: list = []
_STATE = {"enabled": False}


@contextlib.contextmanager
def _autocast(name, enabled, recipe, group):
    AUTOCAST_CALLS.append((enabled, recipe, group, name))
    previous = _STATE["enabled"]
    _STATE["enabled"] = enabled
    try:
        yield
    finally:
        _STATE["enabled"] = previous


def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
    if API != "2.8":
        warnings.warn("fp8_autocast is deprecated and will be removed in a future release. Use autocast(enabled=..., "
                      "calibrating=..., recipe=..., group=..., _graph=...) instead.", DeprecationWarning, stacklevel=2)
    return _autocast("fp8_autocast", enabled, fp8_recipe, fp8_group)


if API != "2.8":
    def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
        return _autocast("autocast", enabled, recipe, amax_reduction_group)


_QUANTIZED_INIT = {"recipe": None}


if API != "2.8":
    @contextlib.contextmanager
    def quantized_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
        previous = _QUANTIZED_INIT["recipe"]
        _QUANTIZED_INIT["recipe"] = (recipe if recipe is not None else "default") if enabled else None
        try:
            yield
        finally:
            _QUANTIZED_INIT["recipe"] = previous


class Linear(nn.Linear):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda", **kwargs):
        super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)
        self.fp8_forwards = 0
        self.quantized_init = _QUANTIZED_INIT["recipe"]

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
