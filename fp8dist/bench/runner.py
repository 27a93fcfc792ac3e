"""``fp8dist bench``'s matrix: the flags read into :class:`BenchSettings`, the cells planned and checked before any
process starts (on a GPU against fp8dist's memory estimate, :mod:`.fits`: one that will not fit is refused with
the flag that makes it fit), then each cell run in fresh processes. Examples: benchmarks/README.md."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.text import plural
from ..config.rules import refusal_of
from ..fp8 import BACKENDS, NO_FP8, get_backend
from ..memory_levels import LEVELS, STANDARD
from ..strategies import STRATEGIES, get_strategy
from .cell import TIMING_WARMUP, Cell, TextJob, cell_options, cell_world, variants_of

__all__ = ["BenchSettings", "resolve_settings", "plan_cells", "check_cells", "check_text", "run_cells", "device_type",
           "fp8_choices", "variant_backends", "default_strategies", "DEFAULTS"]

# defaults per device type: (sizes, steps, batch per rank, sequence length); the strategies are
# default_strategies(device type), the FP8 backends none and fp8dist train's default one where it runs
DEFAULTS = {"cpu": ("tiny,small", 10, 4, 128), "cuda": ("1b", 20, 4, 2048)}


def default_strategies(device_type: str, *, installed: bool = True) -> tuple[str, ...]:
    """The strategies ``fp8dist bench`` runs on ``device_type`` without ``--strategies``: those whose
    ``bench_devices`` name it, where installed (``installed``: only those)."""
    return tuple(name for name, s in STRATEGIES.items()
                 if device_type in s.bench_devices and not (installed and s.missing_reason()))


def fp8_choices() -> tuple[str, ...]:
    """``--fp8``'s choices: none, then every registered backend."""
    return (NO_FP8.name, *BACKENDS)


def variant_backends() -> list[str]:
    """The backends whose variants the bench runs as cells of their own, each with its option's flag
    (``--torchao-recipe``)."""
    return [name for name in BACKENDS if variants_of(name)]


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """The matrix and the job of every cell, validated."""

    strategies: tuple[str, ...]
    fp8: tuple[str | None, ...]
    sizes: tuple[str, ...]
    steps: int
    batch_size: int
    seq_len: int
    nproc: int
    lr: float
    zero_stage: int
    raw: bool
    lr_schedule: str = "constant"
    """constant, or cosine: fp8dist train's warm-up + cosine decay over ``steps`` (fp8dist.train.schedule.lr_schedule)."""
    compile: tuple[bool, ...] = (False,)
    """Compile off and/or on: a matrix dimension."""
    activation_checkpointing: tuple[str, ...] = ("none",)
    memory: tuple[str, ...] = (STANDARD.name,)
    """Memory levels: a matrix dimension (a level's cells only where the combination table allows it)."""
    variants: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Per backend variant option (torchao_recipe), its values: a matrix dimension of that backend's cells; an
    option not given runs its default (the config's)."""
    seeds: tuple[int, ...] = (0,)
    """Seeds (model initialization, batch order): a matrix dimension, for the spread of the figures across seeds."""
    text: TextJob | None = None
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


def _one_of(flag: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{flag} {value!r} is not one of {', '.join(choices)} (one value, e.g. {flag} {choices[-1]}).")
    return value


def _at_least(flag: str, value: int, low: int, why: str) -> int:
    if value < low:
        raise ValueError(f"{flag} {value}: needs at least {low} ({why}).")
    return value


def resolve_settings(args: argparse.Namespace, device_type: str) -> BenchSettings:
    """The command line's settings with the device's defaults filled in; ValueError names a bad value."""
    from ..train.data import make_corpus
    from ..train.models import LLAMA_SIZES
    from ..train.schedule import LR_SCHEDULES
    from ..train.job import default_fp8, default_nproc

    sizes, steps, batch, seq = DEFAULTS[device_type]
    strategies = ",".join(default_strategies(device_type))
    train_fp8 = default_fp8()  # fp8dist train's backend where it runs here, else None: bf16 cells only
    fp8 = ",".join(dict.fromkeys((NO_FP8.name, train_fp8 or NO_FP8.name)))
    given = lambda value, default: default if value is None else value  # noqa: E731
    fp8_items = _split("--fp8", given(args.fp8, fp8), fp8_choices(), f"{NO_FP8.name},{train_fp8 or fp8_choices()[1]}")
    settings = BenchSettings(
        strategies=_split("--strategies", given(args.strategies, strategies), tuple(STRATEGIES),
                          ",".join(default_strategies("cuda", installed=False))),
        fp8=tuple(None if f == NO_FP8.name else f for f in fp8_items),
        sizes=_split("--sizes", given(args.sizes, sizes), tuple(LLAMA_SIZES), "tiny,small"),
        steps=_at_least("--steps", given(args.steps, steps), TIMING_WARMUP + 2,
                        f"{TIMING_WARMUP} warm-up steps, at least 1 timed step and 1 counted step"),
        batch_size=_at_least("--batch-size", given(args.batch_size, batch), 1, "sequences per process"),
        seq_len=_at_least("--seq-len", given(args.seq_len, seq), 2, "tokens per sequence"),
        nproc=_at_least("--nproc", given(args.nproc, default_nproc()), 1, "processes"),
        seeds=_seeds(args.seed), lr=args.lr, zero_stage=args.zero_stage, raw=args.raw,
        lr_schedule=_one_of("--lr-schedule", args.lr_schedule, LR_SCHEDULES),
        compile=tuple(c == "on" for c in _split("--compile", args.compile, ("off", "on"), "off,on")),
        activation_checkpointing=_split("--activation-checkpointing", args.activation_checkpointing,
                                        ("none", "full", "selective"), "none,full"),
        memory=_split("--memory", getattr(args, "memory", STANDARD.name), tuple(LEVELS), ",".join(LEVELS)),
        variants=_variant_settings(args),
        text=_text_job(args))
    corpus = len(make_corpus())
    if settings.text is None and settings.seq_len >= corpus:
        raise ValueError(f"--seq-len {settings.seq_len} is longer than the built-in corpus ({corpus} bytes); "
                         f"use at most {corpus - 1}.")
    if args.lr <= 0:
        raise ValueError(f"--lr {args.lr}: must be positive.")
    return settings


def _variant_settings(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """Each backend variant option's values, from its flag."""
    out = {}
    for name in variant_backends():
        option, values = get_backend(name).variant_option, variants_of(name)
        out[option] = _split("--" + option.replace("_", "-"), getattr(args, option), values, ",".join(values[:2]))
    return out


def _seeds(text: str) -> tuple[int, ...]:
    """``--seed``: one seed or a comma-separated list of them (non-negative integers)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items or not all(t.isdigit() for t in items):
        raise ValueError(f"--seed {text!r}: give a non-negative integer or a comma-separated list, e.g. --seed 0,1,2.")
    return tuple(dict.fromkeys(int(t) for t in items))


def _text_job(args: argparse.Namespace) -> TextJob | None:
    """``--data`` and its options (``fp8dist train``'s flags, validated as there) as every cell's :class:`TextJob`;
    None without ``--data`` (the grammar)."""
    from dataclasses import fields

    from ..train.data.job import job_tokenizer
    from ..train.config import TrainConfig

    names = [f.name for f in fields(TextJob)]
    job = TrainConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})
    tokenizer = job_tokenizer(job.data, job.tokenizer, None)
    if tokenizer is None:
        return None
    return TextJob(**{**{name: getattr(job, name) for name in names}, "tokenizer": tokenizer})


def check_text(settings: BenchSettings) -> str:
    """Tokenize the cells' text here, once (the cells read the token cache), and check it holds a global batch and
    the held-out batches of every cell; returns the corpus in a line ("" without text).

    Raises:
        ValueError: a bad file or tokenizer, a corpus too short (with the way out).
    """
    from ..train.data.job import JobBatches, load_job_corpus

    if settings.text is None:
        return ""
    corpus = load_job_corpus(settings.text, None)
    batches = JobBatches(corpus, batch_size=settings.batch_size * settings.nproc, seq_len=settings.seq_len, seed=0,
                         world_size=settings.nproc, eval_batches=settings.text.eval_batches)
    return batches.describe()


def plan_cells(settings: BenchSettings) -> list[Cell]:
    """The cells in run order: per size and strategy the bf16 cell, its FP8 cells; then the overhead cells of the
    strategies with a hand-wired twin (FSDP2's)."""
    job = dict(steps=settings.steps, batch_size=settings.batch_size, seq_len=settings.seq_len, lr=settings.lr,
               lr_schedule=settings.lr_schedule, zero_stage=settings.zero_stage, text=settings.text,
               label_seed=len(settings.seeds) > 1)
    # every FP8 cell gets its bf16 counterpart; a cell per variant of a backend that has them
    backends = [(f, v) for f in dict.fromkeys((None, *settings.fp8)) for v in _variants(settings, f)]
    # the hand-wired twins: a strategy's and a backend's own wiring, of the backend's default variant
    by_hand = [(f, v) for f, v in backends if get_backend(f).convert_by_hand is not None
               and v in (None, *variants_of(f)[:1])]
    cells = []
    blocks = [dict(compile=c, activation_checkpointing=a, memory=m) for c in settings.compile
              for a in settings.activation_checkpointing for m in settings.memory]
    for seed in settings.seeds:
        for size in settings.sizes:
            for strategy in settings.strategies:
                cells += [Cell(strategy=strategy, fp8=f, variant=v, size=size, seed=seed, **job, **b)
                          for b in blocks for f, v in backends
                          if b["memory"] == STANDARD.name or refusal_of(strategy=strategy, memory=b["memory"]) is None]
            for strategy in (s for s in settings.strategies if settings.raw and get_strategy(s).shard_by_hand):
                cells += [Cell(strategy=strategy, fp8=f, variant=v, size=size, seed=seed, wiring="vs-raw", **job)
                          for f, v in by_hand]
    return cells


def _variants(settings: BenchSettings, fp8: str | None) -> tuple[str | None, ...]:
    """The variants of backend ``fp8`` the matrix runs: those given, else its default; (None,) without variants."""
    values = variants_of(fp8)
    return settings.variants.get(get_backend(fp8).variant_option, values[:1]) if values else (None,)


def check_cells(cells: list[Cell], settings: BenchSettings, device_type: str) -> None:
    """Every cell is a valid configuration that can run here, before any process starts."""
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
            raise ValueError(f"cell {cell.name}: {err} Leave it out of --compile / --activation-checkpointing, or "
                             "the strategy or backend out of the matrix.") from None
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
    """CPU: fork the cells' processes from this one, with the heavy imports done once here (a spawned process
    spends 5-10 s importing torch, transformers and torchao on a busy 2-core machine, more than a tiny cell
    trains); this process runs no OpenMP region before it forks (a child would hang in one). CUDA: spawn, as a
    CUDA context does not survive a fork."""
    import torch

    from ..pipeline.env import rank_imports

    if torch.cuda.is_available():
        return "spawn"
    for name in rank_imports([*(get_strategy(c.strategy) for c in cells), *(get_backend(c.fp8) for c in cells)]):
        importlib.import_module(name)
    return "fork"


def _launch_cell(cell: Cell, nproc: int, logs: Path, start_method: str) -> dict[str, Any]:
    """Run one cell on ``nproc`` fresh processes with torch's elastic launch (what torchrun runs); rank 0's
    figures, or the cell with the first failing rank's error."""
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
