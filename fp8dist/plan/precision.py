"""The precision plan: per module, FP8 (by which backend) or the strategy's mixed precision, and why. Decided before
any conversion, nothing converted that it does not list as FP8; ``fp8dist.get_plan(model)`` returns it."""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from ..config.text import listing, plural
from ..config.axis import StrategyFacts
from ..config.resolve import Config
from .coverage import MIN_FP8_SHARE, coverage, gemm_flops, runs_gemm
from ..runtime.adapters import adapter_reasons, idle_copies, weight_readers
from ..runtime.hardware import Hardware, hardware_of
from ..memory_levels import get_level
from .selection import Selection, select, speedup_of
from ..fp8.order import model_structure, per_structure
from .speed import LinearPrediction

__all__ = ["PlanEntry", "PrecisionPlan", "plan_precision", "check_fp8_available", "FP8UnavailableError",
           "compile_decision"]

FP8Filter = Callable[[nn.Module, str], bool]
"""``wrap_model``'s and :func:`plan_precision`'s ``fp8_filter``: called as ``fp8_filter(module, fqn)`` for each layer
the backend supports and ``fp8_exclude`` leaves in; True lets it convert, False keeps it in the strategy's precision
(anything but a bool raises TypeError)."""


class FP8UnavailableError(RuntimeError):
    """The FP8 backend is not installed or the hardware has no FP8 (the message says which and the way out)."""


@dataclass(frozen=True)
class PlanEntry:
    """One module's decision: whether it runs in FP8 and why (a row of the printed plan)."""

    name: str
    """The module's name, as ``named_modules`` gives it on the model planned."""
    module_type: str
    """Class name before conversion."""
    precision: str
    """"fp8", or the fallback's "bf16" / "fp16" / "fp32"."""
    reason: str
    """Why, in words: the backend converts it (with the figure that decided), or the rule that kept it out."""
    converted_to: str | None
    """The backend's class that replaces it (a TE norm is swapped without computing in FP8), or None."""
    params: int
    """Parameters the module holds itself."""
    gemm_flops: int = 0
    """Estimated forward GEMM FLOPs per token: 2 x params (x top_k / experts for MoE experts), 0 without a GEMM."""
    grouped: bool = False
    """A MoE experts module (fused 3-D weights): in FP8 it runs grouped GEMMs, whose weights keep no scale between
    steps and are all-gathered in the strategy's dtype."""
    predicted: tuple[LinearPrediction, ...] = ()
    """Speed-model figures on the plan's GPU and tokens, one per GEMM weight; empty: not a candidate, or no GPU."""
    numerics: tuple[str, ...] | None = None
    """The probe's verdict: () within its thresholds, else those crossed (kept out of FP8); None: not measured."""
    recipe: str | None = None
    """The recipe picked for this layer (predicted fastest) where the backend mixes several; None: its one recipe."""
    high_precision_gather: str | None = None
    """Why this FP8 layer's weight is all-gathered in the strategy's dtype where the backend gathers FP8 weights in FP8
    (a PEFT DoRA base: DoRA's weight norm reads the gathered weight); None: gathered as the backend's other layers."""
    runs: bool = True
    """False: a module PEFT holds that does not run with its adapters as set (a ``modules_to_save`` original, an
    inactive adapter: :func:`~fp8dist.runtime.adapters.idle_copies`): not converted, not counted in the FP8 share."""
    reduce_fallback: str | None = None
    """Under ``reduce_dtype="fp8"``: why this module's weight gradient is reduced in fp32, not FP8 (the numerics
    probe's verdict: the FP8 blocks hurt it; FSDP2 reduces the whole unit holding it in fp32); None: as the
    strategy's other gradients."""

    @property
    def speedup(self) -> float | None:
        """Predicted FP8 speedup over bf16 of the module's GEMMs together (None: not predicted)."""
        return speedup_of(self.predicted)

    def to_dict(self) -> dict[str, Any]:
        """The decision as JSON data (``fp8dist plan --json``): every field but the per-GEMM ``predicted`` figures,
        which become ``speedup`` (their product's ratio, None where not predicted)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "predicted"}
        out["numerics"] = list(self.numerics) if self.numerics is not None else None
        return {**out, "speedup": self.speedup}


def compile_decision(compile: bool | None, fp8: str | None, converted: bool, device: torch.device | Hardware,
                     refusal: str | None) -> tuple[bool, str]:
    """Whether blocks are compiled, and why: ``compile`` as asked (True / False) wins; auto (None) compiles only on
    CUDA with FP8 layers (``converted``) of backend ``fp8``; ``refusal`` (the combination table's, for this config)
    turns auto off. ``device``: the plan's device or hardware."""
    if compile is not None:
        return compile, "asked for" if compile else "turned off"
    if refusal is not None:
        return False, f"auto: off ({refusal})"
    if device.type != "cuda":
        return False, f"auto: off on {device.type} (compiling costs more than it saves there)"
    if not converted:
        return False, "auto: off without FP8 layers (compile=True turns it on)"
    return True, f"auto: on ({fp8} FP8 on CUDA: compiled blocks fuse the casts and scaling)"


def _fallback_precision(module: nn.Module, cfg: Config, facts: StrategyFacts) -> str:
    """A non-FP8 layer's dtype: param_dtype where the engine casts parameters or autocast its matmul; else fp32."""
    return cfg.parallel.param_dtype if not facts.autocast_forward or runs_gemm(module) else "fp32"


class PrecisionPlan(Sequence[PlanEntry]):
    """The list of :class:`PlanEntry` for every module that holds parameters, in model order, with what was planned
    around them; :func:`plan_precision` makes it, :func:`fp8dist.get_plan` reads it off a wrapped model, ``print``
    shows it as a table."""

    def __init__(self, entries: list[PlanEntry], *, backend: str | None, strategy: str, detail: str = "",
                 unavailable: str | None = None, notes: Sequence[str] = (),
                 blocks: tuple[str, bool, str] = ("none", False, ""), memory: str,
                 hardware: Hardware = Hardware("cpu"), facts: StrategyFacts = StrategyFacts(),
                 selection: Selection | None = None) -> None:
        self._entries = entries
        self.selection = selection
        """How the FP8 candidates were chosen and their predicted GEMM time; None without an FP8 backend that runs."""
        self.hardware = hardware
        """The machine planned for: the training device, or a named target."""
        self.facts = facts
        """What the strategy does to parameters: the backends read these, never the strategy's name."""
        self.backend = backend
        """The FP8 backend asked for (``fp8=``), or None: no FP8."""
        self.strategy = strategy
        """The strategy's name (``strategy=``)."""
        self.detail = detail
        """What the backend runs (its recipe, from ``FP8Backend.describe``), or ``"fallback: <why>"`` where it
        cannot run here; "" without FP8."""
        self.memory = memory
        """The model-state memory level (``memory=``): standard, or lean (bf16 weights, 8-bit AdamW states)."""
        self.unavailable = unavailable
        """Why the backend cannot run here, when the plan fell back to the strategy's precision (None: it runs)."""
        self.notes = tuple(notes)
        """What the user should know of the plan (unmatched ``fp8_exclude`` patterns, layers gathered in high
        precision, a numerics report's effects); ``wrap_model`` warns of each once, on rank 0."""
        self.activation_checkpointing, self.compile, self.compile_reason = blocks
        """Per block: activation checkpointing mode, whether compiled, and why (:mod:`fp8dist.pipeline.blocks`)."""
        self.coverage = coverage(entries) if backend else None
        """The share of GEMM parameters and FLOPs in FP8 (None without an FP8 backend)."""

    def low_coverage_warning(self) -> str | None:
        """``wrap_model``'s warning where a backend runs and converts less than :data:`MIN_FP8_SHARE` of the GEMM
        parameters, or nothing; None otherwise."""
        c = self.coverage
        if c is None or self.unavailable or not c.low or not c.gemm_params:
            return None
        kept = "; ".join(f"{plural(n, 'module')} / {params:,} params: {reason}" for reason, n, params in c.kept[:4])
        more = f"; and {len(c.kept) - 4} more reasons" if len(c.kept) > 4 else ""
        return (f"fp8={self.backend!r} runs {c.fp8_modules} of {c.gemm_modules} GEMM modules in FP8: {c.fp8_params:,} "
                f"of {c.gemm_params:,} GEMM params ({100 * c.param_share:.1f}%, below {100 * MIN_FP8_SHARE:.0f}%), "
                f"{100 * c.flop_share:.1f}% of the estimated GEMM FLOPs. Kept in high precision: {kept}{more}. "
                "print(fp8dist.get_plan(model)) shows every module; FP8 casts cost time where little runs in FP8.")

    def __getitem__(self, index):
        return self._entries[index]

    def __len__(self) -> int:
        return len(self._entries)

    def by_name(self, name: str) -> PlanEntry:
        """The entry of the module named ``name`` (as ``named_modules`` names it on the model planned); KeyError
        naming it where the plan has none."""
        for entry in self._entries:
            if entry.name == name:
                return entry
        raise KeyError(f"no module {name!r} in the plan")

    @property
    def converted(self) -> list[PlanEntry]:
        """Entries the backend replaces (FP8 GEMMs, and TE's norms)."""
        return [e for e in self._entries if e.converted_to is not None]

    @property
    def fp8(self) -> list[PlanEntry]:
        """The entries planned in FP8, in the model's module order."""
        return [e for e in self._entries if e.precision == "fp8"]

    def counts(self) -> str:
        """One line: FP8 and fallback layers and parameters of the modules that run, and those that do not."""
        running, idle = [e for e in self._entries if e.runs], [e for e in self._entries if not e.runs]
        fp8, rest = self.fp8, [e for e in running if e.precision != "fp8"]
        fp8_params, total = sum(e.params for e in fp8), sum(e.params for e in running) or 1
        idle_words = f", not run {plural(len(idle), 'layer')} / {sum(e.params for e in idle):,} params" if idle else ""
        return (f"FP8 {plural(len(fp8), 'layer')} / {fp8_params:,} params ({100 * fp8_params / total:.1f}%), "
                f"fallback {plural(len(rest), 'layer')} / {sum(e.params for e in rest):,} params{idle_words}")

    def __str__(self) -> str:
        summary = get_level(self.memory).summary
        level = f", memory={self.memory} ({summary})" if summary else ""
        head = (f"precision plan: fp8={self.backend or 'none'}{' (' + self.detail + ')' if self.detail else ''}, "
                f"strategy={self.strategy}{level} -- {self.counts()}")
        rows = [("module", "type", "precision", "converted to", "reason")]
        for e in self._entries:
            reason = e.reason + (f"; {e.reduce_fallback}" if e.reduce_fallback else "")
            rows.append((e.name, e.module_type, e.precision, e.converted_to or "-", reason))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        blocks = (f"blocks: activation checkpointing {self.activation_checkpointing}, compile "
                  f"{'on' if self.compile else 'off'} ({self.compile_reason})")
        lines = [head] + ([self.coverage.summary()] if self.coverage else [])
        lines += (self.selection.lines() if self.selection else []) + [blocks]
        lines += [f"note: {note}" for note in self.notes]
        for i, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"PrecisionPlan(backend={self.backend!r}, strategy={self.strategy!r}, {self.counts()})"


def check_fp8_available(cfg: Config, device: torch.device | Hardware, *, check_installed: bool = True) -> str | None:
    """Why the configured FP8 backend cannot run on ``device`` (None when it can, or without FP8).
    ``check_installed=False`` asks only about the hardware (planning for another machine). Raises
    FP8UnavailableError where it cannot and ``on_unsupported`` is "error" (the default)."""
    fp8 = cfg.precision.fp8
    gate = _backend(cfg).unavailable_reason(cfg, device, check_installed=check_installed) if fp8 else None
    if gate and cfg.precision.on_unsupported == "error":
        where = "here" if check_installed else "on the target"
        raise FP8UnavailableError(
            f"fp8={fp8!r} cannot run {where}: {gate}. Pass on_unsupported='fallback' to train in the strategy's "
            f"{cfg.parallel.param_dtype} mixed precision instead, or choose another backend (fp8='torchao' runs on "
            "CPU and CUDA sm_89+).")
    return gate


def plan_precision(model: nn.Module, cfg: Config, *, device: torch.device | Hardware, world_size: int = 1,
                   fp8_filter: FP8Filter | None = None, check_hardware: bool = True, check_installed: bool = True,
                   numerics: Any = None) -> PrecisionPlan:
    """Decide per module whether it runs in FP8, and why. Call before conversion and sharding. A pure function of
    the model, the config, the hardware and the world size: it reads no environment variable and no process group.

    Args:
        model: the unwrapped model.
        cfg: the resolved config (backend and knobs, mixed precision, ``fp8_select``, tokens per rank).
        device: where the model will run, or a :class:`~fp8dist.runtime.hardware.Hardware` to plan for another machine
            (``fp8dist plan --target h100``): the hardware gate, the MoE experts' recipe and the speed prediction.
        world_size: the ranks the model will be sharded over (how evenly each FP8 weight shards).
        fp8_filter: ``(module, fqn) -> bool``; False keeps the module out of FP8.
        check_hardware: False plans as if the backend and FP8 hardware were present (``--ignore-hardware``).
        check_installed: False plans as if the backend were installed, the hardware still checked (``--target``).
        numerics: a probe's report of this model (:func:`fp8dist.measure_fp8_numerics`'s, or the dict of
            ``fp8dist probe --json``): layers past its thresholds stay out of FP8; under ``reduce_dtype="fp8"``,
            layers whose weight gradients its FP8 blocks hurt reduce in fp32 (``PlanEntry.reduce_fallback``).
            Typed Any: the numerics package imports this module.

    Raises:
        FP8UnavailableError: backend missing / no FP8 hardware, unless ``on_unsupported="fallback"``.
        ValueError: a bad world size, a numerics report of another model, or one that flags layers for an fp32
            reduction under a strategy that reduces every gradient alike (DDP's FP8 comm hook).
    """
    from ..config.rules import facts_of, refusing_rule
    from .selection import reduce_fallbacks
    from ..strategies import STRATEGIES

    if fp8_filter is not None and not callable(fp8_filter):
        raise TypeError(f"fp8_filter={fp8_filter!r} is not callable: pass a function (module, fqn) -> bool, or "
                        "fp8_exclude=[patterns] to keep modules out of FP8 by name.")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer (the ranks the model is sharded over).")
    STRATEGIES[cfg.parallel.strategy].check_launch(cfg, world_size)  # HSDP groups that do not divide the world
    fp8 = cfg.precision.fp8
    hardware, facts = hardware_of(device), facts_of(cfg, world_size)
    gate = check_fp8_available(cfg, hardware, check_installed=check_installed) if check_hardware else None
    entries = _entries(model, cfg, hardware, facts, world_size, gate, fp8_filter)
    refusal = refusing_rule(cfg, compile=True)
    refused = refusal and refusal.reason
    selection, notes = None, []
    if fp8 and not gate:  # FP8 runs: the candidates are chosen by predicted speed and measured numerics
        compiles_with_fp8, _ = compile_decision(cfg.parallel.compile, fp8, True, hardware, refused)
        entries, selection, notes = select(model, entries, cfg, hardware, compile=compiles_with_fp8,
                                           numerics=numerics, facts=facts,
                                           fallback=lambda m: _fallback_precision(m, cfg, facts))
    if numerics is not None and cfg.parallel.reduce_dtype == "fp8":  # the probe's verdict on the FP8 reduction
        entries, said = reduce_fallbacks(entries, numerics, cfg)
        notes = [*notes, *said]
    detail = f"fallback: {gate}" if gate else _backend(cfg).describe(cfg, facts) if fp8 else ""
    compiled, why = compile_decision(cfg.parallel.compile, fp8, any(e.converted_to for e in entries), hardware, refused)
    if fp8:
        notes = [*_unmatched_excludes(cfg, [e.name for e in entries]), *_unread_moe_recipe(cfg, entries),
                 *_gathers_in_high_precision(cfg, entries), *notes]
    return PrecisionPlan(entries, backend=fp8, strategy=cfg.parallel.strategy, detail=detail, unavailable=gate,
                         notes=notes, blocks=(cfg.parallel.activation_checkpointing, compiled, why),
                         memory=cfg.parallel.memory, hardware=hardware, facts=facts, selection=selection)


def _backend(cfg: Config) -> Any:
    """The configured backend; None for :data:`~fp8dist.fp8.NO_FP8`."""
    from ..fp8 import NO_FP8, get_backend

    backend = get_backend(cfg.precision.fp8)
    return None if backend is NO_FP8 else backend


def _entries(model: nn.Module, cfg: Config, hardware: Hardware, facts: StrategyFacts, world_size: int,
             gate: str | None, fp8_filter: FP8Filter | None) -> list[PlanEntry]:
    """Every module that holds parameters, FP8 where the backend converts it (before the selection)."""
    from ..strategies import STRATEGIES

    backend, fp8 = _backend(cfg), cfg.precision.fp8
    others = {n: s.facts(cfg, world_size) for n, s in STRATEGIES.items() if n != cfg.parallel.strategy}
    structure, modules, peft = _static_facts(model)
    # which adapters are active may change between plans of one structure: asked afresh of a PEFT model
    adapters = adapter_reasons(model) if peft else {}
    idle = idle_copies(model) if peft else {}
    readers = weight_readers(model) if peft else {}
    # a PEFT adapter's own reason wins over a backend's model rule (a LoRA B is often the last Linear to run)
    reserved = {**(_model_exclusions(backend, model, cfg, structure) if backend else {}), **adapters}
    entries = []  # idle copies never run: no rule of the backend's applies
    for name, module, params, grouped, flops in modules:
        reason = idle.get(name) or _decide(backend, module, name, cfg, hardware, facts, gate, reserved,
                                           fp8_filter, others)
        precision = _fallback_precision(module, cfg, facts)
        target = None
        gather = None
        if reason is None:
            target = backend.converted_class(module, cfg, hardware)
            if backend.computes_in_fp8(module):
                frozen = not any(p.requires_grad for p in module.parameters(recurse=False))
                precision, reason = "fp8", f"converted by {fp8}" + ("; frozen weight" if frozen else "")
                gather = backend.read_weight_gather(readers[name], cfg, facts) if name in readers else None
                reason += f"; {gather}" if gather else ""
            else:
                reason = f"swapped for {target}; norms do not compute in FP8"
        entries.append(PlanEntry(name, type(module).__name__, precision, reason, target, params, flops, grouped,
                                 high_precision_gather=gather, runs=name not in idle))
    return entries


def _static_facts(model: nn.Module) -> tuple[tuple, list[tuple[str, nn.Module, int, bool, int]], bool]:
    """(the structure of ``model``, (name, module, parameters, fused experts, GEMM FLOPs per token) of each module
    that holds parameters, whether it holds PEFT tuner layers or ``modules_to_save`` wrappers): walked once per
    structure of the model (a planner re-plans one model per way out and rank count)."""
    structure = model_structure(model)
    facts, peft = per_structure(model, "modules", lambda: _walk(model), structure)
    return structure, [(name, model.get_submodule(name), *rest) for name, *rest in facts], peft


def _walk(model: nn.Module) -> tuple[list[tuple[str, int, bool, int]], bool]:
    """By name, not module: the cache's value must not hold the model (its weak key) through a module (an FSDP2
    unit's state reaches the root's)."""
    from ..fp8.moe import is_experts

    modules, peft = [], False
    for name, module in model.named_modules():
        params = sum(p.numel() for p in module.parameters(recurse=False))
        if params:
            grouped = is_experts(module)
            modules.append((name, params, grouped, gemm_flops(module, params, grouped)))
        peft = peft or isinstance(getattr(module, "base_layer", None), nn.Module) \
            or isinstance(getattr(module, "modules_to_save", None), nn.ModuleDict)
    return modules, peft


def _model_exclusions(backend: Any, model: nn.Module, cfg: Config, structure: tuple) -> dict[str, str]:
    """``backend.model_exclusions(model, cfg)`` (torchao's first/last Linear rule runs a meta forward), computed once
    per structure of ``model`` and precision config."""
    return dict(per_structure(model, ("exclusions", backend.name, repr(cfg.precision)),
                              lambda: backend.model_exclusions(model, cfg), structure))


def _unread_moe_recipe(cfg: Config, entries: list[PlanEntry]) -> list[str]:
    default = type(cfg.precision)().torchao_moe_recipe
    if cfg.precision.torchao_moe_recipe == default or any(e.grouped for e in entries):
        return []
    return [f"torchao_moe_recipe={cfg.precision.torchao_moe_recipe!r} has no effect: the model has no MoE experts "
            "module (fused 3-D expert weights) for it to convert"]


def _gathers_in_high_precision(cfg: Config, entries: list[PlanEntry]) -> list[str]:
    """Where fp8_all_gather=True was asked for and FP8 layers gather in high precision all the same (DoRA bases)."""
    kept = [e for e in entries if e.precision == "fp8" and e.high_precision_gather]
    if not kept or cfg.precision.fp8_all_gather is not True:
        return []
    names = listing([e.name for e in kept])
    return [f"fp8_all_gather=True is not followed by {plural(len(kept), 'FP8 layer')} ({names}): "
            f"{kept[0].high_precision_gather}; the other FP8 layers gather in FP8 (leave fp8_all_gather unset for the "
            "same without this note)"]


def _unmatched_excludes(cfg: Config, names: list[str]) -> list[str]:
    notes = []
    for pattern in cfg.precision.fp8_exclude:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            container = any(name.startswith(pattern + ".") for name in names)
            close = difflib.get_close_matches(pattern, names, n=1)
            hint = (f"; to exclude the layers inside {pattern!r}, use {pattern + '.*'!r}" if container else
                    f"; did you mean {close[0]!r}?" if close else
                    "; patterns are fnmatch patterns on full module names, e.g. 'lm_head' or '*.mlp.*'")
            notes.append(f"fp8_exclude pattern {pattern!r} matches no module that holds parameters{hint}")
    return notes


def _decide(backend, module: nn.Module, name: str, cfg: Config, hardware: Hardware, facts: StrategyFacts,
            gate: str | None, reserved: dict[str, str], fp8_filter: FP8Filter | None,
            others: dict[str, StrategyFacts]) -> str | None:
    """None when the module converts; else the reason it keeps the strategy's precision."""
    if backend is None:
        return "fp8 off: strategy mixed precision"
    if gate:
        return f"no FP8 here ({gate}); on_unsupported='fallback'"
    if not backend.supports(module):  # the backend's model rule may say why more precisely (a MoE router)
        return reserved.get(name) or f"{type(module).__name__} is not converted by {backend.name}"
    for pattern in cfg.precision.fp8_exclude:
        if fnmatch.fnmatchcase(name, pattern):
            return f"matches fp8_exclude {pattern!r}"
    keep = True if fp8_filter is None else fp8_filter(module, name)
    if not isinstance(keep, bool):
        raise TypeError(f"fp8_filter returned {keep!r} ({type(keep).__name__}) for {name!r}: it must return True "
                        "(convert to FP8) or False (keep the strategy's precision), e.g. lambda module, fqn: "
                        "fqn != 'lm_head'.")
    if not keep:
        return "excluded by fp8_filter"
    if name in reserved:
        return reserved[name]
    reason = backend.ineligible_reason(module, name, cfg, hardware, facts)
    if reason is None:
        return None
    # a layer kept out by what the strategy does to parameters: the strategies under which it would convert
    converts = [n for n, f in others.items() if backend.ineligible_reason(module, name, cfg, hardware, f) is None]
    if not converts:
        return reason
    shown = ", ".join(repr(n) for n in converts[:-1]) + (" or " if len(converts) > 1 else "") + repr(converts[-1])
    return f"{reason}; strategy={shown} runs it in FP8"
