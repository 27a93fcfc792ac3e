"""One cell of ``fp8dist bench``, run in every rank of a fresh process group: build, wrap (with fp8dist, or the
same wiring by hand), train a few steps, and measure step time, memory, model-state bytes and communication."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .comm import CommCounter
from ..checkpoint.io import all_ranks_values
from ..fp8 import get_backend
from ..memory_levels import STANDARD
from ..strategies import get_strategy
from ..train.data.job import lm_loss
from ..runtime.agree import rank_world
from ..runtime.env import peak_memory_mib, share_cpu_threads
from .settings import TIMING_WARMUP, TextJob, variants_of

__all__ = ["Cell", "TextJob", "run_cell", "describe_job", "cell_config", "cell_options", "cell_world",
           "variants_of", "predicted_figures", "versions_line", "TIMING_WARMUP"]


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One run of the matrix."""

    strategy: str
    fp8: str | None
    size: str
    wiring: str = "fp8dist"
    """"fp8dist": ``wrap_model``; "vs-raw": ``wrap_model`` beside the same wiring by hand (the strategy's
    ``shard_by_hand``, the backend's ``convert_by_hand``), for the overhead ratio."""
    steps: int = 10
    batch_size: int = 4
    """Sequences per rank per step."""
    seq_len: int = 128
    seed: int = 0
    lr: float = 1e-3
    """AdamW's peak learning rate."""
    lr_schedule: str = "constant"
    zero_stage: int = 2
    compile: bool = False
    activation_checkpointing: str = "none"
    memory: str = STANDARD.name
    variant: str | None = None
    """The value of the backend's ``variant_option`` (torchao's recipe); None: the backend has no variants."""
    more_variants: tuple[tuple[str, str], ...] = ()
    """``(option, value)`` of each of the backend's ``more_variant_options``; the JSON writes them as a mapping."""
    text: TextJob | None = None
    """None: the built-in grammar corpus."""
    label_seed: bool = False
    """The name ends with the seed (a matrix over several seeds)."""

    @property
    def name(self) -> str:
        """The cell's name in the results: strategy/backend and recipe variant/size, then +compile, +ac-MODE,
        +MEMORY, /vs-raw and /seedN where they apply."""
        blocks = ("+compile" if self.compile else "") + \
            (f"+ac-{self.activation_checkpointing}" if self.activation_checkpointing != "none" else "") + \
            (f"+{self.memory}" if self.memory != STANDARD.name else "")
        recipe = variant_label(self.fp8, self.variant, dict(self.more_variants))
        return f"{self.strategy}/{self.fp8 or 'bf16'}{recipe}{blocks}/{self.size}" + \
            ("/vs-raw" if self.wiring == "vs-raw" else "") + (f"/seed{self.seed}" if self.label_seed else "")

    def to_dict(self) -> dict[str, Any]:
        """The cell as JSON data: its name and every field."""
        return {"name": self.name, **asdict(self), "more_variants": dict(self.more_variants)}


def non_default_variants(fp8: str | None, variant: str | None, more: dict[str, str]) -> list[str]:
    """A cell's variant and further variant values (``more``: option -> value) that are not their option's default."""
    values = [(variant, variants_of(fp8)[:1]), *((v, variants_of(fp8, o)[:1]) for o, v in more.items())]
    return [v for v, default in values if v not in (None, *default)]


def variant_label(fp8: str | None, variant: str | None, more: dict[str, str]) -> str:
    """``-rowwise-weight_wrapper`` for names and labels; "" for the defaults."""
    return "".join(f"-{v}" for v in non_default_variants(fp8, variant, more))


def cell_world(cell: Cell, nproc: int) -> int:
    """The processes a cell runs on: ``nproc``, or one for a strategy without a process group."""
    return nproc if get_strategy(cell.strategy).process_group else 1


def cell_options(cell: Cell) -> dict[str, Any]:
    """The options a cell sets beside strategy, fp8 and its blocks: its variants, and the ZeRO stage where read."""
    options: dict[str, Any] = {}
    if cell.variant is not None:
        options[get_backend(cell.fp8).variant_option] = cell.variant
    options.update(cell.more_variants)
    if "zero_stage" in get_strategy(cell.strategy).options:
        options.update(zero_stage=cell.zero_stage)
    return options


def versions_line(versions: dict[str, str | None]) -> str:
    """``torch 2.x, torchao 0.y, ...``: a results document's installed libraries, for its headings."""
    return ", ".join(f"{name} {v}" for name, v in versions.items() if v and name not in ("python", "fp8dist"))


def describe_job(settings: dict[str, Any]) -> str:
    """Every cell's job in words, from a results document's ``settings``: the table's and the plot's heading."""
    schedule = {"constant": "constant", "cosine": "warm-up + cosine decay"}[settings.get("lr_schedule", "constant")]
    seeds = settings.get("seeds", [settings.get("seed")])
    text = settings.get("text")
    data = f"; text {', '.join(Path(p).name for p in text['data'])}" if text else "; the built-in grammar corpus"
    return (f"AdamW lr {settings['lr']:g} ({schedule}), {settings['steps']} steps of {settings['batch_size']} x "
            f"{settings['seq_len']} tokens per process, seed{'s' if len(seeds) > 1 else ''} "
            f"{', '.join(map(str, seeds))}{data}")


@dataclass
class _Wired:
    """A model wired for training, and what a hand-wired step calls besides forward, backward and the step."""

    model: Any
    optimizer: Any
    fp8_layers: tuple[int, int]
    """(FP8 GEMM layers, their parameters)."""
    after_step: Callable[[], None] = lambda: None
    forward_context: Callable[[], Any] = contextlib.nullcontext
    predicted: dict[str, Any] | None = None
    """The speed model's figures for the plan; None for the hand-wired run."""


def _fp8dist_wiring(cell: Cell, model: nn.Module, device: torch.device) -> _Wired:
    from ..pipeline.api import get_plan, wrap_model

    wrapped, optimizer = wrap_model(model, config=cell_config(cell), optimizer=_optimizer_spec(cell))
    plan = get_plan(wrapped)
    fp8 = (len(plan.fp8), sum(e.params for e in plan.fp8))
    return _Wired(wrapped, optimizer, fp8, predicted=predicted_figures(plan))


def cell_config(cell: Cell) -> Any:
    """The config a cell's fp8dist run wraps with: every eligible layer in FP8 (``fp8_select='all'``, as the
    hand-wired run converts them), with the speed model's predictions at the cell's tokens per rank."""
    from ..config.resolve import resolve_config
    from ..plan.selection import with_read_options

    config = resolve_config(strategy=cell.strategy, fp8=cell.fp8, compile=cell.compile, memory=cell.memory,
                            activation_checkpointing=cell.activation_checkpointing, **cell_options(cell))
    return with_read_options(config, micro_batch_size=cell.batch_size, seq_len=cell.seq_len, fp8_select="all")


def predicted_figures(plan: Any) -> dict[str, Any] | None:
    """The speed model's figures for a cell's plan (``Selection.to_dict()``); None where nothing was predicted (a
    CPU, no FP8 backend with a speed model)."""
    selection = plan.selection
    return selection.to_dict() if selection is not None and selection.step is not None else None


def _optimizer_spec(cell: Cell) -> dict[str, Any]:
    return {"type": "AdamW", "lr": cell.lr, "betas": (0.9, 0.95), "weight_decay": 0.0}


def _llama_units(model: nn.Module) -> list[tuple[list[nn.Module], bool]]:
    """torchtitan's units of the bench's Llama: each decoder layer, the embedding, then norm + head kept gathered."""
    inner = model.model
    return [*(([layer], True) for layer in inner.layers), ([inner.embed_tokens], True),
            ([inner.norm, model.lm_head], False)]


def _hand_wired(cell: Cell, model: nn.Module, device: torch.device) -> _Wired:
    """The same run wired by hand: the backend's ``convert_by_hand``, the strategy's ``shard_by_hand``, AdamW."""
    strategy = get_strategy(cell.strategy)
    converted = get_backend(cell.fp8).convert_by_hand(model, strategy.facts(cell_config(cell)))
    model = strategy.shard_by_hand(model, _llama_units(model), device)
    optimizer = torch.optim.AdamW(model.parameters(), **{k: v for k, v in _optimizer_spec(cell).items()
                                                         if k != "type"})
    return _Wired(model, optimizer, (converted.layers, converted.params), converted.after_step,
                  converted.forward_context)


def _init_process_group(cell: Cell) -> torch.device:
    """The process group from the launcher's environment (outside any timed step); this rank's device."""
    from ..runtime.env import init_distributed

    if get_strategy(cell.strategy).process_group:
        return init_distributed().device
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Run:
    def __init__(self, cell: Cell, wiring: str, device: torch.device, batches: Any) -> None:
        from ..train.data import VOCAB_SIZE
        from ..train.models import build_llama
        from ..train.schedule import lr_schedule, set_lr

        vocab = batches.corpus.vocab_size if batches.corpus is not None else VOCAB_SIZE
        model = build_llama(cell.size, seed=cell.seed, max_seq_len=cell.seq_len, vocab_size=vocab)
        self.windows = batches.windows
        self.params = sum(p.numel() for p in model.parameters())
        torch.manual_seed(cell.seed)  # as a script seeds: memory="lean" takes its rounding seed from it
        self.wired = (_hand_wired if wiring == "raw" else _fp8dist_wiring)(cell, model, device)
        self.model, self.optimizer = self.wired.model, self.wired.optimizer
        self.wiring = wiring
        self.device = device
        self.last = cell.steps - 1
        factor = lr_schedule(cell.lr_schedule, cell.steps)  # fp8dist train's schedule and setter
        self.schedule_lr = lambda step: set_lr(self.optimizer, cell.lr * factor(step))
        self.strategy = get_strategy(cell.strategy)  # its step: backward, optimizer step (DeepSpeed's engine's own)
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.times: list[float] = []
        self.counter = CommCounter()
        self.state: dict[str, Any] = {}
        self.eval_losses: list[list[float]] = []  # [step, held-out loss]

    def step(self, step: int, ids: torch.Tensor) -> None:
        """One step as a user writes it, timed; the last one counted (collectives, model-state bytes)."""
        counting = step == self.last
        self.schedule_lr(step)
        _sync(self.device)
        t0 = time.perf_counter()
        with self.counter if counting else contextlib.nullcontext():
            with self.wired.forward_context():
                loss = lm_loss(self.model, ids, windows=self.windows)
            self.strategy.backward(self.model, loss)

            def while_held() -> None:  # the step's gradients and optimizer states both held (DeepSpeed: before it)
                self.wired.after_step()
                self._record_state(counting)

            self.strategy.optimizer_step(self.model, self.optimizer, while_held=while_held)
        _sync(self.device)
        self.times.append(time.perf_counter() - t0)
        self.losses.append(loss.detach().float().item())
        self.lrs.append(float(self.optimizer.param_groups[0]["lr"]))

    def _record_state(self, counting: bool) -> None:
        """fp8dist.report's per-rank bytes, taken while the step's gradients are still held."""
        if counting and self.wiring == "fp8dist":
            from ..accounting import report

            rep = report(self.model, self.optimizer)
            self.state = {"bytes": dict(rep.bytes), "total_bytes": rep.model_state_bytes,
                          "total_params": rep.total_params, "bytes_per_param": dict(rep.bytes_per_param)}

    def figures(self) -> dict[str, Any]:
        return {"losses": self.losses, "lrs": self.lrs, "times": self.times, "eval_losses": self.eval_losses,
                "peak_mib": peak_memory_mib(self.device), "comm": self.counter.counts.to_dict(), "state": self.state}


def run_cell(cell: Cell) -> dict[str, Any] | None:
    """Run ``cell`` in this rank (call it in every rank); rank 0 returns the cell's figures, the others None.
    Steps ``TIMING_WARMUP`` .. ``steps - 2`` are timed; the last, slowed by its :class:`CommCounter`, is counted. A
    "vs-raw" cell trains both models in the same processes, alternating which goes first, so both see one load."""
    from ..train.data.job import JobBatches, eval_steps, load_job_corpus

    warnings.filterwarnings("ignore", category=UserWarning)
    device = _init_process_group(cell)
    rank, world = rank_world()
    if device.type == "cpu":
        share_cpu_threads()
    text = cell.text
    corpus = load_job_corpus(text, None, progress=False) if text is not None else None  # the parent cached it
    batches = JobBatches(corpus, batch_size=cell.batch_size * world, seq_len=cell.seq_len, seed=cell.seed,
                         rank=rank, world_size=world, eval_batches=text.eval_batches if text else None)
    runs = [_Run(cell, "fp8dist", device, batches)] + \
        ([_Run(cell, "raw", device, batches)] if cell.wiring == "vs-raw" else [])
    evaluate_after = set(eval_steps(cell.steps, text.eval_every)) if text and cell.wiring == "fp8dist" else set()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(cell.steps):
        ids = batches.take(step).to(device)
        for run in (runs if step % 2 == 0 else runs[::-1]):
            run.step(step, ids)
        if step + 1 in evaluate_after:  # outside the timed step
            runs[0].eval_losses.append([step + 1, batches.evaluate(runs[0].model, device)])
    gathered = all_ranks_values([run.figures() for run in runs])  # [rank][run]
    if rank != 0:
        return None
    figures = [_combine(cell, [g[i] for g in gathered], run, world, device) for i, run in enumerate(runs)]
    result = {**cell.to_dict(), **figures[0]}
    if cell.wiring == "vs-raw":
        result["raw"] = figures[1]
        result["peak_memory_mib"] = None  # two models in one process: memory belongs to the plain cells
    return result


def _combine(cell: Cell, ranks: list[dict[str, Any]], run: _Run, world: int,
             device: torch.device) -> dict[str, Any]:
    """One run's figures over the ranks: losses averaged, each step as slow as its slowest rank."""
    losses = [sum(r["losses"][s] for r in ranks) / world for s in range(cell.steps)]
    times = [max(r["times"][s] for r in ranks) for s in range(cell.steps)]
    median = statistics.median(times[TIMING_WARMUP:cell.steps - 1])
    tokens = cell.batch_size * world * cell.seq_len
    fp8_layers, fp8_params = run.wired.fp8_layers
    return {"world_size": world, "device": device.type, "params": run.params, "fp8_layers": fp8_layers,
            "fp8_params": fp8_params, "losses": losses, "lrs": ranks[0]["lrs"],
            "step_times_s": times, "timed_steps": [TIMING_WARMUP, cell.steps - 2],
            "median_step_s": median, "tokens_per_step": tokens, "tokens_per_s": tokens / median,
            "peak_memory_mib": [r["peak_mib"] for r in ranks],
            "memory_kind": "cuda_max_allocated" if device.type == "cuda" else "peak_rss",
            "comm_step": cell.steps - 1, "comm": ranks[0]["comm"], "comm_per_rank": [r["comm"] for r in ranks],
            "model_state": ranks[0]["state"] or None,
            "model_state_per_rank": [r["state"] for r in ranks] if ranks[0]["state"] else None,
            "predicted": run.wired.predicted, "eval_losses": ranks[0]["eval_losses"]}
