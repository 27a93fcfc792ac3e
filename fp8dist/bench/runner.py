"""``fp8dist bench``'s matrix: the flags read into :class:`~.settings.BenchSettings`, the cells planned and checked
before any process starts (on a GPU against the memory estimate, :mod:`.fits`), then each cell run in fresh
processes."""

from __future__ import annotations

import argparse
import importlib
import itertools
import logging
import sys
import tempfile
import uuid
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..config.schema import cli_flag
from ..config.text import plural
from ..config.rules import refusal_of
from ..fp8 import BACKENDS, NO_FP8, get_backend
from ..memory_levels import STANDARD
from ..strategies import STRATEGIES, get_strategy
from .cell import Cell, cell_options, cell_world
from .settings import (DEFAULTS, BenchSettings, TextJob, default_strategies, read_flags, variant_backends,
                       variant_options, variants_of)

__all__ = ["BenchSettings", "resolve_settings", "plan_cells", "check_cells", "check_text", "run_cells", "device_type",
           "variant_backends", "variant_options", "default_strategies", "DEFAULTS"]


def device_type() -> str:
    """"cuda" where torch sees a CUDA device, else "cpu": where the bench's cells run."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_settings(args: argparse.Namespace, device_type: str) -> BenchSettings:
    """The command line's settings with the device's defaults filled in; ValueError names a bad value."""
    from ..train.data import make_corpus

    settings = BenchSettings(**read_flags(args, device_type), text=_text_job(args))
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
        from .fits import check_cells_fit, gpu_budget

        check_cells_fit(cells, settings.nproc, gpu_budget(settings.nproc))


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

    from ..runtime.env import rank_imports

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
