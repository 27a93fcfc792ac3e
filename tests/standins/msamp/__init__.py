"""STAND-IN for MS-AMP's API surface (see tests/standins/README.md). Not MS-AMP.

``initialize`` checks its arguments like MS-AMP, replaces every nn.Linear with ``FP8Linear`` (plain math,
weights copied) and rebuilds Adam/AdamW as ``LBAdam``/``LBAdamW`` over the new parameters; ``INIT_CALLS`` records
(opt_level, optimizer class, number of parameters).
"""

import torch
from torch import nn

STANDIN = True
__version__ = "0+standin"
INIT_CALLS: list = []


class FP8Linear(nn.Linear):
    """Stand-in of MS-AMP's FP8 linear: same math as nn.Linear."""


class LBAdam(torch.optim.Adam):
    pass


class LBAdamW(torch.optim.AdamW):
    pass


def _replace(module):
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            new = FP8Linear(child.in_features, child.out_features, bias=child.bias is not None)
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if child.bias is not None:
                    new.bias.copy_(child.bias)
            setattr(module, name, new)
        else:
            _replace(child)
    return module


def initialize(model, optimizer=None, opt_level="O1"):
    if opt_level not in ("O1", "O2"):
        raise ValueError(f"Invalid optimization level {opt_level}")
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(f"Optimizer {optimizer} is not supported")
    index = {id(p): i for i, p in enumerate(model.parameters())}
    order = [index[id(p)] for g in optimizer.param_groups for p in g["params"]]
    model = _replace(model)
    params = list(model.parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[order.pop(0)] for _ in g["params"]]}
              for g in optimizer.param_groups]
    cls = LBAdamW if isinstance(optimizer, torch.optim.AdamW) else LBAdam
    INIT_CALLS.append((opt_level, type(optimizer).__name__, len(params)))
    return model, cls(groups)
