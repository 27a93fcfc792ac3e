"""STAND-IN of msamp.deepspeed (see tests/standins/README.md). Not MS-AMP.

``initialize`` records the config's "msamp" block, converts every nn.Linear as the msamp.initialize stand-in
does, then runs the REAL ``deepspeed.initialize`` with the block removed (plain DeepSpeed does not know it).
"""

import deepspeed

from . import _replace

CALLS: list = []


def initialize(model=None, optimizer=None, model_parameters=None, config=None, **kwargs):
    block = dict(config.get("msamp", {}))
    CALLS.append(block)
    if block.get("enabled"):
        model = _replace(model)
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    plain = {k: v for k, v in config.items() if k != "msamp"}
    return deepspeed.initialize(model=model, optimizer=optimizer, model_parameters=model_parameters, config=plain,
                                **kwargs)
