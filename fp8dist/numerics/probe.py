"""``measure_fp8_numerics``: run the model in high precision on the user's batches and measure, for each GEMM
the plan would run in FP8, what the recipe's casts would do to its operands and its output."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..config.text import plural
from ..fp8.torchao import TorchaoBackend
from ..runtime.hardware import Hardware, parse_target
from .batches import checked_batches
from .capture import attach
from .report import NumericsReport
from .stats import LayerNumerics, ReduceStats
from .thresholds import DEFAULT_THRESHOLDS, Thresholds, as_thresholds

__all__ = ["measure_fp8_numerics"]

LossFn = Callable[[Any, Any], torch.Tensor]


def measure_fp8_numerics(model: nn.Module, batches: Iterable[Any], *, fp8: str = TorchaoBackend.name,
                         target: str | Hardware | None = None, loss_fn: LossFn | None = None,
                         thresholds: Thresholds | Mapping[str, float] = DEFAULT_THRESHOLDS,
                         **options: Any) -> NumericsReport:
    """Measure what FP8 casts do to each layer the plan (:func:`fp8dist.plan_precision` with these options) would
    run in FP8, on ``batches``: before training in FP8, or on a checkpoint. The model runs forward and backward once
    per batch in its own precision, in this process, unchanged (no ``.grad`` accumulates); each planned GEMM's input,
    weight and output gradient are cast as the recipe casts them (torchao's functions; TE's recipes emulated).

    Args:
        model: the unwrapped model, with real weights or on the meta device (then materialized in a copy, from
            ``pretrained=`` when given, else by its own initialization; the model passed stays as it was).
        batches: token id tensors (run as ``model(input_ids=b, labels=b)``) or mappings of keyword arguments
            (``model(**b)``); the loss is the output's ``.loss``, else ``loss_fn(output, batch)``.
        fp8: the backend whose casts to measure: any whose ``numerics_casts`` models them ("torchao"; "te",
            emulated: TE needs a GPU; a registered backend's own cast emulation).
        target: plan for this machine ("h100", "sm_90", a :class:`~fp8dist.runtime.hardware.Hardware`); None: this
            one, as if it had FP8. On a CPU, MoE experts are FP8 candidates only for a GPU target.
        loss_fn: ``(output, batch) -> loss`` for a model whose output has no ``.loss``.
        thresholds: the limits behind ``recommended_exclude``: :class:`~fp8dist.numerics.Thresholds`, or a dict
            of the ones to change (``{"max_flushed_share": 0.02}``).
        **options: any ``wrap_model`` option that shapes the plan (``torchao_recipe="rowwise"``,
            ``fp8_exclude=[...]``, ``te_recipe="delayed"``, ``pretrained=DIR``, ``strategy``, ``device``).

    Returns:
        A :class:`~fp8dist.numerics.NumericsReport`: ``print`` it, ``.to_dict()``, ``.recommended_exclude``.
        An option set away from its default that no chosen axis reads is said in a UserWarning, as wrap_model says it.

    Raises:
        ValueError: a bad option or threshold, no batches, a batch the model cannot read (float ids, ids past its
            vocabulary, a wrong shape, no tokens, more tokens than its positions), no loss to differentiate, a
            model already wrapped, sharded or FP8-converted (pass it as built), or no layer in FP8 to measure.
        TypeError: ``batches``, a batch, ``thresholds`` or ``loss_fn`` of the wrong type.
        NotImplementedError: a backend whose casts are not modeled (MS-AMP's), naming those that are.
        FP8UnavailableError: ``target`` has no FP8.
    """
    from ..config.resolve import resolve_config
    from ..fp8 import get_backend
    from ..runtime.env import resolve_device
    from ..plan.precision import plan_precision
    from ..plan.tail import tail_share

    _check_as_built(model)
    # every FP8 candidate is measured, predicted fast or not: the plan weighs speed when it reads the report
    cfg = resolve_config(fp8=fp8, **{**options, "fp8_select": options.get("fp8_select") or "all"})
    if cfg.precision.fp8 is None:
        from ..fp8.advice import backends_with_casts

        raise ValueError("fp8=None: there is no FP8 cast to measure. Pass "
                         f"{' or '.join(f'fp8={n!r}' for n in backends_with_casts())}.")
    for note in cfg.unread_notes():  # an option no chosen axis reads, said as wrap_model says it
        warnings.warn(note, UserWarning, stacklevel=2)
    device = resolve_device(cfg.parallel.device, 0)
    hardware = parse_target(target) if isinstance(target, str) else target
    plan = plan_precision(model, cfg, device=hardware or device, check_hardware=hardware is not None,
                          check_installed=False)
    backend = get_backend(cfg.precision.fp8)
    layers = {e.name: (e.module_type, "experts" if e.grouped else "linear",
                       backend.numerics_casts(backend.layer_config(cfg, e), plan.facts, plan.hardware,
                                              grouped=e.grouped)) for e in plan.fp8}  # its own recipe (auto)
    thresholds = as_thresholds(thresholds)  # every input checked before the model is copied or run
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn={loss_fn!r} is not callable: pass a function (output, batch) -> scalar loss, or "
                        "leave it out for a model whose output has .loss.")
    batches = checked_batches(model, batches)
    if not layers:  # a report of 0 layers would read as "every layer is safe"
        kept = ([f"{plural(n, 'GEMM module')}: {reason}" for reason, n, _ in plan.coverage.kept[:3]]
                or [f"{e.name}: {e.reason}" for e in list(plan)[:3]] or ["no module holds parameters"])
        raise ValueError(f"measure_fp8_numerics: fp8={cfg.precision.fp8!r} would run no layer of "
                         f"{type(model).__name__} in FP8 ({'; '.join(kept)}), so there is "
                         "nothing to measure. Pass the model whose nn.Linear layers are to train in FP8, as built, "
                         "or fewer fp8_exclude patterns.")
    runnable = _model_to_run(model, cfg, device)
    sites, handles, modes = attach(runnable, layers)
    weights = _reduced_weights(runnable, [s.layer for s in sites], cfg.parallel)
    tokens = 0
    try:
        for batch in batches:
            tokens += _run_batch(runnable, batch, device, loss_fn, weights)
    finally:
        for remove in handles:
            remove()
    emulated, (share, why) = backend.numerics_note(cfg), tail_share(cfg, plan.hardware, backend)
    tail = [f"the last blocks and the output head not measured: the plan keeps them out of low precision ({why}); "
            "keep_last_blocks_share=0 measures them"] if share else []
    notes = ([emulated] if emulated else []) + tail + _notes(plan, modes, hardware)
    return NumericsReport(backend=cfg.precision.fp8, recipe=plan.detail, hardware=str(plan.hardware),
                          batches=len(batches), tokens=tokens, layers=tuple(s.layer for s in sites),
                          thresholds=thresholds, notes=tuple(notes))


def _check_as_built(model: nn.Module) -> None:
    """Refuse a model wrapped, sharded or FP8-converted anywhere, naming where: its layers are not the candidates."""
    from ..fp8 import converted_by_hand
    from ..strategies.introspect import find_wrapping

    found = find_wrapping(model) if isinstance(model, nn.Module) else None
    converted = converted_by_hand(model) if isinstance(model, nn.Module) and found is None else None
    if found is None and converted is None:
        return
    what = found.describe(model) if found else \
        f"{converted[0] or 'the model given'} is already a {converted[2]} (converted by hand)"
    raise ValueError(f"measure_fp8_numerics: {what}. The probe measures the model as built, in this process: pass it "
                     "before wrap_model, any engine or FP8 conversion, then hand the report to wrap_model(..., "
                     "numerics=report); to measure a checkpoint, build the model afresh and pass pretrained=DIR.")


def _model_to_run(model: nn.Module, cfg, device: torch.device) -> nn.Module:
    """The model itself when it has its weights; else a copy materialized on ``device`` (``pretrained=`` too)."""
    from ..runtime.agree import alone
    from ..pipeline.meta_init import is_meta_model
    from ..strategies.common import to_empty
    from ..pipeline.pretrained import materialize

    meta, pretrained = is_meta_model(model), cfg.parallel.pretrained
    if not meta and pretrained is None:
        return model
    copied = copy.deepcopy(model)
    if meta:
        to_empty(copied, device)
    with alone():  # the probe runs in this process only, even on one rank of a job
        materialize(copied, device, pretrained, meta=meta)
    return copied


def _reduced_weights(model: nn.Module, layers: list[LayerNumerics], parallel) -> dict[int, LayerNumerics]:
    """Under ``reduce_dtype="fp8"``: each trained GEMM weight's layer (by the parameter's id), given a
    :class:`ReduceStats` of the configured block; else nothing."""
    if parallel.reduce_dtype != "fp8":
        return {}
    out = {}
    for layer in layers:
        param = getattr(model.get_submodule(layer.name), layer.gemm or "weight", None)
        if isinstance(param, nn.Parameter) and param.requires_grad:
            layer.reduce = ReduceStats(parallel.reduce_fp8_block)
            out[id(param)] = layer
    return out


def _run_batch(model: nn.Module, batch: Any, device: torch.device, loss_fn: LossFn | None,
               weights: dict[int, LayerNumerics]) -> int:
    """Forward and backward on one batch (gradients computed, not accumulated), each of ``weights``' gradients
    counted as the FP8 reduction would send it; returns its token count."""
    param = next(model.parameters(), None)
    where = param.device if param is not None else device
    if isinstance(batch, torch.Tensor):
        batch = batch.to(where)
        output, tokens = model(input_ids=batch, labels=batch), batch.numel()
    else:  # a mapping (checked_batches let nothing else through)
        batch = {k: v.to(where) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        output, ids = model(**batch), batch.get("input_ids")
        tokens = ids.numel() if isinstance(ids, torch.Tensor) else 1
    loss = loss_fn(output, batch) if loss_fn is not None else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"no scalar loss to differentiate (the model's output {type(output).__name__} has no "
                         ".loss): pass loss_fn=lambda output, batch: ... returning a scalar tensor, or batches "
                         "that make the model compute its loss (labels).")
    params = [p for p in model.parameters() if p.requires_grad]
    if params and loss.requires_grad:
        grads = torch.autograd.grad(loss, params, allow_unused=True)  # runs every hook; .grad stays untouched
        for param, grad in zip(params, grads):
            if grad is not None and id(param) in weights:
                weights[id(param)].reduce.add(grad)
    return tokens


def _notes(plan, modes, hardware: Hardware | None) -> list[str]:
    left_out: dict[str, list[str]] = {}
    for entry in plan:
        if entry.grouped and entry.precision != "fp8":
            left_out.setdefault(entry.reason, []).append(entry.name)
    how = "" if hardware is not None else ("; target='h100' (fp8dist probe --target h100) measures them as an H100 "
                                           "runs them")
    unseen = [f"MoE experts {name}: no grouped GEMM on its weights was seen (another experts_implementation?): not "
              "measured" for name, mode in modes if mode.seen == 0]
    return [f"MoE experts not measured ({plural(len(names), 'module')}, e.g. {names[0]}): not FP8 in this plan, "
            f"{reason}{how}" for reason, names in left_out.items()] + unseen
