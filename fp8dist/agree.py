"""Every rank of a job must wrap the same model with the same settings. A rank given other settings (``fp8=`` on
one rank only) hangs the job in its first step, in a collective the others never enter; ranks holding different
weights under an engine that does not copy rank 0's (FSDP shards each rank's own copy) train a silent mixture.
``wrap_model`` compares a fingerprint of each rank's resolved config, plan, model structure and weights with one
collective, and every rank fails naming what differs, before anything is converted or sharded.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["check_ranks_agree", "fingerprint", "RanksDisagreeError"]


class RanksDisagreeError(ValueError):
    """The ranks of a job were given different settings, models or weights (the message says which)."""


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(model: nn.Module, cfg: Any, plan: Any, *, weights: bool) -> dict[str, Any]:
    """What must be equal on every rank: the config (as a dict: a difference is named by its key), the plan's
    decisions, the model's structure (names, shapes, dtypes) and, with ``weights``, a checksum of each parameter."""
    out: dict[str, Any] = {
        "config": cfg.to_dict(),
        "plan": _digest([(e.name, e.precision, e.converted_to) for e in plan]),
        "structure": _digest([(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]),
    }
    params = [p for p in model.parameters() if not p.is_meta]
    if weights and params:
        sums = torch.stack([p.detach().float().sum() + (p.detach().float().flatten()[::97]).sum() for p in params])
        out["weights"] = _digest([round(float(x), 4) for x in sums.double().cpu()])
    return out


def _differences(prints: list[dict[str, Any]]) -> list[str]:
    first = prints[0]
    lines = []
    for key in sorted({k for k, v in first["config"].items() if any(p["config"].get(k) != v for p in prints)}):
        values = ", ".join(f"rank {r} {p['config'].get(key)!r}" for r, p in enumerate(prints))
        lines.append(f"option {key}: {values}")
    for part, what in (("structure", "model structure (parameter names, shapes, dtypes)"),
                       ("plan", "precision plan"), ("weights", "weights")):
        other = [r for r, p in enumerate(prints) if p.get(part) != first.get(part)]
        if other and (part != "plan" or not lines):  # a config difference explains a plan difference
            lines.append(f"{what}: ranks {other} differ from rank 0")
    return lines


def check_ranks_agree(model: nn.Module, cfg: Any, plan: Any, env: Any) -> None:
    """Raise :class:`RanksDisagreeError` on every rank when the ranks' fingerprints differ (one all-gather).
    ``check_ranks="settings"`` leaves the weights out (ranks that differ on purpose), ``"off"`` checks nothing;
    weights are not compared where the strategy copies rank 0's weights anyway, or where they come later (a meta
    model, ``pretrained=``)."""
    level = cfg.parallel.check_ranks
    if level == "off" or env.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    weights = level == "all" and cfg.parallel.pretrained is None and not plan.facts.broadcasts_weights
    mine = fingerprint(model, cfg, plan, weights=weights)
    prints: list[Any] = [None] * env.world_size
    dist.all_gather_object(prints, mine)
    differ = _differences(prints)
    if differ:
        raise RanksDisagreeError(
            "the ranks of this job were given different models or settings: " + "; ".join(differ) + ". Every rank "
            "must build the same model (same seed or checkpoint) and call wrap_model with the same options; pass "
            "check_ranks='settings' where weights differ on purpose, or check_ranks='off'.")
