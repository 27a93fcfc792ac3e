"""``fp8dist bench``'s settings, known before any engine is imported (a bad flag, a bad value and ``--help`` answer
without torch): :class:`BenchSettings`, a flag per field; the defaults per device type; the strategies each device
runs and each backend's variant options, from what the registries know of a value (a built-in's registered facts, a
registered object's attributes); a variant's values from the config's options."""

from __future__ import annotations

import argparse
import functools
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from ..config.options import SECTIONS, StrategyConfig
from ..config.rules import choices as config_choices
from ..config.schema import cli_flag, flat_fields, type_hints
from ..fp8 import BACKENDS
from ..strategies import STRATEGIES
from ..train.config import LLAMA_SIZES
from ..train.schedule import LR_SCHEDULES

__all__ = ["BenchSettings", "TextJob", "read_flags", "DEFAULTS", "TIMING_WARMUP", "NO_FP8_NAME",
           "default_strategies", "variant_backends", "variant_options", "variants_of"]

DEFAULTS = {"cpu": ("tiny,small", 10, 4, 128), "cuda": ("1b", 20, 4, 2048)}
"""The bench's defaults per device type: (model sizes, steps, batch per rank, sequence length); the
strategies are ``default_strategies(device type)``, the FP8 backends none and ``fp8dist train``'s default one where it
runs."""

TIMING_WARMUP = 2
"""Steps left out of the timing at the start (allocator, FSDP lazy init, DDP bucket rebuild at step 1)."""

NO_FP8_NAME = BACKENDS.reserved[0]
"""``fp8="none"``: no FP8 backend (the name the registry keeps from every backend), a bench cell in bf16."""


def default_strategies(device_type: str, *, installed: bool = True) -> tuple[str, ...]:
    """The strategies whose ``bench_devices`` name ``device_type`` (``installed``: only those installed; that
    imports each)."""
    return tuple(name for name in STRATEGIES if device_type in STRATEGIES.attribute(name, "bench_devices")
                 and not (installed and STRATEGIES[name].missing_reason()))


def variant_backends() -> list[str]:
    """The backends whose variants are cells of their own (flags ``--torchao-recipe``, ``--torchao-api``)."""
    return [name for name in BACKENDS if variants_of(name)]


def variant_options(fp8: str | None) -> tuple[str, ...]:
    """Backend ``fp8``'s options that are matrix dimensions: its ``variant_option``, then its
    ``more_variant_options``; () for none or a backend without variants."""
    if fp8 in (None, NO_FP8_NAME):
        return ()
    option = BACKENDS.attribute(fp8, "variant_option")
    return (option, *BACKENDS.attribute(fp8, "more_variant_options")) if option else ()


@functools.cache
def variants_of(fp8: str | None, option: str | None = None) -> tuple[str, ...]:
    """The config's choices of the backend's ``option`` (default: its ``variant_option``), the option's default
    first; () for a backend without one."""
    option = option or next(iter(variant_options(fp8)), None)
    if option is None:
        return ()
    default = next(f.default for section in SECTIONS.values() for _, f in flat_fields(section) if f.name == option)
    return (default, *(c for c in config_choices(option) if c != default))


def _default_fp8_cells(device_type: str) -> str:
    from ..train.job import default_fp8  # the backend that runs here: asked of the engines once the flags parse

    return ",".join(dict.fromkeys((NO_FP8_NAME, default_fp8() or NO_FP8_NAME)))


def _default_nproc(device_type: str) -> int:
    from ..train.job import default_nproc

    return default_nproc()


def _seeds(text: str) -> tuple[int, ...]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items or not all(t.isdigit() for t in items):
        raise ValueError(f"--seed {text!r}: give a non-negative integer or a comma-separated list, e.g. --seed 0,1,2.")
    return tuple(dict.fromkeys(int(t) for t in items))


@dataclass(frozen=True, kw_only=True)
class TextJob:
    """Real text a cell trains on and evaluates (named as :class:`fp8dist.train.job.TrainConfig`'s fields)."""

    data: tuple[str, ...]
    tokenizer: str
    text_field: str = "text"
    data_cache: str | None = None
    eval_every: int = 0
    """Held-out loss after every N steps and after the last (0: after the last only)."""
    eval_batches: int | None = None


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """The matrix and every cell's job; each field a flag of ``fp8dist bench``, its docstring the help. Metadata:
    ``choices`` and ``device`` (callables: the choices; the default on a device type), ``shown`` (that default in
    words; ``device`` is then asked only once the flags parse), ``min`` (least value, why), ``parse`` (flag to
    field), ``flag`` (its name; None: flags of its own)."""

    strategies: tuple[str, ...] = field(metadata={"choices": lambda: tuple(STRATEGIES), "device": lambda d: ",".join(
        default_strategies(d, installed=False))})
    """Sharding strategies, each where installed."""
    fp8: tuple[str | None, ...] = field(metadata={
        "choices": lambda: (NO_FP8_NAME, *BACKENDS),
        "parse": lambda items: tuple(None if f == NO_FP8_NAME else f for f in items),
        "device": _default_fp8_cells, "shown": "none and fp8dist train's default backend where it runs"})
    """FP8 backends; each FP8 cell also runs its bf16 (none) counterpart."""
    sizes: tuple[str, ...] = field(metadata={"choices": lambda: tuple(LLAMA_SIZES), "device": lambda d: DEFAULTS[d][0]})
    """Llama presets."""
    steps: int = field(metadata={"device": lambda d: DEFAULTS[d][1], "min": (
        TIMING_WARMUP + 2, f"{TIMING_WARMUP} warm-up steps, at least 1 timed step and 1 counted step")})
    """Steps per cell: warm-up steps, timed ones, then one counted (communication, model state) and not timed."""
    batch_size: int = field(metadata={"device": lambda d: DEFAULTS[d][2], "min": (1, "sequences per process")})
    """Sequences per process per step."""
    seq_len: int = field(metadata={"device": lambda d: DEFAULTS[d][3], "min": (2, "tokens per sequence")})
    """Tokens per sequence."""
    nproc: int = field(metadata={"device": _default_nproc, "min": (1, "processes"),
                                 "shown": "one per GPU, or 2 on CPU; a strategy without a process group always runs 1"})
    """Processes per cell."""
    zero_stage: int = field(default=2, metadata={"choices": lambda: config_choices("zero_stage")})
    """ZeRO stage of the cells whose strategy reads zero_stage."""
    compile: tuple[bool, ...] = field(default=(False,), metadata={
        "choices": lambda: ("off", "on"), "parse": lambda items: tuple(c == "on" for c in items)})
    """torch.compile each block: a matrix dimension."""
    activation_checkpointing: tuple[str, ...] = field(default=("none",), metadata={
        "choices": lambda: config_choices("activation_checkpointing")})
    """Activation checkpointing of each block: a matrix dimension."""
    memory: tuple[str, ...] = field(default=(StrategyConfig.memory,),
                                    metadata={"choices": lambda: config_choices("memory")})
    """The model-state memory level: a matrix dimension (a level's cells only where its strategy allows it)."""
    lr: float = 1e-3
    """AdamW's (peak) learning rate."""
    lr_schedule: str = field(default="constant", metadata={"choices": lambda: LR_SCHEDULES})
    """constant: --lr at every step; cosine: fp8dist train's schedule (fp8dist.train.schedule.lr_schedule), a
    linear warm-up over the first 10% of --steps, then a cosine decay toward 10% of --lr."""
    seeds: tuple[int, ...] = field(default=(0,), metadata={"flag": "seed", "parse": _seeds})
    """Model initialization and batch order seed, or comma-separated seeds: a matrix dimension."""
    raw: bool = True
    """The fp8dist-vs-hand-wired FSDP2 cells (the overhead ratio)."""
    variants: dict[str, tuple[str, ...]] = field(default_factory=dict, metadata={"flag": None})
    """Per backend variant option (torchao_recipe, torchao_api), its values (not given: its default)."""
    text: TextJob | None = field(default=None, metadata={"flag": None})
    """Real text every cell trains on and evaluates; None: the built-in grammar corpus."""


def read_flags(args: argparse.Namespace, device_type: str | None) -> dict[str, Any]:
    """:class:`BenchSettings`' fields as ``fp8dist bench``'s flags give them (``variants`` too, ``text`` aside): each
    value checked against its choices (a list item by item) or its ``min``, then read by its ``parse``; a flag not
    given takes its default on ``device_type`` (None: left out, and no engine is imported: the CLI checks the flags
    so before it imports one), else its field's own. ValueError names the flag, the bad value and the choices."""
    values, hints = {}, type_hints(BenchSettings)
    for f in fields(BenchSettings):
        meta, name = f.metadata, f.metadata.get("flag", f.name)
        value = getattr(args, f.name, None)
        if name is None or value is None and ("device" not in meta or device_type is None):
            continue
        value, flag = meta["device"](device_type) if value is None else value, cli_flag(name)
        choices = meta["choices"]() if "choices" in meta else None
        if choices and typing.get_origin(hints[f.name]) is tuple:  # the GPU default, where known without an engine
            example = meta["device"]("cuda") if "device" in meta and "shown" not in meta else ",".join(choices[:2])
            value = _split(flag, value, choices, example)
        elif choices:
            value = _one_of(flag, value, choices)
        if "min" in meta and value < meta["min"][0]:
            raise ValueError(f"{flag} {value}: needs at least {meta['min'][0]} ({meta['min'][1]}).")
        values[f.name] = meta["parse"](value) if "parse" in meta else value
    values["variants"] = {}
    for backend in variant_backends():
        for option in variant_options(backend):
            choices = variants_of(backend, option)
            values["variants"][option] = _split(cli_flag(option), getattr(args, option), choices, ",".join(choices[:2]))
    return values


def _split(flag: str, value: str, choices: tuple[str, ...], example: str) -> tuple[str, ...]:
    """A comma-separated flag value, every item checked against ``choices``; duplicates dropped."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ValueError(f"{flag} {value!r} is empty; give a comma-separated list, e.g. {flag} {example}.")
    for item in items:
        if item not in choices:
            raise ValueError(f"{flag}: {item!r} is not one of {', '.join(choices)} (comma-separated, e.g. "
                             f"{flag} {example}).")
    return tuple(dict.fromkeys(items))


def _one_of(flag: str, value: Any, choices: tuple[Any, ...]) -> Any:
    if value not in choices:
        raise ValueError(f"{flag} {value!r} is not one of {', '.join(map(str, choices))} (one value, e.g. {flag} "
                         f"{choices[-1]}).")
    return value
