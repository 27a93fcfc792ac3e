"""The interface of an FP8 backend (:class:`FP8Backend`) and what every backend shares: the records of its
wiring, the steps it hands a strategy, the eligibility checks of a Linear and of the hardware."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from ..config.axis import Rule, StrategyFacts, When
from ..runtime.hardware import Hardware, hardware_of
from .casts import Casts
from .conv1d import conv1d_dims, is_conv1d
from .linear import plain_linear_reason
from .speed_recipe import Recipe

__all__ = ["FP8Backend", "FP8Wiring", "EngineHooks", "HandConverted", "FrozenWeights", "NO_FP8", "SELECTION_OPTIONS",
           "dims_reason", "linear_reason", "fp8_hardware_reason"]

SELECTION_OPTIONS: Mapping[str, When] = {"fp8_select": When(), "micro_batch_size": When(), "seq_len": When(),
                                         "fp8_select_margin": When({"fp8_select": (None, "auto")})}
"""The ``options`` the plan's choice of FP8 layers by predicted speed reads, in every backend the speed model covers."""


@dataclass(frozen=True)
class FP8Wiring:
    """What a backend did to the sharded model after conversion, as data (``WrapInfo.fp8``)."""

    autocast_recipe: Any = None
    """The recipe the forward runs under (Transformer Engine), or None."""
    amax_group: Any = None
    """The process group FP8 amax is reduced over, or None."""
    scale_precompute: bool = False
    """FP8 weight scales are recomputed after every optimizer step (torchao's FP8 all-gather)."""


@dataclass(frozen=True)
class EngineHooks:
    """A backend's own steps inside the strategy's sharding, handed over as data (the strategy runs them)."""

    prepare: Callable[[nn.Module], tuple[nn.Module, Any]] | None = None
    """On the filled, unwrapped model before the engine wraps it; returns the model and the optimizer it built."""
    entry: tuple[Mapping[str, Any], Callable[..., Any]] | None = None
    """``(extra engine config, initialize)``: the backend's entry into an engine that builds the optimizer (MS-AMP)."""


@dataclass(frozen=True)
class HandConverted:
    """What :attr:`FP8Backend.convert_by_hand` did, and each hand-wired step's calls beyond forward, backward, step."""

    layers: int = 0
    """FP8 GEMM layers swapped in."""
    params: int = 0
    """Their weight parameters."""
    after_step: Callable[[], None] = lambda: None
    """After each optimizer step (torchao's scale precompute)."""
    forward_context: Callable[[], Any] = contextlib.nullcontext
    """Around each forward (Transformer Engine's autocast)."""


@dataclass(frozen=True)
class FrozenWeights:
    """What a converted Linear's frozen weight (a LoRA base) costs under a backend; default: as a trainable one."""

    cached_bytes: int = 0
    """Bytes per element a rank holds (its shard where sharded) of the FP8 copy cast once and kept; 0: none kept."""
    scale_bytes: int = 0
    """Bytes per such weight of the scale kept with that copy."""
    grad_weight_gemm: bool = True
    """The backward still runs the weight-gradient GEMM (autograd drops its result)."""
    how: str = "cast to FP8 every step, as a trainable weight"
    """One line for the plan and the report."""


class FP8Backend(Protocol):
    """The interface of an FP8 backend. Subclass it: the defaults are the no-ops of a backend without that step."""

    name: ClassVar[str]
    package: ClassVar[str | None] = None
    """The library whose modules the backend swaps in (found in a model given to ``wrap_model``: converted by hand)."""
    owns_optimizer: ClassVar[bool] = False
    """The backend builds the optimizer itself (in :attr:`EngineHooks.prepare`, from the optimizer spec)."""
    options: ClassVar[Mapping[str, When]] = {}
    """Options it reads beyond its ``Config``, each with the ``When`` it is read under (set but unread: reported)."""
    rules: ClassVar[tuple[Rule, ...]] = ()
    """What this backend refuses to combine with (its rows of the combination table)."""
    takes_amax_group: ClassVar[bool] = False
    """The backend reduces FP8 amax over a process group the user may choose (``fp8_group=``)."""
    meta_model_refusal: ClassVar[str | None] = None
    """Why the backend cannot convert a meta-device model; None: it can."""

    def describe(self, cfg: Any, facts: StrategyFacts) -> str:
        """One line for the plan header (recipe, knobs) under a strategy with ``facts``."""
        return ""

    def missing_reason(self, cfg: Any) -> str | None:
        """Why the backend's library cannot be used on this machine (not installed); None when it can."""
        return None

    def hardware_reason(self, cfg: Any, hardware: Hardware) -> str | None:
        """Why the backend cannot compute FP8 on ``hardware``; None when it can."""
        return fp8_hardware_reason(hardware)

    def unavailable_reason(self, cfg: Any, device: torch.device | Hardware, *, check_installed: bool = True) -> \
            str | None:
        """:meth:`missing_reason` (unless ``check_installed`` is False: planning for another machine), then
        :meth:`hardware_reason`; None when the backend can run on ``device``. Override those two."""
        return (check_installed and self.missing_reason(cfg)) or self.hardware_reason(cfg, hardware_of(device))

    def supports(self, module: nn.Module) -> bool:
        """Whether the backend replaces modules of this kind (any ``nn.Linear``: the plan judges each one)."""
        return isinstance(module, nn.Linear)

    def converted_class(self, module: nn.Module, cfg: Any, hardware: Hardware) -> str:
        """What the plan records as the module's replacement."""
        return type(module).__name__

    def computes_in_fp8(self, module: nn.Module) -> bool:
        """False for modules swapped without FP8 compute (TE's norms)."""
        return True

    def model_exclusions(self, model: nn.Module, cfg: Any) -> dict[str, str]:
        """Model-level rules: ``{fqn: reason}`` of modules kept in high precision (torchao's first/last Linear)."""
        return {}

    def ineligible_reason(self, module: nn.Module, fqn: str, cfg: Any, hardware: Hardware,
                          facts: StrategyFacts) -> str | None:
        """Per-layer rules: why this supported module cannot run FP8 on ``hardware`` under ``facts``, or None."""
        return linear_reason(module)

    def read_weight_gather(self, reader: str, cfg: Any, facts: StrategyFacts) -> str | None:
        """How an FP8 layer whose weight ``reader`` reads outside its GEMM (PEFT's DoRA weight norm) is all-gathered
        instead of the backend's FP8 all-gather, and why; None: as any other. The plan calls it per such layer under
        ``cfg`` and ``facts`` and records the answer as ``PlanEntry.high_precision_gather``."""
        return None

    def check_plan(self, plan: Any) -> None:
        """Refuse, before anything changes, a plan the backend cannot follow."""

    def convert(self, model: nn.Module, plan: Any, cfg: Any) -> None:
        """Swap exactly the plan's converted modules, in place (as planned for ``plan.hardware``); before sharding."""

    def engine_hooks(self, optimizer: Any, cfg: Any, facts: StrategyFacts) -> EngineHooks:
        """The backend's own steps inside the strategy's sharding (one that owns the optimizer builds it there)."""
        return EngineHooks()

    def after_shard(self, model: nn.Module, inner: nn.Module, plan: Any, cfg: Any, group: Any) -> FP8Wiring:
        """On the sharded model (FP8 autocast, hooks): ``model`` is what the strategy returned, ``inner`` the user's
        model inside it, ``group`` the amax reduction group (None: the world group). Returns what was done."""
        return FP8Wiring()

    # plan (speed model, numerics probe): what the plan's advisors ask of a backend, never testing its name
    speed_recipes: ClassVar[tuple[Recipe, ...]] = ()
    """The recipes this backend runs, as the speed model sees them (:class:`~fp8dist.fp8.speed_recipe.Recipe`: which
    GEMMs run in FP8, the cast kernels of each operand): its Linears' (``plan --compare-recipes`` compares them) and,
    ``grouped=True``, its MoE experts'. :meth:`speed_recipe` names the one a config runs. Empty: no speed model."""

    def speed_recipe(self, cfg: Any, hardware: Hardware, *, grouped: bool = False) -> tuple[str | None, str]:
        """``(recipe id, "")``: the speed model's recipe the Linears (``grouped``: the MoE experts) run on
        ``hardware``; ``(None, why not)``: no prediction, they convert as under ``fp8_select='all'``."""
        return None, f"fp8={self.name!r} has no speed model"

    def numerics_casts(self, cfg: Any, facts: StrategyFacts, hardware: Hardware, *, grouped: bool = False) -> Casts:
        """How the backend casts each operand of a layer's GEMMs (``grouped``: its MoE experts'): what the numerics
        probe emulates on a CPU. Raises NotImplementedError where the casts are not modelled."""
        raise NotImplementedError(f"fp8={self.name!r}: the numerics probe has no model of this backend's FP8 casts "
                                  f"({type(self).__name__}.numerics_casts is not implemented). Probe with "
                                  "fp8='torchao' or fp8='te'.")

    def numerics_note(self, cfg: Any) -> str:
        """What the probe's report says about how it emulated the backend's casts; empty: nothing to say."""
        return ""

    def mixed_recipes(self, cfg: Any, hardware: Hardware, facts: StrategyFacts) -> tuple[str, ...]:
        """The speed model's recipes the plan picks among per layer (the fastest predicted; the strategy's precision
        where none pays) when ``cfg`` asks for it: those the backend can run side by side in one model on
        ``hardware`` under ``facts``; the first is every eligible layer's where nothing is predicted (a CPU). Empty:
        one recipe for the model (:meth:`speed_recipe`)."""
        return ()

    def layer_config(self, cfg: Any, entry: Any) -> Any:
        """``cfg`` as the plan ``entry``'s layer runs: its own recipe (``PlanEntry.recipe``) in :attr:`variant_option`
        (``cfg`` itself where it has none); call it for each FP8 entry before converting, costing or probing it."""
        recipe = entry.recipe
        if recipe is None:
            return cfg
        return dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, **{self.variant_option: recipe}))

    accelerate_backend: ClassVar[str | None] = None
    """The value of Accelerate's ``fp8_config.backend`` that selects this backend ("TE"); None: none does."""

    # bench: what ``fp8dist bench`` asks of a backend
    variant_option: ClassVar[str | None] = None
    """An option whose every value the bench runs as a cell of its own (``torchao_recipe``); None: one cell."""
    convert_by_hand: ClassVar[Callable[..., HandConverted] | None] = None
    """``convert_by_hand(model, facts) -> HandConverted``: the default variant's conversion as the library's
    documentation wires it, the bench's reference for fp8dist's overhead. None: no hand-wired cell."""

    # checkpoint: what save_checkpoint / load_checkpoint ask of the backend
    checkpoint_refusal: ClassVar[str | None] = None
    """Why fp8dist's checkpoints cannot hold this backend's state yet, and the way out; None: they can."""
    extra_state: ClassVar[str | None] = None
    """What the backend keeps in modules' ``_extra_state``, as a refusal to drop it names it; None: nothing."""

    def after_load(self, model: nn.Module, wiring: FP8Wiring) -> None:
        """After a checkpoint loaded into the sharded ``model``: recompute what derives from weights."""

    # pipeline, cli, train: what the commands and the reference job ask of a backend
    rank_imports: ClassVar[tuple[str, ...]] = ()
    """Modules a rank imports anyway under this backend (``torchao.float8``), for a parent to import before forking."""
    commands_default: ClassVar[bool] = False
    """The commands use this backend when ``--fp8`` is not given, where it can run (the library's default: no FP8)."""
    health_telemetry: ClassVar[bool] = False
    """:class:`fp8dist.numerics.FP8Telemetry` can sample its FP8 layers (``--fp8-health-every``)."""

    # accounting: what the memory estimate and the precision report ask (defaults: no FP8 state of its own)
    derived_bytes: ClassVar[bool] = False
    """The estimate's figures for this backend come from its documentation, not from a measured run."""
    saved_weight_bytes: ClassVar[int] = 0
    """Bytes per element of each converted weight's FP8 copies kept for backward (TE: the weight and its transpose)."""

    def saved_input_bytes(self, cfg: Any) -> float:
        """Bytes per element of the quantized copy of its input each converted Linear saves for backward in place of
        the high-precision input, under ``cfg``'s recipe; 0: it saves the high-precision input (shared with the
        other readers of that tensor) and quantizes it again in backward. Default: 1 (an FP8 copy) where the
        backend keeps FP8 weight copies (:attr:`saved_weight_bytes`), else 0."""
        return 1.0 if self.saved_weight_bytes else 0.0

    def autograd_weight_bytes(self, cfg: Any) -> float:
        """Bytes per element of each converted weight's quantized copy that autograd saves for backward (freed with
        the layer's other saves, recomputed under activation checkpointing); 0: none. Default: 0."""
        return 0.0

    def element_bytes(self, cfg: Any, base: Any, converted: bool, n_states: int) -> Any:
        """Bytes per element of one parameter in each model-state category: ``base`` (a frozen dataclass of ``weight``,
        ``master``, ``grad``, ``states``, ``dtypes``) changed where the backend holds it otherwise; ``converted``: it
        is the weight of a module the plan converts; ``n_states``: the optimizer's states per element. Default:
        unchanged."""
        return base

    def frozen_weights(self, cfg: Any, facts: StrategyFacts) -> FrozenWeights:
        """What a converted Linear's frozen weight costs per step and in bytes. Default: as a trainable weight."""
        return FrozenWeights()

    def runs_held_fp8(self, cfg: Any) -> bool:
        """Whether the frozen Linears it converts under ``cfg`` multiply with e4m3 bits given to them (a LoRA base
        loaded in FP8: :mod:`fp8dist.pipeline.fp8_base`, the bits on the weight, their scale beside). Default: False
        (such a base is dequantized into high precision)."""
        return False

    weight_scale_names: ClassVar[tuple[str, ...]] = ()
    """Inner tensors of the backend's weight subclass that hold FP8 scales, not weight data: the report counts them
    as FP8 buffers, not in the weight."""

    def state_tensors(self, module: nn.Module) -> list[Any]:
        """The FP8 state a converted ``module`` keeps beside its weights (scales, amax history, kept FP8 casts; None
        entries skipped), which the report counts as FP8 buffers. Default: its own buffers."""
        return list(module.buffers(recurse=False))

    def fp8_state_bytes(self, cfg: Any, plan: Any) -> int:
        """Bytes of FP8 scaling state on every rank (replicated) for ``plan``."""
        return 0

    def all_gather_words(self, shards: list[torch.Tensor]) -> str | None:
        """What an all-gather of these local shards carries in the backend's own format; None: the compute dtype."""
        return None

    def gemm_words(self, module: nn.Module, wiring: FP8Wiring) -> str | None:
        """The FP8 formats ``module``'s GEMMs compute in, for the precision report; None: not known ("fp8")."""
        return None

    Config: ClassVar[type | None] = None
    """A frozen kw-only dataclass of the knobs this backend owns (typed, defaulted, a docstring under each): flat keys
    of ``wrap_model``, files, flags and ``cfg.precision``, read as ``cfg.precision.knobs(name)``. Field metadata:
    ``when`` (:class:`~fp8dist.config.axis.When` it is read under), ``min``, ``refused``, ``aliases``. None: none."""
    more_variant_options: ClassVar[tuple[str, ...]] = ()
    """Options beside :attr:`variant_option` whose every value the bench can run as a cell (``torchao_api``)."""


class _NoFP8(FP8Backend):
    name = "none"

    def convert_by_hand(self, model: nn.Module, facts: StrategyFacts) -> HandConverted:
        return HandConverted()


NO_FP8 = _NoFP8()
"""No FP8 (none asked for, or none possible here): every hook is the Protocol's no-op."""


def linear_reason(module: nn.Linear) -> str | None:
    """Why an ``nn.Linear`` (of any class) cannot run as an FP8 Linear (its math, its dims); None when it can."""
    return plain_linear_reason(module) or dims_reason(module)


def dims_reason(module: nn.Module, multiple: int = 16, why: str = "FP8 GEMM tiles") -> str | None:
    """Why a Linear's (or GPT-2 Conv1D's) dims do not suit an FP8 GEMM (both divisible by ``multiple``); None: they
    do."""
    dims = conv1d_dims(module) if is_conv1d(module) else (module.in_features, module.out_features)
    bad = [f"{n}={d}" for n, d in zip(("in_features", "out_features"), dims) if d % multiple]
    return f"{' and '.join(bad)} not divisible by {multiple} ({why})" if bad else None


def fp8_hardware_reason(device: torch.device | Hardware, *, min_capability: tuple[int, int] = (8, 9)) -> str | None:
    """None on a CUDA device with FP8 tensor cores (sm_89+ by default); else why not."""
    hardware, need = hardware_of(device), f"sm_{min_capability[0]}{min_capability[1]}+"
    if hardware.type != "cuda":
        return f"needs a CUDA GPU with FP8 tensor cores ({need}), device is {hardware.type}"
    if hardware.capability < min_capability:
        return f"this FP8 recipe needs {need}, not {hardware}" if min_capability > (8, 9) else \
            f"{hardware} has no FP8 tensor cores: FP8 needs {need}"
    return None
