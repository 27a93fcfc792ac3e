"""The options a user sets, each default written once: :class:`StrategyConfig` (the strategy and its mixed precision)
and :class:`FP8Config` (the FP8 backend, and each backend's knobs from its own module)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Annotated, Any, Literal

from .axis import BACKENDS, LEVELS, STRATEGIES
from .schema import Choices, normalize_fields
from .dtypes import DTYPE_ALIASES

DEFAULT_SEQ_LEN = 2048
"""Tokens per sequence the plan and the estimate assume where ``seq_len`` is not given (and say so)."""

DEFAULT_MARGIN = 1.0
"""fp8_select_margin's default, and the speed model's: convert where the predicted speedup is at least this. 1.0: on
the published H100 table the model errs low near 1 (it misses gains of 1-8%, it converts nothing measured slower),
so a higher margin only drops real gains."""

FP4_TAIL_SHARE = 0.15
"""``keep_last_blocks_share``'s value where it is None and the recipe runs FP4 GEMMs: the last 15% of the blocks and
the output head stay in the strategy's precision (torchtitan's NVFP4 Llama3-8B on 4 B200s: 21,919 -> 30,040
tok/s)."""

__all__ = ["StrategyConfig", "FP8Config", "SECTIONS", "StrategyName", "DtypeName", "ReduceDtypeName", "FP8BackendName",
           "MemoryLevelName", "strategy_configs",
           "Device", "CheckpointingMode", "DEFAULT_SEQ_LEN", "FP4_TAIL_SHARE", "DEFAULT_MARGIN", "knob_configs"]

StrategyName = Annotated[str, Choices(STRATEGIES)]
"""The type of a ``strategy=`` option: a registered strategy's name (the schema checks it against
:data:`~fp8dist.config.axis.STRATEGIES`)."""
DtypeName = Literal["fp32", "bf16", "fp16"]
"""A dtype option's values (``param_dtype``, ``buffer_dtype``); other spellings are aliases (``bfloat16``,
``torch.bfloat16``: :data:`~fp8dist.config.dtypes.DTYPE_ALIASES`)."""
ReduceDtypeName = Literal["fp32", "bf16", "fp16", "fp8"]
"""``reduce_dtype``'s values: a :data:`DtypeName`, or fp8 (block-scaled e4m3 gradient reduction)."""
FP8BackendName = Annotated[str, Choices(BACKENDS)]
"""The type of ``fp8=``: a registered FP8 backend's name (checked against :data:`~fp8dist.config.axis.BACKENDS`)."""
MemoryLevelName = Annotated[str, Choices(LEVELS)]
"""The type of ``memory=``: a registered memory level's name (checked against :data:`~fp8dist.config.axis.LEVELS`)."""
Device = Literal["auto", "cpu", "cuda"]
"""``device=``'s values: auto (cuda:LOCAL_RANK where CUDA is available, else cpu), cpu or cuda."""
CheckpointingMode = Literal["none", "full", "selective"]
"""``activation_checkpointing``'s values: none, full (a block keeps only its input) or selective (it keeps its
attention and GEMM outputs too); recomputed in backward, per block."""
_DTYPE = {"aliases": DTYPE_ALIASES}


@dataclass(kw_only=True, frozen=True, init=False)
class StrategyConfig:
    """How the model is replicated or sharded, the mixed precision of the strategy, and each strategy's knobs (its
    ``Config``), given and read flat (``zero_stage=3``, ``cfg.parallel.zero_stage``) or as
    ``knobs("deepspeed").zero_stage``; a knob no chosen strategy reads is reported."""

    strategy: StrategyName = "fsdp"
    """How the model is spread over ranks: none (one process), ddp, fsdp (FSDP2 fully_shard), fsdp1
    (FullyShardedDataParallel) or deepspeed (ZeRO)."""

    param_dtype: DtypeName = field(default="bf16", metadata=_DTYPE)
    """Dtype of forward/backward compute: FSDP casts the gathered parameters to it, ddp and none autocast to it.
    fp16 needs loss scaling: strategy deepspeed only."""

    reduce_dtype: ReduceDtypeName = field(default="fp32", metadata=_DTYPE)
    """Dtype gradients are reduced in; under ddp, bf16/fp16 use DDP's compression hooks (NCCL only). fp8 (fsdp,
    ddp): each rank sends its gradients once as e4m3 blocks with fp32 scales (all-to-all), the owner sums them in
    fp32 (about half a bf16 reduction's bytes); HSDP's all-reduce across replicas stays fp32."""

    reduce_fp8_block: int = field(default=128, metadata={"min": 1})
    """reduce_dtype='fp8': gradient elements per fp32 scale. 128: the wire carries 0.516x a bf16 reduction's bytes;
    the small Llama's gradients keep 31.4 dB SQNR (256: 0.508x, 31.3 dB; 32: 0.563x, 31.7 dB)."""

    buffer_dtype: DtypeName = field(default="fp32", metadata=_DTYPE)
    """Dtype of floating-point buffers (rotary inv_freq): fp32 keeps Llama-style models accurate."""

    block_classes: tuple[str, ...] = ()
    """Class names of the blocks FSDP shards one by one, and activation checkpointing and compile wrap. Empty:
    Hugging Face _no_split_modules, else the children of the largest nn.ModuleList."""

    activation_checkpointing: CheckpointingMode = "none"
    """Recompute activations in backward, per block: none; full (a block keeps only its input); selective
    (torchtitan's "op" mode: a block keeps its input, its attention outputs and every other GEMM output, in forward
    order; fp8dist.pipeline.blocks.SELECTIVE_GEMMS)."""

    compile: bool | None = field(default=None, metadata={"none": "auto, the default"})
    """torch.compile each block in place (state-dict keys unchanged). None (auto): on where FP8 runs on a CUDA GPU,
    else off (on a CPU it costs more than it saves)."""

    device: Device = "auto"
    """Where the model runs: auto is cuda:LOCAL_RANK when CUDA is available, else cpu."""

    micro_batch_size: int = field(default=1, metadata={"min": 1})
    """Sequences per rank per forward (DeepSpeed's train_micro_batch_size_per_gpu); with seq_len, the tokens
    fp8_select predicts at. fp8dist train and bench set it."""

    seq_len: int | None = field(default=None, metadata={"none": f"{DEFAULT_SEQ_LEN} assumed, said in the plan"})
    """Tokens per sequence, for fp8_select's prediction with micro_batch_size. None: 2048 assumed, and the plan
    says so. fp8dist train and bench set it."""

    grad_accum: int = field(default=1, metadata={"cli_aliases": ("--gradient-accumulation-steps",), "min": 1})
    """Micro-batches per optimizer step (DeepSpeed's gradient_accumulation_steps); fp8dist train accumulates under
    every strategy, your own loop with fp8dist.no_sync."""

    gradient_clipping: float = field(default=1.0, metadata={"cli_aliases": ("--max-grad-norm",)})
    """Largest global gradient norm (0: no clipping; DeepSpeed's gradient_clipping); fp8dist train clips under
    every strategy, your own loop with fp8dist.clip_grad_norm_."""

    strategy_knobs: tuple[Any, ...] = field(default=(), metadata={"nested": lambda: strategy_configs().values()})
    """One instance of each registered strategy's ``Config`` (each class once: fsdp and fsdp1 share FSDP's), in the
    registry's order."""

    memory: MemoryLevelName = "standard"
    """Model-state memory level. standard: fp32 master weights, your optimizer. lean (MS-AMP O2 class, ~6 bytes per
    parameter): bf16 weights with no master, updated with stochastic rounding; 8-bit AdamW states (torchao
    AdamWFp8 on FP8 GPUs, AdamW8bit elsewhere); bf16 gradients, reduced in bf16. wrap_model builds the optimizer
    (optimizer={"type": "AdamW", "lr": ...}). Strategies fsdp, ddp and none."""

    nonfinite_step: Literal["skip", "error", "off"] = "skip"
    """A step whose gradients hold an inf or NaN on any rank: skip (no update on any rank, weights and optimizer
    state as before; a warning names the step and modules; get_wrap_info(model).skipped_steps counts them), error
    (raise, nothing updated), off (no check: the weights turn NaN). Under DeepSpeed, skip and off set its own check;
    fp8dist counts, warns and stops the same way."""

    max_skipped_steps: int = 5
    """Consecutive skipped steps after which the run raises, naming the modules and the way out; 0: never."""

    check_ranks: Literal["all", "settings", "off"] = "all"
    """What wrap_model compares across ranks (one all-gather), failing on every rank naming what differs: all
    (settings, plan, model structure and weights, unless the strategy copies rank 0's, ddp and deepspeed, or they
    are not loaded yet: meta models, pretrained=); settings (weights may differ on purpose); off."""

    pretrained: str | None = None
    """A Hugging Face model directory (model.safetensors, or shards + index) loaded into the wrapped model, each rank
    reading only its part (a meta model allocates only that); none: the model keeps its weights."""

    def __init__(self, *, strategy_knobs: Iterable[Any] = (), **options: Any) -> None:
        """Every option by its flat name (a strategy's knob too: ``zero_stage=3``); ``strategy_knobs``: Config
        instances to start from (``dataclasses.replace`` passes them back). Raises TypeError for an unknown keyword,
        ValueError for a bad value (naming it and the choices)."""
        given = {type(knobs): knobs for knobs in strategy_knobs}
        for f in (f for f in fields(StrategyConfig) if not f.metadata.get("nested")):
            object.__setattr__(self, f.name, options.pop(f.name, f.default))
        built = []
        for cls in strategy_configs().values():  # each class once, its knobs taken by their flat names
            mine = {f.name: options.pop(f.name) for f in fields(cls) if f.name in options}
            built.append(replace(given[cls], **mine) if cls in given else cls(**mine))
        if options:
            raise TypeError(f"StrategyConfig got unexpected keyword arguments {sorted(options)}")
        object.__setattr__(self, "strategy_knobs", tuple(built))
        blocks = (self.block_classes,) if isinstance(self.block_classes, type) else self.block_classes  # by name
        if isinstance(blocks, (list, tuple, set, frozenset)):
            object.__setattr__(self, "block_classes",
                               tuple(b.__name__ if isinstance(b, type) else b for b in blocks))
        if isinstance(self.pretrained, os.PathLike):
            object.__setattr__(self, "pretrained", os.fspath(self.pretrained))
        normalize_fields(self)  # each strategy's knobs too, with their minimums
        if self.max_skipped_steps < 0:
            raise ValueError(f"max_skipped_steps={self.max_skipped_steps} must be 0 (never stop) or more.")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValueError(f"seq_len={self.seq_len} must be a positive integer (tokens per sequence), or none "
                             f"({DEFAULT_SEQ_LEN} assumed).")
        if not 0 <= self.gradient_clipping < float("inf"):  # nan fails this too
            raise ValueError(f"gradient_clipping={self.gradient_clipping} must be a finite number >= 0 (0 turns "
                             "clipping off).")

    def knobs(self, strategy: str) -> Any:
        """Strategy ``strategy``'s ``Config`` instance (the defaults if it registered after this config); None: the
        strategy has no knobs of its own. Example: ``cfg.parallel.knobs("deepspeed").zero_stage``."""
        cls = STRATEGIES.attribute(strategy, "Config")
        return None if cls is None else next((k for k in self.strategy_knobs if type(k) is cls), None) or cls()

    def __getattr__(self, name: str) -> Any:
        """A strategy's knob by its flat name (``cfg.parallel.zero_stage``), read-only; AttributeError for a name
        no strategy's Config has."""
        for knobs in self.__dict__.get("strategy_knobs", ()):  # else a strategy registered since: its default
            if name in knobs.__dataclass_fields__:
                return getattr(knobs, name)
        owner = next((s for s, cls in strategy_configs().items() if name in cls.__dataclass_fields__), None)
        if owner is None or "strategy_knobs" not in self.__dict__:  # (not yet built: unpickling)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.knobs(owner), name)


@dataclass(kw_only=True, frozen=True, init=False)
class FP8Config:
    """The FP8 backend on top of the strategy, what every backend shares, and each backend's knobs (its ``Config``),
    given and read flat (``te_recipe=``) or as ``knobs("te").te_recipe``; a knob of another backend is reported."""

    fp8: FP8BackendName | None = None
    """FP8 backend: te (Transformer Engine), torchao (float8 training) or msamp (MS-AMP); none keeps the
    strategy's mixed precision everywhere."""

    on_unsupported: Literal["error", "fallback"] = "error"
    """Where the backend is not installed or the hardware has no FP8: error, or fallback to the strategy's mixed
    precision (one warning)."""

    fp8_exclude: tuple[str, ...] = ()
    """Module names (fnmatch patterns, e.g. "lm_head" or "*.mlp.*") kept in the strategy's mixed precision."""

    fp8_select: Literal["auto", "all"] | None = field(default=None, metadata={"none": "auto on a GPU, all on a CPU"})
    """Which eligible layers run in FP8: auto, those the speed model predicts faster than bf16 on the plan's GPU
    (by fp8_select_margin); all. None: auto on a CUDA GPU (or --target), all on a CPU. fp8_exclude, fp8_filter and
    keep_first_last_linear apply on top."""

    fp8_select_margin: float = DEFAULT_MARGIN
    """fp8_select auto: the least predicted speedup over bf16 for a layer to run in FP8 (1.0: any gain)."""

    keep_last_blocks_share: float | None = field(
        default=None, metadata={"none": f"{FP4_TAIL_SHARE:g} under FP4 recipes, else 0"})
    """Share of the last transformer blocks kept, with the output head, in the strategy's mixed precision (rounded
    up to whole blocks), as torchtitan's NVFP4 Llama3-8B run does. None: 0.15 where the recipe runs FP4 GEMMs
    (te/torchao_recipe='nvfp4'), else 0: FP8 recipes train well with the first and last Linear kept alone
    (keep_first_last_linear)."""

    backend_knobs: tuple[Any, ...] = field(default=(), metadata={"nested": lambda: knob_configs().values()})
    """One instance of each registered backend's ``Config``, in the registry's order."""

    def __init__(self, *, backend_knobs: Iterable[Any] = (), **options: Any) -> None:
        given = {type(knobs): knobs for knobs in backend_knobs}  # dataclasses.replace passes them back
        for f in (f for f in fields(FP8Config) if not f.metadata.get("nested")):
            object.__setattr__(self, f.name, options.pop(f.name, f.default))
        built = []
        for cls in knob_configs().values():
            mine = {f.name: options.pop(f.name) for f in fields(cls) if f.name in options}
            built.append(replace(given[cls], **mine) if cls in given else cls(**mine))
        if options:
            raise TypeError(f"FP8Config got unexpected keyword arguments {sorted(options)}")
        object.__setattr__(self, "backend_knobs", tuple(built))
        normalize_fields(self)  # each backend's knobs too, with their refusals and minimums
        if not 0 < self.fp8_select_margin < float("inf"):  # nan fails this too
            raise ValueError(f"fp8_select_margin={self.fp8_select_margin} must be a finite number > 0: the speedup "
                             f"over bf16 a layer must reach to run in FP8 ({DEFAULT_MARGIN}: any predicted gain).")
        share = self.keep_last_blocks_share
        if share is not None and not 0 <= share < 1:  # nan fails this too
            raise ValueError(f"keep_last_blocks_share={share} must be a share of the blocks, from 0 (none) to below 1 "
                             f"({FP4_TAIL_SHARE:g}: the last {FP4_TAIL_SHARE:.0%} and the output head), or none "
                             f"({FP4_TAIL_SHARE:g} under FP4 recipes, else 0).")

    def knobs(self, backend: str) -> Any:
        """Backend ``backend``'s ``Config`` (the defaults if it registered after this config); None: none."""
        cls = BACKENDS.attribute(backend, "Config")
        return None if cls is None else next((k for k in self.backend_knobs if type(k) is cls), None) or cls()

    def __getattr__(self, name: str) -> Any:
        """A backend's knob by its flat name (``cfg.precision.te_recipe``), read-only."""
        for knobs in self.__dict__.get("backend_knobs", ()):  # else a backend registered since: its default
            if name in knobs.__dataclass_fields__:
                return getattr(knobs, name)
        owner = next((b for b, cls in knob_configs().items() if name in cls.__dataclass_fields__), None)
        if owner is None or "backend_knobs" not in self.__dict__:  # (not yet built: unpickling)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.knobs(owner), name)


def knob_configs() -> dict[str, type]:
    """Each registered FP8 backend's nested ``Config`` dataclass, by backend name (backends without knobs left
    out); the config schema reads it to route flat keys (``te_recipe=...``) to their backend.

    Raises:
        ValueError: a backend's knob has the name of another option (a strategy or FP8 option, or another backend's
            knob): every knob is also a flat key.
    """
    owners = {f.name: cls.__name__ for cls in (StrategyConfig, FP8Config) for f in fields(cls)}
    owners.update({f.name: f"strategy={name!r}'s Config" for name, cls in strategy_configs().items()
                   for f in fields(cls) if f.name not in owners})
    out = {name: BACKENDS.attribute(name, "Config") for name in BACKENDS}
    out = {name: cls for name, cls in out.items() if cls is not None}
    for name, f in ((name, f) for name, cls in out.items() for f in fields(cls)):
        if owners.setdefault(f.name, f"fp8={name!r}'s Config") != f"fp8={name!r}'s Config":
            raise ValueError(f"fp8={name!r}: its knob {f.name!r} is already {owners[f.name]}'s option, and every "
                             "knob is a flat key: rename it (e.g. with the backend's name in front).")
    return out


def strategy_configs() -> dict[str, type]:
    """Each registered strategy's ``Config``, by strategy name, a class shared by strategies listed once (under the
    first); a knob whose flat key is another option or another class's knob is refused (ValueError)."""
    owners = {f.name: cls.__name__ for cls in (StrategyConfig, FP8Config) for f in fields(cls)}
    out: dict[str, type] = {}
    for name in STRATEGIES:
        cls = STRATEGIES.attribute(name, "Config")
        if cls is None or cls in out.values():
            continue
        for f in fields(cls):
            if owners.setdefault(f.name, f"strategy={name!r}'s Config") != f"strategy={name!r}'s Config":
                raise ValueError(f"strategy={name!r}: its knob {f.name!r} is already {owners[f.name]}'s option, and "
                                 "every knob is a flat key: rename it (e.g. with the strategy's name in front).")
        out[name] = cls
    return out


SECTIONS = {"parallel": StrategyConfig, "precision": FP8Config}
"""A :class:`~fp8dist.config.resolve.Config`'s sections by attribute (``cfg.parallel``, ``cfg.precision``): the
classes a flat option is routed to."""
