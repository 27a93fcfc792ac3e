"""``fp8dist train``: the reference job, in this process or in ``--nproc`` processes it starts. The engines are
imported once the flags parse (a bad flag answers without importing torch)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
import warnings
from pathlib import Path
from collections.abc import Iterator
from typing import Any, NoReturn

from ..config.resolve import Config, FP8Config, StrategyConfig
from ..config.rules import check
from ..config.schema import add_arguments
from ..fp8 import get_backend
from ..runtime.env_vars import read
from ..strategies import get_strategy
from ..train.config import TrainConfig
from .common import FP8_DEFAULT_HELP, config_from_args, one_line_warnings, quiet_cpu_noise
from .errors import FAILED_EXIT, INTERRUPTED_EXIT, error_line, exit_code, read_report, report_error

__all__ = ["HELP", "add_parser", "run"]

HELP = "train a small Llama on the built-in corpus, or fine-tune a model on your text files (the reference job)"
"""The command's line in ``fp8dist --help``."""


def add_parser(sub: Any) -> None:
    """Add ``fp8dist train`` and its flags to ``sub`` (the top-level parser's subparsers); called only when the
    command line names train (the other commands are a line of ``fp8dist --help``)."""
    p = sub.add_parser("train", help=HELP,
                       description="Train a small Llama (built from a config, no download) on a deterministic "
                                   "built-in corpus, or any causal LM (--model-config, --pretrained) on text files "
                                   "(--data, --tokenizer): step lines with loss, grad norm, lr, tokens/s, MFU, peak "
                                   "memory and skipped steps; --metrics-file for the same as JSON lines. Spawns "
                                   "--nproc processes itself unless started by torchrun, deepspeed or srun.")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file with any of the keys below; flags override it")
    add_arguments(p, StrategyConfig, title="strategy", skip=("seq_len",))  # the job's --seq-len sets it
    add_arguments(p, FP8Config, title="fp8", shown_defaults={"fp8": FP8_DEFAULT_HELP})
    add_arguments(p, TrainConfig, title="training job", shown_defaults={"data": "none, the built-in corpus"})


def _config_and_job(args: argparse.Namespace) -> tuple[Config, TrainConfig]:
    config, routed = config_from_args(args, extra=(TrainConfig,))
    return config, TrainConfig(**routed[TrainConfig])


class _Progress:
    """Steps done so far, as rank 0 counts them; in a file too when the launching process reads them."""

    def __init__(self, path: Path | None = None):
        self.path, self.step = path, None

    def __call__(self, step: int) -> None:
        self.step = step
        if self.path is not None:  # replaced whole: the reader never sees half a number
            self.path.with_suffix(".tmp").write_text(str(step))
            os.replace(self.path.with_suffix(".tmp"), self.path)

    @staticmethod
    def read(path: Path) -> int | None:
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            return None


def _interrupted(train: TrainConfig, step: int | None, writers_gone: bool = True) -> int:
    """Say where an interrupted job stood, once: the last step done (its line printed) and the last checkpoint
    complete, and when the interrupt came during that step's save (whose partial folder the save removes); returns
    the exit code.
    ``writers_gone``: every rank has ended (the spawning command, one process), so a cut save's folder that a rank
    made again after rank 0 removed it (its shard still being written when the signal reached it) is removed here;
    False for rank 0 of a job another launcher started, whose other ranks may still write."""
    from ..checkpoint.layout import job_root, latest_checkpoint, step_name
    from ..train.job import save_due

    saved_at = None
    if train.checkpoint_dir is None:
        saved = "no checkpoint (no --checkpoint-dir)"
    else:
        try:
            newest = latest_checkpoint(job_root(train.checkpoint_dir))
        except (OSError, ValueError):
            newest = None
        saved_at = int(newest.name[5:]) if newest else None
        saved = f"last checkpoint step {saved_at}" if newest else "no checkpoint saved yet"
        if saved_at is not None:  # a job resumed from it and interrupted before its first step: done too
            step = max(step or 0, saved_at)
    in_save = step is not None and (saved_at or 0) < step and save_due(train, step)
    if in_save and writers_gone and train.checkpoint_dir is not None:
        shutil.rmtree(job_root(train.checkpoint_dir) / f".tmp-{step_name(step)}", ignore_errors=True)
    done = "before the first step" if step is None else f"after step {step}" + (", during its save" if in_save else "")
    print(f"fp8dist train: interrupted {done}; {saved}", file=sys.stderr, flush=True)
    return INTERRUPTED_EXIT


def _train_this_rank(config: Config, train: TrainConfig, progress: _Progress) -> None:
    from ..runtime.env import shutdown
    from ..train.job import run_training

    run_training(config, train, progress=progress)
    shutdown()


def _exit_now(code: int) -> NoReturn:
    """Exit without interpreter teardown, where a gloo worker thread taking the GIL to release a finished collective
    aborts the process (``std::terminate``; gdb, 2026-11-23) and the launcher reports a finished job as failed:
    :func:`fp8dist.shutdown` makes it rare (0 in 60); this makes it impossible."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _interrupt_once(signum: int, frame: Any) -> None:
    """A rank's SIGINT handler: the first interrupt raises KeyboardInterrupt, later ones are ignored, so that the
    cleanup it starts (a partial save removed, the checkpoint lock released) runs to its end. Ctrl-C reaches a rank
    twice: from the terminal (its process group) and forwarded by the launcher; the launcher's grace period
    (:data:`SHUTDOWN_GRACE_S`) still ends a rank that does not exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _run_launched(config: Config, train: TrainConfig, rank: int) -> NoReturn:
    """One rank of a job torchrun, deepspeed or srun started: an explained error or an interrupt is one line from
    rank 0, anything else a traceback."""
    progress = _Progress()
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        _train_this_rank(config, train, progress)
    except KeyboardInterrupt:
        _exit_now(_interrupted(train, progress.step, writers_gone=False) if rank == 0 else INTERRUPTED_EXIT)
    except Exception as err:
        code = exit_code(err)
        if code is None:
            raise
        if rank == 0:
            print(error_line("train", str(err)), file=sys.stderr)
        _exit_now(code)
    _exit_now(0)  # the job is done, the process group destroyed, the checkpoint written


def _train_worker(flat_config: dict[str, Any], flat_train: dict[str, Any], state: str) -> None:
    """Each spawned rank: an explained error is reported to the launching process, an interrupt ends it quietly."""
    quiet_cpu_noise()
    rank = int(os.environ["RANK"])
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        with one_line_warnings("train"):  # a rank's warnings read as the command's own
            _train_this_rank(Config.from_dict(flat_config), TrainConfig(**flat_train),
                             _Progress(Path(state) / "progress" if rank == 0 else None))
    except KeyboardInterrupt:
        _exit_now(INTERRUPTED_EXIT)
    except Exception as err:
        code = exit_code(err)
        if code is None:
            raise
        report_error(state, rank, err, code)
        _exit_now(code)


def run(args: argparse.Namespace) -> int:
    """Run ``fp8dist train`` with its parsed flags; returns the exit code (0: done). Raises what the library raises for
    bad values: :func:`fp8dist.cli.main` turns the errors fp8dist explains into one line and exit code 2."""
    from ..runtime.env import detect_launch_env, resolve_device
    from ..plan.precision import check_fp8_available
    from ..train.checks import check_checkpoint_dir, check_positions
    from ..train.data import check_batch_split
    from ..train.data.job import JobBatches, load_job_corpus
    from ..train.job import default_nproc
    from ..train.log import check_outputs
    from ..train.models import job_model_config

    config, train = _config_and_job(args)
    check_fp8_available(config, resolve_device(config.parallel.device, 0))  # before any process starts
    check_checkpoint_dir(train)
    launch = detect_launch_env()
    if train.launcher == "ray":
        from .train_ray import check_ray_launch

        check_ray_launch(launch.launcher)
    # a strategy without a process group runs in one process
    nproc = train.nproc or (default_nproc() if get_strategy(config.parallel.strategy).process_group else 1)
    check_outputs(train)
    if launch.launcher != "none":  # started by torchrun / deepspeed / srun: we are one rank
        if not train.data:  # with data, the ranks check the model against the tokenizer once they have it
            model_config, name = job_model_config(config, train)
            check_positions(model_config, name, config, train, launch.world_size)
        _run_launched(config, train, launch.rank)
    if train.checkpoint_dir is not None:  # the job's rank 0 locks it; a job holding it is said before any work
        from ..checkpoint.layout import job_root
        from ..checkpoint.lock import check_unlocked

        check_unlocked(job_root(train.checkpoint_dir))
    check(config, world_size=nproc, world_name="nproc")  # the rules on how many processes a strategy runs in
    check_batch_split(train.batch_size, nproc, config.parallel.grad_accum)  # before any process starts
    # the text tokenized here, once, before any process starts: a bad file is one line, the ranks read the cache
    with warnings.catch_warnings():  # its notes (an option with no effect) are said once, by the job's rank 0
        warnings.simplefilter("ignore")
        corpus = load_job_corpus(train, config.parallel.pretrained)
    model_config, name = job_model_config(config, train, corpus)  # --pretrained / --model-config read here first
    check_positions(model_config, name, config, train, nproc)
    if corpus is not None:  # enough windows for a global batch and the held-out batches
        JobBatches(corpus, batch_size=train.batch_size, seq_len=train.seq_len, seed=train.seed, world_size=nproc,
                   eval_batches=train.eval_batches)
    if train.launcher == "ray":
        from .train_ray import run_on_ray

        return run_on_ray(nproc, config, train, use_gpu=resolve_device(config.parallel.device, 0).type == "cuda")
    if nproc == 1:
        progress = _Progress()
        try:
            _train_this_rank(config, train, progress)
        except KeyboardInterrupt:
            return _interrupted(train, progress.step)
        return 0
    return _spawn(nproc, config, train, type(model_config).__module__.replace(".configuration_", ".modeling_"))


SHUTDOWN_GRACE_S = 5
"""Seconds the ranks get to exit after an interrupt (torch's default 30): a rank waiting in a collective never sees it,
and checkpoints are atomic. TORCH_ELASTIC_SHUTDOWN_TIMEOUT still decides when set."""


def _spawn(nproc: int, config: Config, train: TrainConfig, model_module: str) -> int:
    """Start ``nproc`` local ranks with torch's elastic launch; returns the exit code, every child reaped. They fork
    from a fork server that preloads what every rank imports (``model_module``: the model family's), not from this
    process, which may have run OpenMP (a forked child's first OpenMP region then hangs)."""
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ..runtime.env import rank_imports

    backend = get_backend(config.precision.fp8)
    preload = rank_imports([get_strategy(config.parallel.strategy), backend], model_module)
    multiprocessing.set_forkserver_preload([f"{__package__}._quiet_ranks", *preload])
    grace = read(os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_GRACE_S)
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"fp8dist-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                          start_method="forkserver", shutdown_timeout=grace)
    print(f"fp8dist train: starting {nproc} processes", flush=True)
    state = Path(tempfile.mkdtemp(prefix="fp8dist-train-"))
    try:
        with _quiet_launcher_logs():
            elastic_launch(launch, _train_worker)(config.to_dict(), dataclasses.asdict(train), str(state))
    except ChildFailedError as err:
        multiprocessing.active_children()  # joins the ranks that ended: none is left <defunct> as we report
        return _failed(err, state, train)
    except (KeyboardInterrupt, SignalException):
        multiprocessing.active_children()
        return _interrupted(train, _Progress.read(state / "progress"))
    finally:
        shutil.rmtree(state, ignore_errors=True)
        # else they outlive the command <defunct>. The fork server first: it holds the tracker's pipe; _stop is
        # what CPython's own tests use (no public way)
        for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
            helper._stop()
    return 0


@contextlib.contextmanager
def _quiet_launcher_logs() -> Iterator[None]:
    """The elastic agent logs a failed rank with a traceback of its own monitor loop: silenced, the command says it."""
    names = [n for n in list(logging.Logger.manager.loggerDict)
             if n.startswith(("torch.distributed.elastic", "torch.multiprocessing"))]
    saved = {n: logging.getLogger(n).level for n in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


def _failed(err: Any, state: Path, train: TrainConfig) -> int:
    """The exit code, and one line: a rank's explained error, an interrupt, or (a bug) the first failure's traceback."""
    report = read_report(state)
    if report is not None:
        print(error_line("train", report["message"]), file=sys.stderr)
        return report["code"]
    if all(f.exitcode in (INTERRUPTED_EXIT, -signal.SIGINT) for f in err.failures.values()):
        return _interrupted(train, _Progress.read(state / "progress"))
    rank, failure = err.get_first_failure()
    print(f"fp8dist train: rank {rank} failed (exit code {failure.exitcode}):\n{failure.message}", file=sys.stderr)
    return FAILED_EXIT
