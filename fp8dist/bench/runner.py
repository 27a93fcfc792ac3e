"""``fp8dist bench``'s matrix: the flags read into :class:`BenchSettings`, the cells planned and checked before any
process starts (on a GPU against the memory estimate, :mod:`.fits`), then each cell run in fresh processes."""

from __future__ import annotations

import argparse
import importlib
import itertools
import logging
import sys
import tempfile
import typing
import uuid
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..config.schema import cli_flag, type_hints
from ..config.text import plural
from ..config.rules import choices as config_choices, refusal_of
from ..fp8 import BACKENDS, NO_FP8, get_backend
from ..memory_levels import STANDARD
from ..strategies import STRATEGIES, get_strategy
from ..train.job import default_fp8, default_nproc
from ..train.config import LLAMA_SIZES
from ..train.schedule import LR_SCHEDULES
from .cell import TIMING_WARMUP, Cell, TextJob, cell_options, cell_world, variants_of

__all__ = ["BenchSettings", "resolve_settings", "plan_cells", "check_cells", "check_text", "run_cells", "device_type",
           "variant_backends", "variant_options", "default_strategies", "DEFAULTS"]

# defaults per device type: (sizes, steps, batch per rank, sequence length); the strategies are
# default_strategies(device type), the FP8 backends none and fp8dist train's default one where it runs
DEFAULTS = {"cpu": ("tiny,small", 10, 4, 128), "cuda": ("1b", 20, 4, 2048)}


def default_strategies(device_type: str, *, installed: bool = True) -> tuple[str, ...]:
    """The strategies whose ``bench_devices`` name ``device_type`` (``installed``: only those installed)."""
    return tuple(name for name, s in STRATEGIES.items()
                 if device_type in s.bench_devices and not (installed and s.missing_reason()))


def variant_backends() -> list[str]:
    """The backends whose variants are cells of their own (flags ``--torchao-recipe``, ``--torchao-api``)."""
    return [name for name in BACKENDS if variants_of(name)]


def variant_options(fp8: str | None) -> tuple[str, ...]:
    """Backend ``fp8``'s options that are matrix dimensions: its variant option, then its further ones."""
    backend = get_backend(fp8)
    return (backend.variant_option, *backend.more_variant_options) if backend.variant_option else ()


def _seeds(text: str) -> tuple[int, ...]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items or not all(t.isdigit() for t in items):
        raise ValueError(f"--seed {text!r}: give a non-negative integer or a comma-separated list, e.g. --seed 0,1,2.")
    return tuple(dict.fromkeys(int(t) for t in items))


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """The matrix and every cell's job; each field a flag of ``fp8dist bench``, its docstring the help. Metadata:
    ``choices`` and ``device`` (callables: the choices; the default on a device type), ``shown`` (that default in
    words), ``min`` (least value, why), ``parse`` (flag to field), ``flag`` (its name; None: flags of its own)."""

    strategies: tuple[str, ...] = field(metadata={"choices": lambda: tuple(STRATEGIES), "device": lambda d: ",".join(
        default_strategies(d, installed=False))})
    """Sharding strategies, each where installed."""
    fp8: tuple[str | None, ...] = field(metadata={
        "choices": lambda: (NO_FP8.name, *BACKENDS),
        "parse": lambda items: tuple(None if f == NO_FP8.name else f for f in items),
        "device": lambda d: ",".join(dict.fromkeys((NO_FP8.name, default_fp8() or NO_FP8.name))),
        "shown": "none and fp8dist train's default backend where it runs"})
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
    nproc: int = field(metadata={"device": lambda d: default_nproc(), "min": (1, "processes"),
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
    memory: tuple[str, ...] = field(default=(STANDARD.name,), metadata={"choices": lambda: config_choices("memory")})
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


def device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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


def _given(args: argparse.Namespace, device_type: str) -> dict[str, Any]:
    """Each flag's value as given, else its device default, checked against its choices (a list item by item) or
    its ``min``, then read by its ``parse``; a field's own default is left to it."""
    values, hints = {}, type_hints(BenchSettings)
    for f in fields(BenchSettings):
        meta, name = f.metadata, f.metadata.get("flag", f.name)
        value = getattr(args, f.name, None)
        if name is None or value is None and "device" not in meta:
            continue
        value, flag = meta["device"](device_type) if value is None else value, cli_flag(name)
        choices = meta["choices"]() if "choices" in meta else None
        if choices and typing.get_origin(hints[f.name]) is tuple:
            example = meta["device"]("cuda") if "device" in meta else ",".join(choices[:2])
            value = _split(flag, value, choices, example)
        elif choices:
            value = _one_of(flag, value, choices)
        if "min" in meta and value < meta["min"][0]:
            raise ValueError(f"{flag} {value}: needs at least {meta['min'][0]} ({meta['min'][1]}).")
        values[f.name] = meta["parse"](value) if "parse" in meta else value
    return values


def resolve_settings(args: argparse.Namespace, device_type: str) -> BenchSettings:
    """The command line's settings with the device's defaults filled in; ValueError names a bad value."""
    from ..train.data import make_corpus

    settings = BenchSettings(**_given(args, device_type), variants=_variant_settings(args), text=_text_job(args))
    corpus = len(make_corpus())
    if settings.text is None and settings.seq_len >= corpus:
        raise ValueError(f"--seq-len {settings.seq_len} is longer than the built-in corpus ({corpus} bytes); "
                         f"use at most {corpus - 1}.")
    if settings.lr <= 0:
        raise ValueError(f"--lr {settings.lr}: must be positive.")
    for note in _unread_flags(settings):  # the one rule: an option no cell reads is said
        warnings.warn(note, UserWarning, stacklevel=2)
    return settings


def _unread_flags(settings: BenchSettings) -> list[str]:
    """A note for each matrix option given away from its default that no cell reads: a backend's variant without
    that backend in ``--fp8`` (``--torchao-api weight_wrapper --fp8 none``), ``--zero-stage`` without a strategy
    that reads it."""
    notes, matrix = [], ",".join(f or NO_FP8.name for f in settings.fp8)
    for name in (n for n in variant_backends() if n not in settings.fp8):
        for option in variant_options(name):
            values = settings.variants.get(option, ())
            if values and values != variants_of(name, option)[:1]:
                notes.append(f"{cli_flag(option)} {','.join(values)} has no effect here: only the fp8 {name} cells "
                             f"read it, and --fp8 {matrix} has none; add {name} to --fp8.")
    readers = [s for s in STRATEGIES if "zero_stage" in get_strategy(s).options]
    if settings.zero_stage != BenchSettings.__dataclass_fields__["zero_stage"].default and \
            not set(readers) & set(settings.strategies):
        notes.append(f"--zero-stage {settings.zero_stage} has no effect here: only the {', '.join(readers)} cells "
                     f"read it, and --strategies {','.join(settings.strategies)} has none; add "
                     f"{readers[0] if len(readers) == 1 else 'one of them'} to --strategies.")
    return notes


def _variant_settings(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    out = {}
    for name in variant_backends():
        for option in variant_options(name):
            values = variants_of(name, option)
            out[option] = _split(cli_flag(option), getattr(args, option), values, ",".join(values[:2]))
    return out


def _text_job(args: argparse.Namespace) -> TextJob | None:
    """``--data`` and its options (``fp8dist train``'s flags, validated as there); None without ``--data``."""
    from ..train.data.job import job_tokenizer
    from ..train.config import TrainConfig

    names = [f.name for f in fields(TextJob)]
    job = TrainConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})
    tokenizer = job_tokenizer(job.data, job.tokenizer, None)
    if tokenizer is None:
        return None
    return TextJob(**{**{name: getattr(job, name) for name in names}, "tokenizer": tokenizer})


def check_text(settings: BenchSettings) -> str:
    """Tokenize the cells' text once here (the cells read the token cache) and check it holds a global batch and
    the held-out batches; returns the corpus in a line ("" without text). ValueError: a bad file or tokenizer, a
    corpus too short."""
    from ..train.data.job import JobBatches, load_job_corpus

    if settings.text is None:
        return ""
    corpus = load_job_corpus(settings.text, None)
    batches = JobBatches(corpus, batch_size=settings.batch_size * settings.nproc, seq_len=settings.seq_len, seed=0,
                         world_size=settings.nproc, eval_batches=settings.text.eval_batches)
    return batches.describe()


def plan_cells(settings: BenchSettings) -> list[Cell]:
    """The cells in run order: per size and strategy the bf16 cell, its FP8 cells; then the hand-wired twins."""
    job = dict(steps=settings.steps, batch_size=settings.batch_size, seq_len=settings.seq_len, lr=settings.lr,
               lr_schedule=settings.lr_schedule, zero_stage=settings.zero_stage, text=settings.text,
               label_seed=len(settings.seeds) > 1)
    # every FP8 cell gets its bf16 counterpart; a cell per variant of a backend that has them
    backends = [(f, v, more) for f in dict.fromkeys((None, *settings.fp8)) for v, more in _variants(settings, f)]
    # the hand-wired twins: a strategy's and a backend's own wiring, of the backend's default variant (its further
    # options at their defaults, as the hand wiring is written)
    by_hand = list(dict.fromkeys((f, v, _more_variants(settings, f, defaults=True)[0]) for f, v, _ in backends
                                 if get_backend(f).convert_by_hand is not None and v in (None, *variants_of(f)[:1])))
    cells = []
    blocks = [dict(compile=c, activation_checkpointing=a, memory=m) for c in settings.compile
              for a in settings.activation_checkpointing for m in settings.memory]
    for seed in settings.seeds:
        for size in settings.sizes:
            for strategy in settings.strategies:
                cells += [Cell(strategy=strategy, fp8=f, variant=v, more_variants=more, size=size, seed=seed, **job,
                               **b) for b in blocks for f, v, more in backends
                          if b["memory"] == STANDARD.name or refusal_of(strategy=strategy, memory=b["memory"]) is None]
            for strategy in (s for s in settings.strategies if settings.raw and get_strategy(s).shard_by_hand):
                cells += [Cell(strategy=strategy, fp8=f, variant=v, more_variants=more, size=size, seed=seed,
                               wiring="vs-raw", **job) for f, v, more in by_hand]
    return cells


def _variants(settings: BenchSettings, fp8: str | None) -> list[tuple[str | None, tuple[tuple[str, str], ...]]]:
    """Backend ``fp8``'s ``(variant, more_variants)`` the matrix runs; [(None, ())] without variants."""
    values = variants_of(fp8)
    if not values:
        return [(None, ())]
    return [(v, more) for v in settings.variants.get(get_backend(fp8).variant_option, values[:1])
            for more in _more_variants(settings, fp8)]


def _more_variants(settings: BenchSettings, fp8: str | None, *, defaults: bool = False) -> list[tuple]:
    """Every combination of the given values (``defaults``: the default) of ``fp8``'s further variant options."""
    options = variant_options(fp8)[1:]
    given = [variants_of(fp8, o)[:1] if defaults else settings.variants.get(o, variants_of(fp8, o)[:1])
             for o in options]
    return [tuple(zip(options, values)) for values in itertools.product(*given)]


def check_cells(cells: list[Cell], settings: BenchSettings, device_type: str) -> None:
    """ValueError unless every cell is a valid configuration that can run here."""
    import torch

    from ..config.resolve import resolve_config

    for name in settings.strategies:
        missing = get_strategy(name).missing_reason()
        if missing:
            raise ValueError(f"--strategies {name}: {missing}; install it or leave {name} out of --strategies.")
    if device_type == "cuda" and settings.nproc > torch.cuda.device_count():
        raise ValueError(f"--nproc {settings.nproc}: this machine has {plural(torch.cuda.device_count(), 'GPU')}; "
                         "use at most that many (one process per GPU).")
    for cell in cells:
        try:  # the combination table refuses what cannot run (compile or checkpointing with a backend, say)
            config = resolve_config(None, strategy=cell.strategy, fp8=cell.fp8, compile=cell.compile,
                                    activation_checkpointing=cell.activation_checkpointing, memory=cell.memory,
                                    **cell_options(cell))
        except ValueError as err:
            flags = " / ".join(map(cli_flag, ("compile", "activation_checkpointing", *variant_options(cell.fp8))))
            raise ValueError(f"cell {cell.name}: {err} Leave it out of {flags}, or the strategy or backend out of "
                             "the matrix.") from None
        device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
        gate = get_backend(cell.fp8).unavailable_reason(config, device) if cell.fp8 else None
        if gate:
            here = [n for n in BACKENDS if get_backend(n).unavailable_reason(config, device) is None]
            raise ValueError(f"--fp8: {cell.fp8!r} cannot run here: {gate}. Leave it out of --fp8 (what runs here: "
                             f"{', '.join([NO_FP8.name, *here])}).")
    if device_type == "cuda":  # fp8dist's own estimate of every cell against the GPU's memory
        from .fits import check_memory, gpu_budget

        check_memory(cells, settings.nproc, gpu_budget(settings.nproc))


def run_cells(cells: list[Cell], settings: BenchSettings, describe: Any) -> list[dict[str, Any]]:
    """Each cell in fresh processes, one after another, under a progress bar."""
    from tqdm import tqdm

    start_method = _start_method(cells)
    tqdm.monitor_interval = 0  # no monitor thread: the cells' processes may be forked from this one
    results = []
    with tempfile.TemporaryDirectory(prefix="fp8dist-bench-") as logs, \
            tqdm(total=len(cells), desc="fp8dist bench", unit="cell", file=sys.stderr) as bar:
        for cell in cells:
            bar.set_postfix_str(cell.name)
            results.append(_launch_cell(cell, cell_world(cell, settings.nproc), Path(logs), start_method))
            bar.write(describe(results[-1]))
            bar.update()
    return results


def _start_method(cells: list[Cell]) -> str:
    """CPU: fork, the heavy imports done once here (a spawned process spends 5-10 s importing on a busy 2-core
    machine, more than a tiny cell trains), with no OpenMP region run before (a child would hang in one). CUDA:
    spawn, as a CUDA context does not survive a fork."""
    import torch

    from ..pipeline.env import rank_imports

    if torch.cuda.is_available():
        return "spawn"
    for name in rank_imports([*(get_strategy(c.strategy) for c in cells), *(get_backend(c.fp8) for c in cells)]):
        importlib.import_module(name)
    return "fork"


def _launch_cell(cell: Cell, nproc: int, logs: Path, start_method: str) -> dict[str, Any]:
    """Rank 0's figures of ``cell`` run on ``nproc`` fresh processes, or the cell with the failing rank's error."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # a failed cell is reported with its traceback in the results, not as a log flood over the progress bar
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1, start_method=start_method,
                          logs_specs=DefaultLogsSpecs(log_dir=str(logs / run_id), redirects=Std.ALL))
    try:
        returned = elastic_launch(config, _cell_worker)(cell)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        return {**cell.to_dict(), "error": f"rank {rank} exited with {failure.exitcode}: "
                                           f"{_error_text(failure, logs / run_id, rank)}"}
    return returned[0]


def _error_text(failure: Any, logs: Path, rank: int) -> str:
    """The failing rank's traceback (recorded by ``@record``), else the tail of its stderr."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message", failure.message)
    if isinstance(message, dict):
        message = message.get("extraInfo", {}).get("py_callstack") or message.get("message", "")
    if message and "To enable traceback" not in str(message):
        return str(message)[-4000:]
    tails = [p.read_text(errors="replace")[-4000:] for p in sorted(logs.rglob(f"{rank}/stderr.log"))]
    return tails[-1] if tails else str(message)


def _cell_worker(cell: Cell) -> dict[str, Any] | None:
    """Entry point of each spawned process (module level: it is pickled by reference)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_run_and_close)(cell)


def _run_and_close(cell: Cell) -> dict[str, Any] | None:
    import torch.distributed as dist

    from .cell import run_cell

    package = get_backend(cell.fp8).package
    if package is not None:  # the backend library's notices, once per step and rank, would flood the log
        logging.getLogger(package).setLevel(logging.ERROR)
    try:
        return run_cell(cell)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
