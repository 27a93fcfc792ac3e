"""Which of the layers an FP8 backend would convert run in FP8: all, or ("auto") those the speed model predicts faster
than bf16 on the plan's GPU at this run's tokens per rank; given a numerics probe's report, only those it measured
safe; under an FP4 recipe, not the model's tail (:mod:`.tail`). Called last by :func:`fp8dist.plan_precision`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config.axis import StrategyFacts
from ..config.text import listing, plural
from ..runtime.hardware import Hardware, find_gpu
from .tail import kept_tail
from ..config.options import DEFAULT_SEQ_LEN
from .speed import LayerChoice, LinearPrediction, StepPrediction, predict_linear

__all__ = ["Selection", "select", "numerics_verdicts", "reduce_fallbacks", "with_read_options", "describe_prediction",
           "speedup_of"]

Verdicts = Mapping[str, tuple[str, ...] | None]


@dataclass(frozen=True)
class Selection:
    """How the plan chose among the layers its backend would convert, and the predicted GEMM time of its choice."""

    mode: str
    """What applied: "auto" (by predicted speed) or "all"."""
    why: str
    """Asked for, or the hardware's default, and why auto could not apply."""
    tokens: int
    """Tokens per rank per micro-batch the predictions are made at (micro_batch_size x seq_len)."""
    tokens_from: str
    """Where ``tokens`` comes from, in words (the config's micro_batch_size and seq_len, or the default assumed)."""
    margin: float
    """The speedup a layer must reach under auto (fp8_select_margin)."""
    step: StepPrediction | None
    """The predicted layers as planned, with the step's GEMM totals; None where nothing was predicted."""
    unpredicted: str = ""
    """Why no figure was predicted (a CPU, a GPU missing from the table, a backend without a speed model)."""
    asked: str | None = None
    """fp8_select as given (None: the hardware's default)."""
    numerics: str = ""
    """The probe report applied, in words; empty: none given."""
    recipes: str = ""
    """How each layer's recipe was picked where the backend mixes several, in words; empty: one recipe."""

    def lines(self) -> list[str]:
        """The plan header's lines about the selection."""
        head = f"FP8 selection: {self.mode} ({self.why})"
        if self.mode == "auto":
            head += f"; a layer runs in FP8 where its predicted speedup over bf16 is >= {self.margin:g}"
        lines = [head]
        if self.step is not None:
            lines.append(f"predicted at {self.tokens:,} tokens per rank per micro-batch ({self.tokens_from}): the "
                         "GEMMs only, not a step time (benchmarks/speed_model/README.md)")
            lines.append(self.gemm_summary())
        elif self.unpredicted and self.asked == "all":  # otherwise ``why`` says it
            lines.append(f"FP8 speed not predicted: {self.unpredicted}")
        if self.numerics:
            lines.append(f"numerics: {self.numerics}")
        if self.recipes:
            lines.append(f"recipes: {self.recipes}")
        return lines

    def gemm_summary(self) -> str:
        """One line: the eligible layers' predicted GEMM time in bf16, as planned and all in FP8 (empty: none)."""
        s = self.step
        if s is None:
            return ""
        basis = ("compiled" if s.compile else "eager") + ("" if s.calibrated else ", uncalibrated")
        saved = 100 * s.saved_s / s.bf16_s if s.bf16_s else 0.0
        return (f"predicted GEMM time per micro-batch on {s.gpu_label} ({s.recipe}, {basis}; forward + backward, one "
                f"rank, {len(s.layers)} eligible GEMMs): bf16 {_ms(s.bf16_s)}, as planned {_ms(s.chosen_s)} (saves "
                f"{_ms(s.saved_s)}, {saved:.1f}%), every eligible layer in FP8 {_ms(s.all_fp8_s)}; "
                f"{100 * s.fp8_flop_share:.1f}% of their FLOPs in FP8")

    def to_dict(self) -> dict[str, Any]:
        """The selection and its predicted figures, JSON-ready."""
        out: dict[str, Any] = {"mode": self.mode, "why": self.why, "tokens": self.tokens,
                               "tokens_from": self.tokens_from, "margin": self.margin,
                               "unpredicted": self.unpredicted or None, "numerics": self.numerics or None,
                               "recipes": self.recipes or None}
        s = self.step
        if s is not None:
            out.update(gpu=s.gpu, recipe=s.recipe, compile=s.compile, calibrated=s.calibrated,
                       gemm_s={"bf16": s.bf16_s, "planned": s.chosen_s, "all_fp8": s.all_fp8_s, "saved": s.saved_s},
                       fp8_flop_share=s.fp8_flop_share,
                       layers=[_layer_dict(c) for c in s.layers])
        return out


def _layer_dict(choice: Any) -> dict[str, Any]:
    """One :class:`~fp8dist.plan.speed.step.LayerChoice` as :meth:`Selection.to_dict` writes it."""
    prediction = choice.prediction
    return {"name": choice.name, "speedup": prediction.speedup, "fp8": choice.fp8,
            "calibrated": prediction.calibrated, "recipe": prediction.recipe}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def speedup_of(predicted: Sequence[LinearPrediction]) -> float | None:
    """The predicted speedup of a module's GEMMs together (bf16 time over FP8 time); None without predictions."""
    return sum(p.bf16_s for p in predicted) / sum(p.fp8_s for p in predicted) if predicted else None


def describe_prediction(predicted: Sequence[LinearPrediction], tokens: int) -> str:
    """``predicted 1.21x on H100 at 8,192 tokens (rowwise)``; for a MoE experts module, its GEMMs together."""
    if len(predicted) == 1 and predicted[0].groups == 1:
        return predicted[0].describe()
    first = predicted[0]
    basis = "" if all(p.calibrated for p in predicted) else ", uncalibrated"
    return (f"predicted {speedup_of(predicted):.2f}x on {first.gpu_label} at {tokens:,} tokens ({first.recipe}, "
            f"{first.groups} experts, {first.m:,} routed rows{basis})")


@dataclass(frozen=True)
class _Context:
    """What predicting a module needs, found once per plan (``gpu``, ``recipe``: None where there is none)."""

    gpu: Any
    recipe: str | None
    tokens: int
    compile: bool
    cfg: Any
    hardware: Hardware
    backend: Any
    choices: tuple[str, ...] = ()  # the recipes picked among per layer; empty: one recipe
    predicted: dict = dataclasses.field(default_factory=dict, compare=False)
    """(recipe, GEMM shapes) -> _predict's answer: a model repeats a few shapes over all its layers."""


def _predict(module: nn.Module, ctx: _Context) -> tuple[tuple[LinearPrediction, ...], str]:
    """The module's predicted GEMMs (MoE experts: one per fused weight), or ((), why none)."""
    from ..fp8.conv1d import conv1d_dims, is_conv1d
    from ..fp8.moe import is_experts

    if is_experts(module):
        top_k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
        if not isinstance(top_k, int):
            return (), "the experts' top_k (config.num_experts_per_tok) is not known"
        recipe, why_not = ctx.backend.speed_recipe(ctx.cfg, ctx.hardware, grouped=True)
        if recipe is None:
            return (), why_not
        shapes = [(ctx.tokens * top_k, p.shape[2], p.shape[1], p.shape[0]) for p in module.parameters(recurse=False)]
    else:
        k, n = conv1d_dims(module) if is_conv1d(module) else (module.in_features, module.out_features)
        recipe, shapes = ctx.recipe or "", [(ctx.tokens, k, n, 1)]
    key = (recipe, tuple(shapes))
    if key not in ctx.predicted:
        try:
            ctx.predicted[key] = tuple(predict_linear(m, k, n, target=ctx.gpu, recipe=recipe, compile=ctx.compile,
                                                      groups=groups) for m, k, n, groups in shapes), ""
        except ValueError as error:
            ctx.predicted[key] = (), str(error)
    return ctx.predicted[key]


def _picked(module: nn.Module, ctx: _Context, grouped: bool) -> tuple[tuple[LinearPrediction, ...], str, str | None,
                                                                        str]:
    """Predictions, why none, and where recipes are picked per layer the fastest with the others' speedups."""
    if not ctx.choices or grouped:  # MoE experts keep their own recipe (torchao_moe_recipe)
        predicted, why_not = _predict(module, ctx) if ctx.gpu is not None and ctx.recipe else ((), "")
        return predicted, why_not, None, ""
    if ctx.gpu is None:
        return (), "", ctx.choices[0], ""
    tried = {r: _predict(module, dataclasses.replace(ctx, recipe=r)) for r in ctx.choices}
    ranked = sorted((r for r in tried if tried[r][0]), key=lambda r: -speedup_of(tried[r][0]))
    if not ranked:
        return (), "; ".join(dict.fromkeys(why for _, why in tried.values())), ctx.choices[0], ""
    others = ", ".join(f"{r} {speedup_of(tried[r][0]):.2f}x" for r in ranked[1:])
    return tried[ranked[0]][0], "", ranked[0], others


def _decided(entry: Any, module: nn.Module, ctx: _Context, mode: str, margin: float, verdicts: Verdicts | None,
             fallback: Callable[[nn.Module], str]) -> Any:
    """FP8 ``entry`` decided: kept out where predicted slower (auto) under every recipe, or measured unsafe."""
    predicted, why_not, recipe, others = _picked(module, ctx, entry.grouped)
    problems = verdicts.get(entry.name) if verdicts is not None else None
    speedup = speedup_of(predicted)
    kept = []
    if mode == "auto" and speedup is not None and speedup < margin:
        best = f" (the fastest of {', '.join(ctx.choices)}; {others})" if recipe and others else ""
        kept.append(f"FP8 {describe_prediction(predicted, ctx.tokens)}{best}")
    if problems:
        kept.append(f"FP8 unsafe: {'; '.join(problems)} (probe)")
    if kept:
        return dataclasses.replace(entry, precision=fallback(module), converted_to=None, reason="; ".join(kept),
                                   predicted=predicted, numerics=problems, high_precision_gather=None)
    reason = entry.reason
    if recipe is not None:  # the row names the recipe it runs and why that one
        reason += f"; recipe {recipe}" + (f", the fastest predicted (else {others})" if others else
                                          "" if predicted else f", the first of {', '.join(ctx.choices)}: "
                                          "nothing predicted to pick by")
    if predicted:
        reason += f"; {describe_prediction(predicted, ctx.tokens)}"
    elif mode == "auto":
        reason += f"; FP8 speed not predicted ({why_not}): converted as under fp8_select='all'"
    if verdicts is not None:
        reason += "; numerics ok (probe)" if problems == () else "; numerics not measured by the probe's report"
    return dataclasses.replace(entry, reason=reason, predicted=predicted, numerics=problems, recipe=recipe)


def select(model: nn.Module, entries: list[Any], cfg: Any, hardware: Hardware, *, compile: bool,
           numerics: Any = None, fallback: Callable[[nn.Module], str],
           facts: StrategyFacts) -> tuple[list[Any], Selection, list[str]]:
    """Decide which candidate layers run FP8 by ``cfg.precision.fp8_select`` and the ``numerics`` report.

    Call once every other rule of the plan has been applied and the hardware gate passed.

    Arguments: ``model`` the model being planned (read for shapes only); ``entries`` its
    :class:`~fp8dist.plan.precision.PlanEntry` list, FP8 candidates marked ``precision="fp8"``; ``cfg`` the resolved
    Config (``fp8_select``, ``fp8_select_margin``, the tokens per step); ``hardware`` the GPU the speed model
    predicts for; ``compile`` whether the blocks compile with FP8 (torchao's casts fuse, so they cost less);
    ``numerics`` a probe report (:func:`~fp8dist.numerics.measure_fp8_numerics`) whose flagged layers stay out,
    or None; ``fallback`` the precision of a module kept out; ``facts`` the strategy's facts (whether it gathers FP8
    weights).

    Returns ``(entries, selection, notes)``: the entries with each kept-out layer's precision and reason set (and
    its ``recipe`` where the backend mixes recipes), the :class:`Selection` with the per-layer figures, and the
    notes to say. Raises ValueError for a numerics report of another model."""
    from ..fp8 import get_backend

    backend = get_backend(cfg.precision.fp8)
    choices = backend.mixed_recipes(cfg, hardware, facts)
    mode, why, notes, gpu, recipe, unpredicted = _resolve(cfg, hardware, backend, choices)
    micro, seq = cfg.parallel.micro_batch_size, cfg.parallel.seq_len or DEFAULT_SEQ_LEN
    tokens, tokens_from = micro * seq, f"micro_batch_size {micro} x seq_len {seq}"
    if cfg.parallel.seq_len is None:
        tokens_from += ", assumed: pass seq_len= (--seq-len) for this run's"
    margin = cfg.precision.fp8_select_margin
    verdicts, said = (None, "") if numerics is None else numerics_verdicts(numerics, [e.name for e in entries],
                                                                           cfg.precision.fp8)
    ctx = _Context(gpu, recipe, tokens, compile, cfg, hardware, backend, choices)
    tail, said_tail = kept_tail(model, cfg, backend, hardware)
    notes += said_tail
    modules = dict(model.named_modules())  # one walk, not one get_submodule per entry
    out = []
    for e in entries:
        if e.precision != "fp8":
            out.append(e)
        elif e.name in tail:
            out.append(dataclasses.replace(e, precision=fallback(modules[e.name]), converted_to=None,
                                           reason=tail[e.name]))
        else:
            out.append(_decided(e, modules[e.name], ctx, mode, margin, verdicts, fallback))
    step = _step(model, out, gpu, recipe, compile, margin)
    if verdicts is not None:
        said += f"; {sum(1 for e in out if e.numerics)} of the plan's FP8 candidates measured unsafe, kept out of FP8"
    recipes = _mix_words(backend, choices, gpu) if choices else ""
    if choices and gpu is None:  # the one-recipe answer, not what a GPU plan would pick: said as a note too
        notes.append(recipes)
    return out, Selection(mode, why, tokens, tokens_from, margin, step, unpredicted="" if step else unpredicted,
                          asked=cfg.precision.fp8_select, numerics=said, recipes=recipes), notes


def _resolve(cfg: Any, hardware: Hardware, backend: Any,
             choices: tuple[str, ...]) -> tuple[str, str, list[str], Any, str | None, str]:
    """(mode, why, notes, GPU record, Linear recipe ("auto" with ``choices``), why nothing can be predicted)."""
    asked = cfg.precision.fp8_select
    on_gpu = hardware.type == "cuda"
    notes = []
    if asked == "all":
        mode, why = "all", "fp8_select='all', asked for"
    elif asked == "auto" and not on_gpu:
        mode, why = "all", f"fp8_select='auto' asked for, but {hardware} is not a GPU: all"
        notes.append(f"fp8_select='auto' on {hardware}: FP8 speed is predicted for CUDA GPUs only, so every eligible "
                     "layer converts as under fp8_select='all'. Plan for a GPU with target= (fp8dist plan --target "
                     "h100), or pass fp8_select='all'.")
    elif asked == "auto":
        mode, why = "auto", "fp8_select='auto', asked for"
    elif on_gpu:
        mode, why = "auto", f"the default where the plan's hardware is a GPU: {hardware}"
    else:
        mode, why = "all", f"the default on {hardware}: FP8 there is for numerics and tests, not speed"
    lookup = find_gpu(hardware)
    gpu, unpredicted = lookup.spec, lookup.reason
    if gpu is not None and not gpu.has_fp8:
        gpu, unpredicted = None, f"{gpu.label} has no FP8 tensor cores"
    recipe, no_model = ("auto", "") if choices else backend.speed_recipe(cfg, hardware)
    unpredicted = unpredicted or no_model
    if mode == "auto" and (gpu is None or recipe is None):
        mode, why = "all", f"{why}; but {unpredicted}: all"
        if asked == "auto":
            notes.append(f"fp8_select='auto' cannot predict here ({unpredicted}): every eligible layer converts as "
                         "under fp8_select='all'.")
    if mode == "all" and cfg.precision.fp8_select_margin != type(cfg.precision)().fp8_select_margin:
        notes.append(f"fp8_select_margin={cfg.precision.fp8_select_margin:g} has no effect: the selection is 'all' "
                     f"here ({why}).")
    return mode, why, notes, gpu, recipe, unpredicted


def _mix_words(backend: Any, choices: tuple[str, ...], gpu: Any) -> str:
    option = f"{backend.variant_option}='auto'"
    if gpu is None:
        return (f"{option}: no GPU to predict for, so every eligible layer runs {choices[0]} (the first of "
                f"{', '.join(choices)}); plan for a GPU (target=, --target h100) to pick per layer")
    return (f"{option}: each layer runs the recipe predicted fastest on {gpu.label} among {', '.join(choices)} (the "
            "recipes this backend mixes in one model), each row names its pick")


def _step(model: nn.Module, entries: list[Any], gpu: Any, recipe: str | None, compile: bool,
          margin: float) -> StepPrediction | None:
    """The plan's predicted GEMMs as decided (MoE experts: one per grouped GEMM, named by weight)."""
    layers = []
    for e in entries:
        if len(e.predicted) == 1:
            layers.append(LayerChoice(e.name, e.predicted[0], e.precision == "fp8"))
            continue
        weights = [name for name, _ in model.get_submodule(e.name).named_parameters(recurse=False)]
        layers += [LayerChoice(f"{e.name}[{w}]", p, e.precision == "fp8") for w, p in zip(weights, e.predicted)]
    if not layers:
        return None
    return StepPrediction(recipe or layers[0].prediction.recipe, gpu.key, gpu.label, compile, margin, tuple(layers))


def numerics_verdicts(report: Any, names: Sequence[str], backend: str | None = None) -> tuple[Verdicts, str]:
    """Per module, what the probe's ``report`` (a NumericsReport or its ``to_dict()``) found: ``()`` within every
    threshold, its problems, or None where its batches never ran it; and the report in words (saying so where it
    measured another backend than the plan's). TypeError: neither form; ValueError: it names modules ``names``
    lacks (another model's)."""
    given = type(report).__name__
    if not isinstance(report, Mapping) and callable(getattr(report, "to_dict", None)):
        report = report.to_dict()
    layers = report.get("layers") if isinstance(report, Mapping) else None
    if layers is None:
        raise TypeError(f"numerics={given}: pass the NumericsReport fp8dist.measure_fp8_numerics "
                        "returns, or the JSON fp8dist probe --json writes (as a dict).")
    gemms: dict[str, list[tuple[bool, tuple[str, ...]]]] = {}  # a MoE experts module has one per fused weight
    for layer in layers:
        gemms.setdefault(layer["name"], []).append((layer["calls"] > 0, tuple(layer["problems"])))
    verdicts: dict[str, tuple[str, ...] | None] = {}
    for name, found in gemms.items():
        problems = tuple(dict.fromkeys(p for ran, ps in found if ran for p in ps))
        verdicts[name] = problems if problems or all(ran for ran, _ in found) else None
    foreign = [n for n in verdicts if n not in set(names)]
    if foreign:
        shown = listing([repr(n) for n in foreign])
        raise ValueError(f"the numerics report names {plural(len(foreign), 'module')} this model does not have "
                         f"({shown}): it was measured on another model. Probe this model "
                         "(fp8dist.measure_fp8_numerics, or fp8dist probe --json FILE) and pass that report.")
    measured = report["backend"]
    said = f"probe report of {plural(len(verdicts), 'module')} ({measured}'s casts)"
    if backend is not None and measured != backend:
        said += f", not fp8={backend!r}'s: its verdicts may not hold for this backend's casts"
    return verdicts, said


def reduce_fallbacks(entries: list[Any], report: Any, cfg: Any) -> tuple[list[Any], list[str]]:
    """Under ``reduce_dtype="fp8"``: ``entries`` with ``reduce_fallback`` set on each module whose weight gradient
    the probe's ``report`` (a NumericsReport or its ``to_dict()``) found hurt by the FP8 blocks, and the notes to
    say (a report that did not measure the reduction, or measured another block size). ValueError: the report
    flags modules ``entries`` lack (another model's), or the strategy cannot reduce one layer's gradients apart from
    the others (its ``reduce_fallback_unit`` is None)."""
    from ..strategies import STRATEGIES

    data = report.to_dict() if not isinstance(report, Mapping) and callable(getattr(report, "to_dict", None)) \
        else report
    block, block_now = data.get("reduce_block"), cfg.parallel.reduce_fp8_block
    if block is None:
        return entries, ["reduce_dtype='fp8': the numerics report did not measure the FP8 gradient reduction, so "
                         "every gradient reduces in FP8; probe with reduce_dtype='fp8' for a verdict per layer"]
    notes = [] if block == block_now else [
        f"reduce_dtype='fp8': the numerics report measured FP8 gradient blocks of {block}, this run sends blocks of "
        f"{block_now}: its verdicts may not hold; probe with reduce_fp8_block={block_now}"]
    flagged = dict(data.get("reduce_fallback") or {})
    foreign = [name for name in flagged if name not in {e.name for e in entries}]
    if foreign:
        raise ValueError(f"the numerics report flags {plural(len(foreign), 'module')} for an fp32 gradient reduction "
                         f"that this model does not have ({listing([repr(n) for n in foreign])}): it was measured "
                         "on another model. Probe this model (fp8dist.measure_fp8_numerics, or fp8dist probe --json "
                         "FILE) and pass that report.")
    if not flagged:
        return entries, notes
    strategy = STRATEGIES[cfg.parallel.strategy]
    shown = "; ".join(f"{name}: {why}" for name, why in list(flagged.items())[:3])
    more = f"; and {len(flagged) - 3} more" if len(flagged) > 3 else ""
    if strategy.reduce_fallback_unit is None:
        raise ValueError(
            f"reduce_dtype='fp8' with strategy={strategy.name!r}: the numerics report flags "
            f"{plural(len(flagged), 'layer')} whose weight gradients the FP8 blocks hurt ({shown}{more}), and "
            f"{strategy.name} cannot reduce one layer's gradients in fp32 apart from the others. Use "
            "strategy='fsdp' or 'ddp' (they reduce those in fp32), or reduce_dtype='fp32', or probe with "
            "thresholds={'min_reduce_small_sqnr_db': ...} lower to send them in FP8 anyway.")
    reason = f"weight gradient reduced in fp32 with its {strategy.reduce_fallback_unit}: the FP8 blocks hurt it " \
             "({}; probe)"
    return [dataclasses.replace(e, reduce_fallback=reason.format(flagged[e.name])) if e.name in flagged else e
            for e in entries], notes


def with_read_options(cfg: Any, **values: Any) -> Any:
    """``cfg`` with the option ``values`` a job knows (``micro_batch_size``, ``seq_len``, ``fp8_select``), each set
    only where ``cfg`` reads it, so no run is told it has no effect. Call before ``wrap_model``. ValueError: a value
    the option does not take."""
    from ..config.rules import unread_options

    def changed(options: Mapping[str, Any]) -> Any:
        sections = {}
        for name in ("parallel", "precision"):
            section = getattr(cfg, name)
            sections[name] = dataclasses.replace(section, **{k: v for k, v in options.items() if hasattr(section, k)})
        return dataclasses.replace(cfg, **sections)

    unread = unread_options(changed(values))
    return changed({k: v for k, v in values.items() if k not in unread})
