"""``memory="lean"``: MS-AMP O2-class model-state memory from maintained parts: bf16 weights with no fp32 master,
torchao's 8-bit AdamW with bf16 stochastic rounding (stepped eagerly on each rank's shard), bf16 gradients."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..config.axis import Rule, StrategyFacts
from ..runtime.optim import check_optimizer_spec
from .base import MemoryLevel

if TYPE_CHECKING:
    from ..config.param_bytes import ElementBytes
    from ..config.resolve import Config
    from ..runtime.optim import OptimizerSpec

__all__ = ["LeanLevel", "LEVEL", "lean_optimizer_kwargs", "lean_optimizer_class", "cast_params_bf16",
           "LocalShardStep"]

_LEAN_MIN, _LEAN_BLOCK = 4096, 256  # torchao 8-bit AdamW: smallest quantized tensor, elements per scale
_WAY_OUT = "memory='standard' keeps fp32 master weights and trains with any optimizer"


def _backend_owns_optimizer(cfg: Config) -> bool:
    from ..fp8 import get_backend

    return cfg.precision.fp8 is not None and get_backend(cfg.precision.fp8).owns_optimizer


class LeanLevel(MemoryLevel):
    """bf16 weights with no fp32 master, updated by torchao's 8-bit AdamW with ``bf16_stochastic_round`` (small
    updates are not lost on average), bf16 gradients. Builds the optimizer itself from an Adam/AdamW spec."""

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
        Rule(("memory", "reduce_dtype"), lambda cfg, facts: cfg.parallel.reduce_dtype in ("fp16", "fp8"),
             "lean gradients are bf16 and reduced in bf16", "Leave reduce_dtype at its default."),
    )
    builds_optimizer = True
    fit_way_out = ("the lean memory level", {"memory": name})
    report_master = "none (stochastic rounding)"

    def resolve(self, cfg: Config, facts: StrategyFacts) -> Config:
        """An engine that casts gradients for their reduction (FSDP2) reduces these bf16 gradients in bf16; DDP
        all-reduces them in their own dtype (bf16) with no hook."""
        if not facts.casts_gradients:
            return cfg
        return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, reduce_dtype="bf16"))

    def check_optimizer(self, spec: OptimizerSpec | None) -> None:
        """ValueError, with the way out, unless ``spec`` is an AdamW (or Adam without weight decay) mapping with only
        the options torchao's 8-bit AdamW takes."""
        lean_optimizer_kwargs(spec)

    def before_convert(self, model: nn.Module) -> None:
        """Cast the model's floating-point parameters to bf16 (no fp32 master is kept)."""
        cast_params_bf16(model)

    def after_convert(self, model: nn.Module) -> None:
        """Cast the parameters the backend's new modules brought to bf16 too."""
        cast_params_bf16(model)  # the backend's new modules

    def build_optimizer(self, spec: OptimizerSpec, params: Iterable[nn.Parameter],
                        device: torch.device) -> torch.optim.Optimizer:
        """Build it after sharding, on every rank: the rounding seed is rank 0's ``torch.initial_seed()``."""
        return lean_optimizer_class(device)(params, bf16_stochastic_round=True, rounding_seed=_agreed_seed(device),
                                            **lean_optimizer_kwargs(spec))

    def element_bytes(self, base: ElementBytes) -> ElementBytes:
        """bf16 weights and gradients, no master copy, 8-bit states (counted by :meth:`local_state_bytes`)."""
        return dataclasses.replace(base, weight=2, master=0, grad=2, states=0,
                                   dtypes=("bf16", "none", "bf16", "8-bit/bf16"))

    def local_state_bytes(self, numel: int) -> int:
        """torchao quantizes a state of >= 4096 elements, a multiple of 256: a byte per element, an fp32 scale per
        256-element block and a 256-entry fp32 code map; smaller ones stay bf16."""
        if numel >= _LEAN_MIN and numel % _LEAN_BLOCK == 0:
            return 2 * (numel + numel // _LEAN_BLOCK * 4 + _LEAN_BLOCK * 4)
        return 2 * 2 * numel


def lean_optimizer_class(device: torch.device) -> type[torch.optim.Optimizer]:
    """torchao's ``AdamWFp8`` (e4m3 states) on a GPU with FP8 (sm >= 8.9), ``AdamW8bit`` (bitsandbytes' dynamic
    map) elsewhere, with the local-shard step (:class:`LocalShardStep`)."""
    try:
        from torchao.optim import AdamW8bit, AdamWFp8
    except ImportError as err:
        raise ImportError(f"memory='lean' needs torchao's low-bit optimizers ({err}): pip install 'torchao>=0.18', "
                          f"or {_WAY_OUT}.") from None
    from ..fp8 import fp8_hardware_reason

    return _local_shard_class(AdamWFp8 if fp8_hardware_reason(device) is None else AdamW8bit)


def lean_optimizer_kwargs(spec: OptimizerSpec | None) -> dict[str, Any]:
    """The torchao AdamW keyword arguments of an AdamW spec (``lr``, ``betas``, ``eps``, ``weight_decay``), or of an
    Adam one without weight decay; ValueError naming the way out for anything else."""
    if not isinstance(spec, Mapping):
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
    # torchao's AdamW takes torch's AdamW's types and ranges
    check_optimizer_spec({**kwargs, "type": "AdamW"}, who="memory='lean': ")
    return kwargs


def _agreed_seed(device: torch.device) -> int:
    import torch.distributed as dist

    seed = torch.tensor([torch.initial_seed() % 2**63], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed.item())


def cast_params_bf16(model: nn.Module) -> None:
    """Store every floating-point parameter in bf16, in place; buffers (rotary frequencies) and FP8 weight wrappers
    (bf16 inside) are left alone. Call before FP8 conversion (torchao wraps the bf16 weight) and after it (a
    backend's new modules)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16 and type(p.data) is torch.Tensor:
            p.data = p.data.to(torch.bfloat16)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _shard_index(p: torch.Tensor) -> int:
    """This rank's mesh coordinates on the dims that shard ``p`` (mixed radix): the same on replicas of a shard."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return 0
    index, coordinate = 0, p.device_mesh.get_coordinate() or ()
    for dim, (placement, c) in enumerate(zip(p.placements, coordinate)):
        if placement.is_shard():
            index = index * p.device_mesh.size(dim) + c
    return index


def _rounding_seed(seed: int, step: int, index: int, shard: int) -> int:
    return (seed + step * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + shard * 0x94D049BB133111EB) % 2**63


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator torchao's stochastic rounding (``randint``) draws from on ``device``."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


class LocalShardStep:
    """Mixin for a torchao ``_AdamBase`` optimizer: its ``single_param_adam`` run eagerly on each DTensor's local
    shard (the shard aliases the parameter's storage), as the compiled step over DTensors fails on CPU (torch 2.13,
    torchao 0.18: ``aten.view.dtype`` on the 8-bit state); ``param_groups`` and ``state`` stay keyed by the real
    parameters. Stochastic rounding is seeded per parameter, step and shard from ``rounding_seed`` (in every param
    group, so in the checkpoint) and the RNG put back: replicas round alike, the script's stream is untouched and
    a resumed run rounds as the uninterrupted one."""

    def __init__(self, params: Any, *args: Any, rounding_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self.defaults["rounding_seed"] = rounding_seed  # groups added later take it too
        for group in self.param_groups:
            group.setdefault("rounding_seed", rounding_seed)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step on each parameter's local shard (``closure`` re-evaluates the loss first, under grad);
        returns its loss or None. Stochastic rounding seeded per parameter, step and shard; the RNG put back after."""
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
    """``base`` (a torchao AdamW) with :class:`LocalShardStep`'s step, one class per base."""
    return type(base.__name__, (LocalShardStep, base),
                {"__module__": __name__,
                 "__doc__": f"torchao {base.__name__}, stepped on local shards (fp8dist.memory_levels.lean)."})


LEVEL = LeanLevel()
"""The level ``memory='lean'`` selects (registered by :func:`fp8dist.memory_levels.register_builtins`)."""
