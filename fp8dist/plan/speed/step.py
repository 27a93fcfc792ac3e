"""A step's GEMMs under the speed model: each layer's prediction and choice (FP8 where the speedup clears a margin),
the totals, and several recipes side by side; pure data that the plan, ``fp8dist estimate`` and ``plan`` render."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...config.options import DEFAULT_MARGIN
from ...fp8.torchao import TorchaoBackend
from ...runtime.gpus import GpuSpec
from ...runtime.hardware import Hardware
from .model import LinearPrediction, predict_linear, resolve_gpu

__all__ = ["Gemm", "LayerChoice", "StepPrediction", "predict_gemms", "compare_recipes", "recipes_for",
           "check_modelled"]


@dataclass(frozen=True)
class Gemm:
    """One Linear (or grouped expert GEMM) of a step: its module's name and forward shape."""

    name: str
    """The module's name in the model."""
    m: int
    """Input rows: tokens per micro-batch per rank (grouped: rows routed to all the experts)."""
    k: int
    """in_features."""
    n: int
    """out_features."""
    groups: int = 1
    """Experts sharing the rows (grouped GEMMs); 1 for a Linear."""


@dataclass(frozen=True)
class LayerChoice:
    """A layer's prediction and the margin's choice (``fp8``: the speedup is at least the margin)."""

    name: str
    """The module's name in the model."""
    prediction: LinearPrediction
    """Its bf16 and FP8 figures."""
    fp8: bool
    """Whether it runs in FP8: its speedup is at least the margin."""

    @property
    def seconds(self) -> float:
        """Predicted forward + backward seconds of the layer as chosen: FP8's (``fp8_s``) where ``fp8``, else bf16's."""
        return self.prediction.fp8_s if self.fp8 else self.prediction.bf16_s


@dataclass(frozen=True)
class StepPrediction:
    """A step's GEMMs under one recipe on one GPU: each layer's choice and the totals in seconds (forward +
    backward, one micro-batch, one rank; attention, norms, communication and the optimizer are not in it: the whole
    step is :class:`~fp8dist.plan.speed.step_time.StepTime`, from ``predict_step``). :func:`predict_gemms` returns
    it; the plan's :class:`~fp8dist.plan.selection.Selection` holds the one its layer choice came from."""

    recipe: str
    """The speed recipe predicted."""
    gpu: str
    """The GPU's ``--target`` key."""
    gpu_label: str
    """The GPU's name in messages."""
    compile: bool
    """Whether predicted under ``torch.compile``."""
    margin: float
    """The speedup a layer must reach to be chosen FP8."""
    layers: tuple[LayerChoice, ...]
    """Each layer's prediction and choice, in the order given."""

    @property
    def bf16_s(self) -> float:
        """Predicted seconds of every layer's GEMMs in bf16 (the baseline)."""
        return sum(c.prediction.bf16_s for c in self.layers)

    @property
    def chosen_s(self) -> float:
        """Predicted seconds with each layer as chosen (FP8 where its speedup clears ``margin``, else bf16)."""
        return sum(c.seconds for c in self.layers)

    @property
    def all_fp8_s(self) -> float:
        """Predicted seconds with every layer in FP8, slower ones too (what ``fp8_select='all'`` runs)."""
        return sum(c.prediction.fp8_s for c in self.layers)

    @property
    def saved_s(self) -> float:
        """Seconds the choice saves over bf16 (``bf16_s - chosen_s``); negative only under a ``margin`` below 1,
        which converts layers predicted slower."""
        return self.bf16_s - self.chosen_s

    @property
    def fp8_flop_share(self) -> float:
        """Share of the layers' FLOPs run in FP8 as chosen (0 with no layers)."""
        total = sum(c.prediction.flops for c in self.layers)
        return sum(c.prediction.flops for c in self.layers if c.fp8) / total if total else 0.0

    @property
    def calibrated(self) -> bool:
        """True when every layer's prediction is calibrated (H100, rowwise, compiled)."""
        return all(c.prediction.calibrated for c in self.layers)


def predict_gemms(gemms: Iterable[Gemm | tuple], *, target: str | Hardware | GpuSpec, recipe: str,
                 compile: bool = True, margin: float = DEFAULT_MARGIN) -> StepPrediction:
    """Predict every layer (:class:`Gemm` or ``(name, m, k, n[, groups])``) and choose FP8 where its speedup is at
    least ``margin``; call it with the eligible layers only. Other arguments: as :func:`predict_linear`. ValueError:
    a bad margin, or what :func:`predict_linear` raises, naming the layer."""
    if not isinstance(margin, (int, float)) or isinstance(margin, bool) or margin <= 0:
        raise ValueError(f"margin={margin!r}: the speedup a layer must reach is a positive number (1.0 converts "
                         "every layer predicted faster).")
    spec = resolve_gpu(target)
    layers = []
    for gemm in gemms:
        gemm = gemm if isinstance(gemm, Gemm) else Gemm(*gemm)
        try:
            prediction = predict_linear(gemm.m, gemm.k, gemm.n, target=spec, recipe=recipe, compile=compile,
                                        groups=gemm.groups)
        except ValueError as error:
            raise ValueError(f"layer {gemm.name!r}: {error}") from None
        layers.append(LayerChoice(gemm.name, prediction, prediction.speedup >= margin))
    return StepPrediction(recipe, spec.key, spec.label, compile, margin, tuple(layers))


def check_modelled(backend: str | None, said: str, wanted: str) -> None:
    """ValueError unless the speed model covers ``backend`` (it has ``speed_recipes``): ``{said} has no speed model:
    {wanted} of`` the backends it covers (``said``: the value as the caller names it, ``fp8=None``)."""
    from ...fp8 import BACKENDS, get_backend

    modelled = [repr(b) for b in BACKENDS if get_backend(b).speed_recipes]
    if repr(backend) not in modelled:
        shown = ", ".join(modelled[:-1]) + (" or " if len(modelled) > 1 else "") + modelled[-1]
        raise ValueError(f"{said} has no speed model: {wanted} of {shown}; pass one of those.")


def recipes_for(backend: str, target: str | Hardware | GpuSpec) -> tuple[str, ...]:
    """The Linear recipes of ``backend`` (its :attr:`~fp8dist.fp8.FP8Backend.speed_recipes`) that ``target`` runs;
    ValueError for a backend the speed model does not cover, naming those it does."""
    from ...fp8 import get_backend

    check_modelled(backend, f"backend {backend!r}", "compare recipes")
    capability = resolve_gpu(target).capability
    return tuple(r.name for r in get_backend(backend).speed_recipes if not r.grouped and capability >= r.min_capability)


def compare_recipes(gemms: Sequence[Gemm | tuple], *, target: str | Hardware | GpuSpec,
                    recipes: Sequence[str] | None = None, backend: str = TorchaoBackend.name, compile: bool = True,
                    margin: float = DEFAULT_MARGIN) -> tuple[StepPrediction, ...]:
    """The same step under several recipes, to pick one before renting the GPU: each result's ``bf16_s`` is the
    all-bf16 step (the same in each), ``chosen_s`` the step with FP8 where it pays (``saved_s`` against all-bf16),
    ``all_fp8_s`` with every layer converted. ``recipes`` None: every Linear recipe of ``backend`` the target runs;
    the other arguments as :func:`predict_gemms`."""
    names = tuple(recipes) if recipes is not None else recipes_for(backend, target)
    return tuple(predict_gemms(gemms, target=target, recipe=r, compile=compile, margin=margin) for r in names)
