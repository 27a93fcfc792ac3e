"""Under an FP4 recipe (NVFP4) the last blocks and the output head stay in the strategy's precision
(``keep_last_blocks_share``), as NVFP4 training is done in practice."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..config.options import FP4_TAIL_SHARE
from ..config.text import plural
from ..runtime.hardware import Hardware
from .speed import RECIPES
from ..fp8.order import per_structure

__all__ = ["tail_share", "kept_tail"]


def tail_share(cfg: Any, hardware: Hardware, backend: Any) -> tuple[float, str]:
    """The share of the last blocks kept out of low precision, and why: ``keep_last_blocks_share``, or where None
    FP4_TAIL_SHARE under a recipe of FP4 GEMMs (by its speed-model recipe), else 0."""
    share = cfg.precision.keep_last_blocks_share
    if share is not None:
        return share, f"keep_last_blocks_share={share:g}"
    recipe, _ = backend.speed_recipe(cfg, hardware)
    if recipe in RECIPES and RECIPES[recipe].gemm == "fp4":
        return FP4_TAIL_SHARE, (f"keep_last_blocks_share={FP4_TAIL_SHARE:g}, the default under an FP4 recipe "
                                f"({recipe}): NVFP4 training keeps the last ~15% of blocks and the head in bf16")
    return 0.0, ""


def kept_tail(model: nn.Module, cfg: Any, backend: Any, hardware: Hardware) -> tuple[dict[str, str], list[str]]:
    """``{module: reason}`` for the modules in the last blocks (rounded up) and the output head (the last GEMM to
    run), and a note saying which; nothing where the share is 0."""
    from ..fp8.order import gemm_order
    from ..runtime.adapters import without_adapters
    from ..strategies.common import find_blocks

    share, why = tail_share(cfg, hardware, backend)
    if not share:
        return {}, []
    found, how = find_blocks(model, cfg.parallel.block_classes)
    blocks = [name for name, _ in found[::-1]]  # declared order, outermost blocks only
    blocks = [b for b in blocks if not any(b.startswith(f"{outer}.") for outer in blocks)]
    kept = blocks[len(blocks) - math.ceil(share * len(blocks)):] if blocks else []
    # a meta forward of the whole model: once per structure and precision config (a planner re-plans one model)
    head = per_structure(model, ("tail head", backend.name, repr(cfg.precision)), lambda: gemm_order(
        model, without_adapters(model, lambda m: backend.supports(m) and backend.computes_in_fp8(m))).last)
    reasons = {}
    for name, _ in model.named_modules():
        block = next((b for b in kept if name == b or name.startswith(f"{b}.")), None)
        if block is not None:
            reasons[name] = (f"in {block}, one of the last {len(kept)} of {plural(len(blocks), 'block')}, kept in "
                             f"high precision ({why})")
    if head is not None and head not in reasons:
        reasons[head] = f"the output head (the last GEMM to run), kept in high precision ({why})"
    where = (f"the last {len(kept)} of {plural(len(blocks), 'block')} ({', '.join(kept)})" if kept else
             f"no block ({how})")
    head_words = f" and the output head {head}" if head is not None else ""
    return reasons, [f"{why}: {where}{head_words} stay out of low precision"]
