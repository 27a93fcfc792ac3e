"""``memory="lean"``: MS-AMP O2-class model-state memory from maintained parts (torch, torchao's low-bit
optimizers, FSDP2).

- Weights are stored in bf16 with no fp32 master copy; torchao's AdamW rounds each update back to bf16
  stochastically (``bf16_stochastic_round=True``), so small updates are not lost on average.
- The two Adam states are 8-bit, blockwise scaled (256 elements per scale): torchao ``AdamWFp8`` (e4m3) on a GPU
  with FP8 (CUDA sm >= 8.9), ``AdamW8bit`` (bitsandbytes' dynamic 8-bit map) elsewhere. torchao keeps tensors of
  fewer than 4096 elements, or not a multiple of 256, in the parameter's dtype (bf16).
- Gradients are bf16: FSDP2 reduce-scatters them in bf16 and keeps them so; DDP all-reduces the bf16 gradients.

torchao's optimizers step FSDP2's DTensors through a ``torch.compile``d function that fails on CPU (torch 2.13,
torchao 0.18: the compiled step asks the 8-bit state for ``aten.view.dtype``). :class:`LocalShardStep` steps the
same torchao update function (``single_param_adam``) eagerly on each DTensor's local shard, which aliases the
sharded parameter's storage: the update lands in the parameter, the states hold only this rank's rows, and the
optimizer's ``param_groups`` and ``state`` stay keyed by the real parameters (DCP checkpoints see the usual names).

Stochastic rounding draws from torch's default generator, seeded for each parameter and step from the run's
rounding seed (rank 0's ``torch.initial_seed()`` when the optimizer is built: the script's ``torch.manual_seed``,
else the random seed torch starts with; kept in ``param_groups``), the step, the parameter's index in the optimizer
and its shard's coordinates, and put back afterwards: ranks that hold the same elements (DDP ranks, the replicas of
HSDP) round them the same way whatever each rank's own stream did (with each rank's stream, a
``torch.manual_seed(seed + rank)`` made them drift apart), the training script's stream is left as it was, and a
resumed run rounds as the uninterrupted one (seed and step are in the checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..config.axis import Rule, StrategyFacts
from ..pipeline.optim import check_optimizer_spec
from .base import MemoryLevel

__all__ = ["LeanLevel", "LEVEL", "lean_optimizer_kwargs", "lean_optimizer_class", "cast_params_bf16",
           "LocalShardStep"]

_LEAN_MIN, _LEAN_BLOCK = 4096, 256  # torchao 8-bit AdamW: smallest quantized tensor, elements per scale
_WAY_OUT = "memory='standard' keeps fp32 master weights and trains with any optimizer"


def _backend_owns_optimizer(cfg: Any) -> bool:
    from ..fp8 import get_backend

    return cfg.precision.fp8 is not None and get_backend(cfg.precision.fp8).owns_optimizer


class LeanLevel(MemoryLevel):
    """bf16 weights with no fp32 master, updated with stochastic rounding by torchao's 8-bit AdamW (stepped on each
    rank's shard), bf16 gradients. Builds the optimizer itself from an Adam/AdamW spec."""

    name = "lean"
    summary = "bf16 weights, no fp32 master, 8-bit AdamW states, bf16 gradients"
    rules = (
        Rule(("memory", "strategy"), lambda cfg, facts: facts.engine_builds_optimizer,
             "the engine keeps its own fp32 master partitions and builds its own optimizer, so bf16 weights without "
             "masters and 8-bit states cannot be had there"),
        Rule(("memory", "strategy"), lambda cfg, facts: facts.flat_params,
             "flat parameters (one FlatParameter per unit) are not supported by the lean level, which steps each "
             "parameter's own shard"),
        Rule(("memory", "fp8"), lambda cfg, facts: _backend_owns_optimizer(cfg),
             "this FP8 backend owns the weights and builds the optimizer itself (MS-AMP's opt_level O2 is its own "
             "low-memory level)"),
        Rule(("memory", "param_dtype"), lambda cfg, facts: cfg.parallel.param_dtype != "bf16",
             "the lean level stores and computes in bf16 (no fp32 master)",
             f"Use param_dtype='bf16', or {_WAY_OUT}."),
        Rule(("memory", "reduce_dtype"), lambda cfg, facts: cfg.parallel.reduce_dtype == "fp16",
             "lean gradients are bf16 and reduced in bf16", "Leave reduce_dtype at its default."),
    )
    builds_optimizer = True
    fit_way_out = ("the lean memory level", {"memory": name})
    report_master = "none (stochastic rounding)"

    def resolve(self, cfg: Any, facts: StrategyFacts) -> Any:
        """An engine that casts gradients for their reduction (FSDP2) reduces these bf16 gradients in bf16; DDP
        all-reduces them in their own dtype (bf16) with no hook."""
        if not facts.casts_gradients:
            return cfg
        return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, reduce_dtype="bf16"))

    def check_optimizer(self, spec: Any) -> None:
        lean_optimizer_kwargs(spec)

    def before_convert(self, model: nn.Module) -> None:
        cast_params_bf16(model)

    def after_convert(self, model: nn.Module) -> None:
        cast_params_bf16(model)  # the backend's new modules

    def build_optimizer(self, spec: Any, params: Iterable[nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
        """torchao's 8-bit AdamW (:func:`lean_optimizer_class`) with bf16 stochastic rounding, its rounding seed
        rank 0's ``torch.initial_seed()``. Build it after sharding, on every rank (with a process group, the seed is
        broadcast)."""
        return lean_optimizer_class(device)(params, bf16_stochastic_round=True, rounding_seed=_agreed_seed(device),
                                            **lean_optimizer_kwargs(spec))

    def element_bytes(self, base: Any) -> Any:
        return dataclasses.replace(base, weight=2, master=0, grad=2, states=0,
                                   dtypes=("bf16", "none", "bf16", "8-bit/bf16"))

    def local_state_bytes(self, numel: int) -> int:
        """torchao's 8-bit AdamW states (exp_avg, exp_avg_sq): a tensor of at least 4096 elements that is a multiple
        of its 256-element block is quantized, one byte per element, an fp32 scale per block and a 256-entry fp32
        code map per state; others stay bf16."""
        if numel >= _LEAN_MIN and numel % _LEAN_BLOCK == 0:
            return 2 * (numel + numel // _LEAN_BLOCK * 4 + _LEAN_BLOCK * 4)
        return 2 * 2 * numel


def lean_optimizer_class(device: torch.device) -> type[torch.optim.Optimizer]:
    """torchao's ``AdamWFp8`` on a CUDA GPU with FP8 (sm >= 8.9), ``AdamW8bit`` elsewhere, with the local-shard
    step (:class:`LocalShardStep`)."""
    try:
        from torchao.optim import AdamW8bit, AdamWFp8
    except ImportError as err:
        raise ImportError(f"memory='lean' needs torchao's low-bit optimizers ({err}): pip install 'torchao>=0.18', "
                          f"or {_WAY_OUT}.") from None
    from ..fp8 import fp8_hardware_reason

    return _local_shard_class(AdamWFp8 if fp8_hardware_reason(device) is None else AdamW8bit)


def lean_optimizer_kwargs(spec: Any) -> dict[str, Any]:
    """The torchao AdamW keyword arguments of an Adam/AdamW spec ``{"type": "AdamW", "lr": ..., "betas": ...,
    "eps": ..., "weight_decay": ...}``; ValueError naming the way out for anything else. ``type: "Adam"`` is taken
    when its weight_decay is 0 (AdamW with no decay is Adam)."""
    if spec is None or callable(spec) or not isinstance(spec, Mapping):
        got = "no optimizer" if spec is None else f"a {type(spec).__name__}"
        raise ValueError(f"memory='lean' builds the optimizer itself (torchao 8-bit AdamW, bf16 stochastic rounding) "
                         f"and got {got}: pass optimizer={{'type': 'AdamW', 'lr': ...}} and take model, optimizer = "
                         f"wrap_model(...); or {_WAY_OUT}.")
    kwargs = dict(spec)
    name = str(kwargs.pop("type", None)).lower()
    if name not in ("adamw", "adam") or name == "adam" and kwargs.get("weight_decay", 0):
        raise ValueError(f"memory='lean' trains with 8-bit AdamW; optimizer type {spec.get('type')!r}"
                         f"{' with weight_decay' if name == 'adam' else ''} is not available at this level. Pass "
                         f"{{'type': 'AdamW', 'lr': ...}}, or {_WAY_OUT}.")
    if name == "adam":
        kwargs["weight_decay"] = 0.0
    allowed = {"lr", "betas", "eps", "weight_decay"}
    if set(kwargs) - allowed:
        raise ValueError(f"memory='lean': optimizer options {sorted(set(kwargs) - allowed)} are not taken by torchao's "
                         f"8-bit AdamW; it takes {sorted(allowed)}. Leave them out, or {_WAY_OUT}.")
    # torchao's AdamW takes torch's AdamW's types and ranges: the one check of a spec, before anything changes
    check_optimizer_spec({**kwargs, "type": "AdamW"}, who="memory='lean': ")
    return kwargs


def _agreed_seed(device: torch.device) -> int:
    """Rank 0's ``torch.initial_seed()`` on every rank (the seed the script set, whatever each rank set)."""
    import torch.distributed as dist

    seed = torch.tensor([torch.initial_seed() % 2**63], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed.item())


def cast_params_bf16(model: nn.Module) -> int:
    """Store every floating-point parameter of ``model`` in bf16, in place (buffers are left alone: rotary
    frequencies stay fp32). Call before FP8 conversion (torchao wraps the bf16 weight for its FP8 all-gather) and
    again after it (a backend's new modules); FP8 weight wrappers, already bf16 inside, are left alone. Returns how
    many were cast."""
    cast = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != torch.bfloat16 and type(p.data) is torch.Tensor:
                p.data = p.data.to(torch.bfloat16)
                cast += 1
    return cast


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _shard_index(p: torch.Tensor) -> int:
    """Which shard of ``p`` this rank holds: its mesh coordinates on the sharded dimensions (mixed radix); 0 for a
    replicated DTensor or a plain tensor. Replicas of one shard get the same index."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return 0
    index, coordinate = 0, p.device_mesh.get_coordinate() or ()
    for dim, (placement, c) in enumerate(zip(p.placements, coordinate)):
        if placement.is_shard():
            index = index * p.device_mesh.size(dim) + c
    return index


def _rounding_seed(seed: int, step: int, index: int, shard: int) -> int:
    """The stochastic-rounding seed of a parameter's shard at a step: the same on every replica of the shard,
    different across runs' seeds, steps, parameters and shards."""
    return (seed + step * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + shard * 0x94D049BB133111EB) % 2**63


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator torch's random functions use on ``device`` (torchao's stochastic rounding calls randint)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


class LocalShardStep:
    """Mixin for a torchao ``_AdamBase`` optimizer: its update function run eagerly on each parameter's local shard
    instead of compiled over DTensors (the module's doc says why), the states made by torchao's own ``_new_buffer``
    (DTensors over this rank's 8-bit shard); ``rounding_seed`` (in every param group) is the run's part of the
    rounding seed of each parameter, step and shard (:func:`_rounding_seed`), so replicas stay identical."""

    def __init__(self, params: Any, *args: Any, rounding_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self.defaults["rounding_seed"] = rounding_seed  # groups added later take it too
        for group in self.param_groups:
            group.setdefault("rounding_seed", rounding_seed)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        from torchao.optim.adam import single_param_adam

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        saved: dict[torch.Generator, torch.Tensor] = {}  # the script's RNG states, put back after the step
        try:  # index: the parameter's place in the optimizer, counted over every group
            for index, (group, p) in enumerate([(g, p) for g in self.param_groups for p in g["params"]]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = self._new_buffer(p, True)
                    state["exp_avg_sq"] = self._new_buffer(p, False)
                state["step"] += 1
                rounding = self.bf16_stochastic_round and p.dtype is torch.bfloat16
                if rounding:
                    generator = _default_generator(p.device)
                    saved.setdefault(generator, generator.get_state())
                    generator.manual_seed(_rounding_seed(group["rounding_seed"], int(state["step"]), index,
                                                         _shard_index(p)))
                single_param_adam(_local(p.detach()), _local(p.grad), state["step"], _local(state["exp_avg"]),
                                  _local(state["exp_avg_sq"]), None, group["lr"], group["betas"][0], group["betas"][1],
                                  group["weight_decay"], group["eps"], True, rounding)
        finally:
            for generator, rng_state in saved.items():
                generator.set_state(rng_state)
        return loss


@functools.cache
def _local_shard_class(base: type) -> type:
    """``base`` (a torchao AdamW) with :class:`LocalShardStep`'s step; one class per base, made on first use."""
    return type(base.__name__, (LocalShardStep, base),
                {"__module__": __name__,
                 "__doc__": f"torchao {base.__name__}, stepped on local shards (fp8dist.memory_levels.lean)."})


LEVEL = LeanLevel()
