"""The one config schema: every default of fp8dist's wrapping is defined here, once.

Python keyword options (``wrap_model(m, strategy="fsdp", reduce_dtype="bf16")``), a YAML/JSON file and the
``fp8dist`` CLI flags all land in these dataclasses. Every key is a field name; a bad value raises ValueError
naming the field, the value and the choices.

Example::

    cfg = resolve_config("fp8dist.yaml", strategy="fsdp1")     # file, then keyword overrides
    cfg.parallel.param_dtype                                    # 'bf16'
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Mapping

from ._schema import normalize_fields, route_keys
from .accelerate_config import translate_accelerate_config
from .dtypes import DTYPE_ALIASES, torch_dtype

__all__ = [
    "StrategyConfig",
    "FP8Config",
    "Config",
    "resolve_config",
    "load_config_file",
    "torch_dtype",
]

Strategy = Literal["none", "ddp", "fsdp", "fsdp1", "deepspeed"]
DtypeName = Literal["fp32", "bf16", "fp16"]
FP8BackendName = Literal["te", "torchao", "msamp"]
Device = Literal["auto", "cpu", "cuda"]


def _only(**allowed: tuple[Any, ...]) -> dict[str, Any]:
    """Field metadata: the field is read only when every named key has one of the given values."""
    return {"only": allowed}


_DTYPE = {"aliases": DTYPE_ALIASES}


@dataclass(kw_only=True, frozen=True)
class StrategyConfig:
    """How the model is replicated or sharded, and the mixed precision of the strategy."""

    strategy: Strategy = "fsdp"
    """How the model is spread over ranks: none (one process), ddp, fsdp (FSDP2 fully_shard), fsdp1
    (FullyShardedDataParallel) or deepspeed (ZeRO)."""

    param_dtype: DtypeName = field(default="bf16", metadata=_DTYPE)
    """Dtype of forward/backward compute. FSDP casts the gathered parameters to it; ddp and none keep fp32
    parameters and run the forward under autocast to it. fp16 needs loss scaling: strategy deepspeed only."""

    reduce_dtype: DtypeName = field(default="fp32", metadata={**_DTYPE, **_only(strategy=("ddp", "fsdp", "fsdp1",
                                                                                       "deepspeed"))})
    """Dtype in which gradients are reduced across ranks. Under ddp, bf16/fp16 use DDP's compression hooks,
    which need NCCL (CUDA)."""

    buffer_dtype: DtypeName = field(default="fp32", metadata=_DTYPE)
    """Dtype of floating-point buffers (e.g. rotary inv_freq); fp32 keeps Llama-style models accurate."""

    block_classes: tuple[str, ...] = field(default=(), metadata=_only(strategy=("fsdp", "fsdp1")))
    """Class names of the blocks FSDP shards one by one before the root. Empty: Hugging Face
    _no_split_modules, else the children of the largest nn.ModuleList."""

    reshard_after_forward: bool = field(default=True, metadata=_only(strategy=("fsdp", "fsdp1")))
    """FSDP: free each block's gathered parameters after forward (ZeRO-3 style). False keeps them until backward
    (ZeRO-2 style: more memory, less communication). FSDP2's root module (embeddings, output layer) always keeps
    them: backward needs them first."""

    device: Device = "auto"
    """Where the model runs: auto picks cuda:LOCAL_RANK when CUDA is available, else cpu."""

    zero_stage: Literal[1, 2, 3] = field(default=2, metadata=_only(strategy=("deepspeed",)))
    """DeepSpeed ZeRO stage: 1 (optimizer states partitioned), 2 (+ gradients), 3 (+ parameters)."""

    micro_batch_size: int = field(default=1, metadata=_only(strategy=("deepspeed",)))
    """DeepSpeed train_micro_batch_size_per_gpu (sequences per rank per forward)."""

    grad_accum: int = field(default=1, metadata=_only(strategy=("deepspeed",)))
    """DeepSpeed gradient_accumulation_steps."""

    gradient_clipping: float = field(default=1.0, metadata=_only(strategy=("deepspeed",)))
    """DeepSpeed gradient clipping (max global norm); 0 turns it off."""

    offload_optimizer: bool = field(default=False, metadata=_only(strategy=("deepspeed",)))
    """DeepSpeed: keep optimizer states on the CPU."""

    offload_param: bool = field(default=False, metadata=_only(strategy=("deepspeed",), zero_stage=(3,)))
    """DeepSpeed ZeRO-3: keep parameters on the CPU."""

    ds_config: str | None = field(default=None, metadata=_only(strategy=("deepspeed",)))
    """Path to your own DeepSpeed json: its values win; fp8dist fills only the keys it lacks."""

    def __post_init__(self) -> None:
        blocks = self.block_classes  # classes are taken by name
        if isinstance(blocks, type):
            blocks = (blocks,)
        if isinstance(blocks, (list, tuple, set, frozenset)):
            object.__setattr__(self, "block_classes",
                               tuple(b.__name__ if isinstance(b, type) else b for b in blocks))
        normalize_fields(self)
        for name in ("micro_batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        if self.gradient_clipping < 0:
            raise ValueError(f"gradient_clipping={self.gradient_clipping} must be >= 0 (0 turns clipping off).")


@dataclass(kw_only=True, frozen=True)
class FP8Config:
    """Which FP8 backend is layered on top of the strategy, and its knobs. Knobs of other backends are
    reported when set, never silently ignored."""

    fp8: FP8BackendName | None = None
    """FP8 backend: te (Transformer Engine), torchao (float8 training) or msamp (MS-AMP); none keeps the
    strategy's mixed precision everywhere."""

    on_unsupported: Literal["error", "fallback"] = "error"
    """When the backend is not installed or the hardware has no FP8: error, or fallback to the strategy's
    mixed precision (one warning; the plan says so)."""

    fp8_exclude: tuple[str, ...] = ()
    """Module names (fnmatch patterns, e.g. "lm_head" or "*.mlp.*") kept in the strategy's mixed precision."""

    keep_first_last_linear: bool = field(default=True, metadata=_only(fp8=("torchao",)))
    """torchao: keep the first and the last nn.Linear in high precision (they are the most sensitive)."""

    torchao_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = field(
        default="tensorwise", metadata=_only(fp8=("torchao",)))
    """torchao scaling recipe: tensorwise (fastest; FP8 all-gather under FSDP2), rowwise (more accurate), or
    rowwise_with_gw_hp (rowwise, weight gradient in high precision)."""

    fp8_all_gather: bool | None = field(default=None, metadata=_only(fp8=("torchao",), strategy=("fsdp",)))
    """torchao under FSDP2: all-gather weights in FP8 (half the bytes of bf16). none: on for tensorwise,
    off for rowwise recipes (torchao supports it for tensorwise only)."""

    te_recipe: Literal["delayed", "current", "mxfp8"] = field(default="delayed", metadata=_only(fp8=("te",)))
    """Transformer Engine recipe: delayed (DelayedScaling, amax history), current (Float8CurrentScaling) or
    mxfp8 (MXFP8BlockScaling, Blackwell)."""

    fp8_format: Literal["E4M3", "HYBRID"] = field(default="HYBRID", metadata=_only(fp8=("te",)))
    """TE FP8 format: HYBRID (E4M3 forward, E5M2 gradients) or E4M3 everywhere."""

    margin: int = field(default=0, metadata=_only(fp8=("te",), te_recipe=("delayed",)))
    """TE delayed scaling: scale = (fp8 max / amax) / 2^margin."""

    interval: int = field(default=1, metadata=_only(fp8=("te",), te_recipe=("delayed",)))
    """TE delayed scaling: steps between scale updates. Accepted for Accelerate compatibility; TE 2.x ignores
    it (a warning says so when it is not 1)."""

    amax_history_len: int = field(default=1024, metadata=_only(fp8=("te",), te_recipe=("delayed",)))
    """TE delayed scaling: length of the amax history window."""

    amax_compute_algo: Literal["max", "most_recent"] = field(
        default="max", metadata=_only(fp8=("te",), te_recipe=("delayed",)))
    """TE delayed scaling: amax from the history's max or its most recent value (TE's default is max)."""

    override_linear_precision: tuple[bool, bool, bool] = field(
        default=(False, False, False), metadata=_only(fp8=("te",), te_recipe=("delayed",)))
    """TE delayed scaling: run (fprop, dgrad, wgrad) GEMMs in higher precision instead of FP8."""

    use_autocast_during_eval: bool = field(default=False, metadata=_only(fp8=("te",)))
    """TE: keep FP8 autocast in eval mode (off by default: evaluate in the strategy's precision)."""

    opt_level: Literal["O1", "O2", "O3"] = field(default="O2", metadata=_only(fp8=("msamp",)))
    """MS-AMP: O1 (FP8 weights and gradients), O2 (plus FP8/FP16 optimizer states), O3 (ZeRO, DeepSpeed only)."""

    def __post_init__(self) -> None:
        if isinstance(self.fp8_format, str) and self.fp8_format.upper() == "E5M2":
            raise ValueError("fp8_format='E5M2' is not supported: E5M2 alone lacks the precision forward "
                             "activations and weights need. Choose 'HYBRID' (E4M3 forward, E5M2 gradients) or "
                             "'E4M3'.")
        normalize_fields(self)
        for name, low in (("margin", 0), ("interval", 1), ("amax_history_len", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be at least {low}.")


_SECTIONS = {"parallel": StrategyConfig, "precision": FP8Config}


def _check_combination(parallel: StrategyConfig, precision: FP8Config) -> None:
    """Cross-section rules: combinations no engine supports are errors naming what works instead."""
    strategy, fp8 = parallel.strategy, precision.fp8
    if parallel.param_dtype == "fp16" and strategy != "deepspeed":
        raise ValueError(f"param_dtype='fp16' with strategy={strategy!r}: fp16 compute needs loss scaling, which "
                         "fp8dist does not add to your training loop, and without it small gradients underflow to "
                         "zero silently. Use param_dtype='bf16' (no scaling needed; every FP8 GPU has it), or "
                         "strategy='deepspeed', whose fp16 mode scales the loss dynamically.")
    if fp8 == "msamp" and strategy in ("fsdp", "fsdp1"):
        raise ValueError(f"fp8='msamp' with strategy={strategy!r}: MS-AMP has no FSDP integration here. Use "
                         "strategy='ddp' or 'none' with MS-AMP, 'deepspeed' for MS-AMP with ZeRO, or "
                         "fp8='torchao' / 'te' with FSDP.")
    if parallel.offload_param and parallel.zero_stage != 3 and strategy == "deepspeed":
        raise ValueError(f"offload_param=True with zero_stage={parallel.zero_stage}: only ZeRO-3 partitions "
                         "parameters. Use zero_stage=3 or offload_optimizer=True.")
    if fp8 == "msamp" and precision.opt_level == "O3" and strategy != "deepspeed":
        raise ValueError(f"opt_level='O3' with strategy={strategy!r}: MS-AMP O3 is its ZeRO optimizer and runs only "
                         "under strategy='deepspeed'. Use opt_level='O1' or 'O2'.")
    if (fp8 == "torchao" and precision.torchao_recipe == "rowwise_with_gw_hp" and strategy in ("none", "ddp")
            and parallel.param_dtype != "fp32"):
        raise ValueError(f"torchao_recipe='rowwise_with_gw_hp' with strategy={strategy!r} and param_dtype="
                         f"{parallel.param_dtype!r}: its high-precision weight-gradient GEMM mixes the autocast dtype "
                         "with fp32 and fails (torchao 0.18). Use strategy='fsdp' or 'fsdp1' (no autocast), "
                         "torchao_recipe='rowwise', or param_dtype='fp32'.")
    if precision.fp8_all_gather and precision.torchao_recipe != "tensorwise":
        raise ValueError(f"fp8_all_gather=True with torchao_recipe={precision.torchao_recipe!r}: torchao all-gathers "
                         "in FP8 only with the tensorwise recipe. Use torchao_recipe='tensorwise' or leave "
                         "fp8_all_gather unset.")


@dataclass(kw_only=True, frozen=True)
class Config:
    """Everything ``wrap_model`` needs, by concern. Keys are flat: each is a field of one section."""

    parallel: StrategyConfig = field(default_factory=StrategyConfig)
    """Strategy and its mixed precision."""

    precision: FP8Config = field(default_factory=FP8Config)
    """FP8 backend and its knobs."""

    def __post_init__(self) -> None:
        _check_combination(self.parallel, self.precision)

    def to_dict(self) -> dict[str, Any]:
        """Flat ``{key: value}`` dict, the same keys a YAML file and ``wrap_model`` take."""
        flat: dict[str, Any] = {}
        for name in _SECTIONS:
            flat.update(asdict(getattr(self, name)))
        return {k: list(v) if isinstance(v, tuple) else v for k, v in flat.items()}

    def unused_options(self) -> list[str]:
        """Messages for options changed from their default that the chosen strategy / backend does not read."""
        values = self.to_dict()
        notes = []
        for section in _SECTIONS.values():
            for f in fields(section):
                only = f.metadata.get("only")
                default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
                if not only or values[f.name] == (list(default) if isinstance(default, tuple) else default):
                    continue
                unmet = {k: v for k, v in only.items() if values[k] not in v}
                if unmet:
                    needs = " and ".join(f"{k} in {list(v)}" for k, v in only.items())
                    notes.append(f"{f.name}={values[f.name]!r} has no effect here (read only when {needs}; "
                                 + ", ".join(f"{k}={values[k]!r}" for k in unmet) + ").")
        return notes

    @classmethod
    def from_dict(cls, flat: Mapping[str, Any], *, source: str = "config") -> "Config":
        """Build from flat keys; unknown keys and bad values raise ValueError."""
        routed = route_keys(flat, _SECTIONS.values(), source=source)
        return cls(**{name: section(**routed[section]) for name, section in _SECTIONS.items()})


def _read_config_text(path: Path) -> Any:
    """The file parsed as JSON (``.json``) or YAML, None when empty; a syntax error names the file, the line and
    the column."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    if not text.strip():
        return None
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"config file {str(path)!r} is not valid JSON: line {err.lineno}, column {err.colno}: "
                             f"{err.msg}.") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark, context, start = (getattr(err, name, None) for name in ("problem_mark", "context", "context_mark"))
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())  # one line
        if context and start is not None:  # where the unfinished construct began ("while scanning a quoted scalar")
            problem += f" ({context} at line {start.line + 1}, column {start.column + 1})"
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {where}{problem}.") from None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON file into a flat dict (not validated yet); the keys of a file written by
    ``accelerate config`` are translated (:mod:`fp8dist.accelerate_config`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is empty, not valid YAML/JSON (naming the line and column) or not a mapping, or an
            Accelerate key or value has no fp8dist equivalent.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist.")
    data = _read_config_text(path)
    if data is None:  # nothing, or only comments
        raise ValueError(f"config file {str(path)!r} is empty: write at least one key (e.g. strategy: fsdp), or "
                         "pass no config file.")
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of keys to values, got {type(data).__name__}.")
    return translate_accelerate_config(data, source=str(path))


def resolve_config(config: "Config | Mapping[str, Any] | str | Path | None" = None, **overrides: Any) -> Config:
    """Merge a base config (Config, flat dict, or YAML/JSON path) with keyword overrides and validate.

    Args:
        config: the base; None means all defaults.
        **overrides: flat keys (``strategy="fsdp1"``, ``param_dtype="bf16"``); they win over ``config``.

    Returns:
        A validated :class:`Config`.
    """
    source = "wrap_model options"
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, Config):
        base = config.to_dict()
    elif isinstance(config, (str, Path)):
        base = load_config_file(config)
        source = str(config)
    elif isinstance(config, Mapping):
        base = translate_accelerate_config(config)
    else:
        raise TypeError(f"config must be a Config, a dict or a path to a YAML/JSON file, got {type(config).__name__}.")
    base_cfg = Config.from_dict(base, source=source)
    merged = {**base_cfg.to_dict(), **overrides}
    return Config.from_dict(merged, source="wrap_model options")
