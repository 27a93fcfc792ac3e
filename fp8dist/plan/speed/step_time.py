"""One micro-batch's training step on one rank, bf16 against FP8, in parts (GEMMs, attention, memory-bound work,
recompute, optimizer, exposed collectives); two constants fitted on published runs (``benchmarks/step_model/``).
Not re-exported by :mod:`fp8dist.plan.speed`: it reads the config schema, which imports that package."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from ...fp8.torchao import TorchaoBackend
from ...runtime.gpus import GpuSpec, gpu_by_key
from ...runtime.hardware import Hardware
from .model import predict_linear, resolve_gpu
from .recipes import recipe_named
from .constants import STEP_CONSTANTS, StepConstants
from .comm import check_topology as _check_topology, collectives as _collectives, exposed_collectives, \
    topology as _topology
from .step import check_modelled, recipes_for

__all__ = ["StepConstants", "STEP_CONSTANTS", "StepParts", "StepTime", "predict_step", "compare_step_recipes",
           "fastest", "linear_shapes", "exposed_collectives"]


@dataclass(frozen=True)
class StepParts:
    """One precision's step, seconds per micro-batch on one rank."""

    gemm_s: float
    """The Linears' GEMMs, forward + backward (on the FP8 side, the FP8 layers' in FP8)."""
    attention_s: float
    """Causal attention's QK^T and PV (bf16 under every recipe), forward + backward."""
    memory_s: float
    """Memory-bound work (norms, activations, residuals) and, on the FP8 side, the casts and scale kernels."""
    recompute_s: float
    """The forward recomputed in backward under activation checkpointing (0 without)."""
    optimizer_s: float
    """The optimizer step over this rank's trainable elements."""
    collective_s: float
    """All-gather + reduce-scatter (or all-reduce) time, overlapped or not."""
    exposed_s: float
    """What of ``collective_s`` the compute does not hide: one block's worth and whatever exceeds the compute."""

    @property
    def compute_s(self) -> float:
        """Seconds of the step's own work: GEMMs, attention, memory-bound kernels, recompute and the optimizer step
        (the collectives aside)."""
        return self.gemm_s + self.attention_s + self.memory_s + self.recompute_s + self.optimizer_s

    @property
    def step_s(self) -> float:
        """The predicted step: ``compute_s`` plus the collective time compute does not hide (``exposed_s``)."""
        return self.compute_s + self.exposed_s


@dataclass(frozen=True)
class StepTime:
    """A whole training step predicted by :func:`predict_step`, bf16 and FP8 side by side (a prediction, not a
    measurement): GEMMs, attention, memory-bound work, recompute, the optimizer and the exposed collectives of one
    micro-batch on one rank. :class:`~fp8dist.plan.speed.step.StepPrediction` is the narrower answer the plan's layer
    selection reads: the GEMMs alone, layer by layer."""

    gpu: str
    """The GPU's ``--target`` key."""
    gpu_label: str
    """The GPU's name in messages."""
    recipe: str | None
    """The speed recipe the FP8 side runs."""
    world_size: int
    """Ranks (GPUs) the step runs on."""
    micro_batch_size: int
    """Sequences per rank per step."""
    seq_len: int
    """Tokens per sequence."""
    compile: bool
    """Whether predicted under ``torch.compile``."""
    activation_checkpointing: str
    """none, full or selective."""
    fp8_layers: int
    """Linears the FP8 side runs in FP8."""
    params: int
    """Parameters of the model."""
    trainable_params: int
    """Parameters with ``requires_grad`` (a LoRA run's adapters): only these have a gradient, an optimizer step and a
    gradient collective; a frozen Linear's backward has no grad_weight GEMM."""
    nvlink_domain: int
    """GPUs whose collectives run at the GPU's NVLink (or PCIe) bandwidth; beyond them, at ``network_gbps``."""
    network_gbps: float
    """Bandwidth between NVLink domains per GPU and direction, GB/s (gigabytes)."""
    topology_source: str
    """Where the two come from: the GPU record's sources, or the values passed to :func:`predict_step`."""
    flops_per_token: float
    """Training FLOPs per token, PaLM's 6N + 12LHQT (what torchtitan's MFU divides)."""
    bf16: StepParts
    """The bf16 step, part by part."""
    fp8: StepParts
    """The FP8 step, part by part."""
    calibrated: bool
    """True only on the GPU and recipes the constants were fitted on."""
    replicate_degree: int = 1
    """HSDP replicas (FSDP2's ``replicate_degree``); 1: one shard group over every rank."""
    reduce_dtype: str = "fp32"
    """The gradient reduction's dtype the collectives were predicted with (fp8: 1 + 4 / block bytes an element)."""

    @property
    def tokens(self) -> int:
        """Tokens one rank runs per step (``micro_batch_size * seq_len``)."""
        return self.micro_batch_size * self.seq_len

    @property
    def speedup(self) -> float:
        """bf16 step time over FP8 step time: above 1 where the FP8 step is predicted faster."""
        return self.bf16.step_s / self.fp8.step_s

    @property
    def tokens_per_s(self) -> float:
        """FP8, per GPU."""
        return self.tokens / self.fp8.step_s

    @property
    def bf16_tokens_per_s(self) -> float:
        """The bf16 step's tokens per second, per GPU."""
        return self.tokens / self.bf16.step_s

    @property
    def mfu(self) -> float:
        """The FP8 run's MFU as torchtitan reports it: every FLOP against the dense bf16 peak (with FP8 it
        overstates what is left to gain)."""
        return self.tokens_per_s * self.flops_per_token / self._peak

    @property
    def bf16_mfu(self) -> float:
        """The bf16 run's MFU: its FLOPs per second over the GPU's dense bf16 peak."""
        return self.bf16_tokens_per_s * self.flops_per_token / self._peak

    @property
    def _peak(self) -> float:
        return gpu_by_key(self.gpu).bf16_tflops * 1e12

    def to_dict(self) -> dict[str, Any]:
        """Every field (``bf16`` and ``fp8`` as dicts of their parts) and the derived figures (speedup, tokens per
        second, step seconds, MFU), with ``prediction: True``: JSON-ready, what ``--json`` outputs write."""
        return dict(asdict(self), speedup=self.speedup, tokens_per_s=self.tokens_per_s,
                    bf16_tokens_per_s=self.bf16_tokens_per_s, bf16_step_s=self.bf16.step_s, fp8_step_s=self.fp8.step_s,
                    mfu=self.mfu, bf16_mfu=self.bf16_mfu, prediction=True)

    @property
    def setting(self) -> str:
        """The run the prediction is for, in words: batch, activation checkpointing, compile and topology."""
        frozen = (f", base frozen ({self.trainable_params:,} of {self.params:,} parameters trainable)"
                  if self.trainable_params < self.params else "")
        hsdp = (f", HSDP {self.replicate_degree} replicas x {self.world_size // self.replicate_degree} ranks"
                if self.replicate_degree > 1 else "")
        return (f"batch {self.micro_batch_size} x {self.seq_len:,} tokens per rank{frozen}{hsdp}, activation "
                f"checkpointing {self.activation_checkpointing}, {'compiled' if self.compile else 'eager'}, "
                f"NVLink domain {self.nvlink_domain} GPUs, network {self.network_gbps:g} GB/s per GPU between domains")

    def describe(self) -> str:
        """One line for logs and the CLI: ``predicted step 1.32x on 8x H100 (rowwise): 9,800 -> 12,900 tokens/s per
        GPU (<setting>)``, with "uncalibrated" where the constants were not fitted on this GPU and recipe."""
        basis = "" if self.calibrated else ", uncalibrated"
        return (f"predicted step {self.speedup:.2f}x on {self.world_size}x {self.gpu_label} ({self.recipe}{basis}): "
                f"{self.bf16_tokens_per_s:,.0f} -> {self.tokens_per_s:,.0f} tokens/s per GPU ({self.setting})")


def linear_shapes(model: nn.Module) -> tuple[list[tuple[str, int, int]], str | None]:
    """Every ``nn.Linear`` as (name, in_features, out_features), and the output head's name (None without one)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shapes, head_name = [], None
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            shapes.append((name, module.in_features, module.out_features))
            head_name = name if module is head else head_name
    return shapes, head_name


def _meta_model(model_or_config: Any) -> nn.Module:
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    if not hasattr(model_or_config, "model_type"):
        raise ValueError(f"predict_step takes a model or a Hugging Face config (e.g. LlamaConfig), not "
                         f"{type(model_or_config).__name__}: pass AutoConfig.from_pretrained(...) or the nn.Module.")
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):  # shapes only: nothing allocated
            return AutoModelForCausalLM.from_config(model_or_config)
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):  # transformers' words for a config it cannot build
            raise
        raise ValueError(f"predict_step builds a causal language model (AutoModelForCausalLM) from a config, and "
                         f"{type(model_or_config).__name__} (model_type={model_or_config.model_type!r}) is not one "
                         "transformers builds that way (a causal LM config is, e.g. LlamaConfig, Qwen2Config, "
                         "MistralConfig). Build the model on the meta device yourself and pass the nn.Module: "
                         "with torch.device('meta'): model = YourModel(config).") from None


def _check(world_size: int, micro_batch_size: int, seq_len: int) -> None:
    for name, value in (("world_size", world_size), ("micro_batch_size", micro_batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: a positive integer (ranks, sequences per micro-batch per rank, "
                             "tokens per sequence).")


def _attention(config: Any, spec: GpuSpec, tokens: int, seq_len: int, c: StepConstants) -> tuple[float, float]:
    """(seconds fwd + bwd, FLOPs per token by torchtitan's 12LHQT) of causal attention."""
    if config is None or not hasattr(config, "num_attention_heads"):
        return 0.0, 0.0
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    forward = 2 * 2 * tokens * seq_len * width * config.num_hidden_layers / 2  # QK^T and PV, causal half
    flops = forward * (1 + c.attention_backward)
    return flops / (spec.bf16_tflops * 1e12 * c.attention_fraction), 12 * config.num_hidden_layers * width * seq_len


def _parts(gemm_s: float, cast_s: float, attention_s: float, memory_s: float, optimizer_s: float,
           collective_s: float, checkpointing: str, blocks: int, shards: bool, c: StepConstants) -> StepParts:
    """One precision's step. Selective recompute is torchtitan's per-op policy (every other matmul's forward and
    the elementwise forward); collectives hide behind the compute (FSDP) or the backward (all-reduce)."""
    gemm_s *= c.gemm_efficiency
    forward = {"none": 0.0, "selective": (gemm_s + cast_s) / 6 + memory_s / 3,
               "full": (gemm_s + cast_s + memory_s) / 3 + attention_s / (1 + c.attention_backward)}[checkpointing]
    memory_s += cast_s
    compute = gemm_s + attention_s + memory_s + forward + optimizer_s
    exposed = exposed_collectives(collective_s, compute, optimizer_s, blocks, shards)
    return StepParts(gemm_s, attention_s, memory_s, forward, optimizer_s, collective_s, exposed)


def predict_step(model_or_config: Any, *, target: str | Hardware | GpuSpec, world_size: int, micro_batch_size: int,
                 seq_len: int, fp8: str = TorchaoBackend.name, recipe: str | None = None, compile: bool | None = None,
                 activation_checkpointing: str | None = None, strategy: str | None = None,
                 fp8_layers: Collection[str] | None = None, nvlink_domain: int | None = None,
                 network_gbps: float | None = None, replicate_degree: int = 1,
                 constants: StepConstants = STEP_CONSTANTS, reduce_dtype: str | None = None) -> StepTime:
    """Predict one training step in bf16 and with FP8, per GPU: the speedup, tokens/s each way, MFU and the parts.
    Call it before renting the GPU; ``benchmarks/step_model/README.md`` gives its agreement with published runs.

    Args:
        model_or_config: an ``nn.Module`` (the meta device is enough) or a Hugging Face config, built on meta here.
            A module's parameters with ``requires_grad=False`` are frozen (a LoRA base, e.g. a PEFT model): no
            grad_weight GEMM, optimizer step or gradient collective for them.
        target: a ``--target`` name, a :class:`~fp8dist.runtime.hardware.Hardware` or a GPU record.
        world_size: ranks; micro_batch_size: sequences per rank per step; seq_len: tokens per sequence.
        fp8: a backend the speed model covers ('torchao', 'te').
        strategy, activation_checkpointing: as :func:`fp8dist.wrap_model` takes them (None: its default).
        compile: True or False; None: as wrap_model decides on a CUDA GPU with FP8 layers, on unless the combination
            table refuses it for ``fp8`` (Transformer Engine: off).
        recipe: one of the backend's speed recipes (``get_backend(fp8).speed_recipes``); None: the one of the
            backend's default config (torchao: tensorwise; te: te_delayed).
        fp8_layers: module names of the Linears run in FP8; None: every Linear but the output head (torchtitan's);
            with a frozen base (Linears whose weight has ``requires_grad=False``, as under LoRA), the frozen ones.
        nvlink_domain: GPUs one NVLink domain joins (collectives within it run at NVLink bandwidth); network_gbps:
            GB/s per GPU between domains; None: the GPU record's (``GpuSpec.nvlink_domain``, ``network_gbps``).
        replicate_degree: FSDP2's HSDP replicas, as wrap_model takes it (1: plain FSDP): each shard group of
            ``world_size // replicate_degree`` contiguous ranks gathers and reduce-scatters inside itself, then the
            gradient shards are all-reduced across the replicas.
        constants: the fitted and assumed constants (:data:`STEP_CONSTANTS`).
        reduce_dtype: the gradient reduction's dtype, as wrap_model takes it (None: its default, fp32); 'fp8' sends
            one byte an element and its block's share of an fp32 scale, in the collectives of both steps.

    Raises:
        ValueError: naming the bad value and the choices: a backend without a speed model, a recipe the backend does
            not run, a combination the table refuses (``compile=True`` with ``fp8='te'``), a config transformers
            builds no causal language model from, a non-positive ``nvlink_domain`` or ``network_gbps``, a
            ``replicate_degree`` the strategy does not take or that does not divide ``world_size``.

    Example:
        >>> from transformers import LlamaConfig
        >>> step = predict_step(LlamaConfig(), target="h100", world_size=8, micro_batch_size=1, seq_len=4096)
        >>> step.speedup > 1
        True
    """
    from ...config.resolve import FP8Config, resolve_config
    from ...config.rules import facts_of, refusing_rule
    from ...fp8 import get_backend
    from ...strategies import STRATEGIES

    _check(world_size, micro_batch_size, seq_len)
    _check_topology(nvlink_domain, network_gbps)
    # the value alone first ('TE' -> 'te', an unknown name refused), modelled, before the table's refusals
    check_modelled(FP8Config(fp8=fp8).fp8, f"fp8={fp8!r}", "predict_step compares bf16 with the FP8 step")
    given = {"strategy": strategy, "replicate_degree": replicate_degree,
             "activation_checkpointing": activation_checkpointing, "reduce_dtype": reduce_dtype}
    given = {k: v for k, v in given.items() if (v != 1 if k == "replicate_degree" else v)}  # the defaults left out
    cfg = resolve_config(fp8=fp8, source="predict_step", compile=compile, **given)
    if replicate_degree != 1:
        if "replicate_degree" not in STRATEGIES[cfg.parallel.strategy].options:
            raise ValueError(f"replicate_degree={replicate_degree!r} with strategy {cfg.parallel.strategy!r}: only "
                             "strategy='fsdp' (FSDP2) runs HSDP; pass replicate_degree=1 or strategy='fsdp'.")
        STRATEGIES[cfg.parallel.strategy].check_launch(cfg, world_size)
    backend = get_backend(cfg.precision.fp8)
    spec = resolve_gpu(target)
    if recipe is None:
        recipe, _ = backend.speed_recipe(cfg, Hardware("cuda", spec.capability, spec.label))
    linear_recipes = [r.name for r in backend.speed_recipes if not r.grouped]
    if recipe not in linear_recipes:
        raise ValueError(f"recipe={recipe!r}: backend {cfg.precision.fp8!r} runs {', '.join(linear_recipes)}; "
                         "pass one of those (or another fp8= backend).")
    if compile is None:  # auto, as wrap_model decides on a CUDA GPU with FP8 layers
        compile = refusing_rule(cfg, compile=True) is None
    model = _meta_model(model_or_config)
    config = getattr(model, "config", None) if isinstance(model_or_config, nn.Module) else model_or_config
    return _predict(model, config, recipe, fp8_layers, spec, cfg, facts_of(cfg, world_size), world_size,
                    micro_batch_size * seq_len, seq_len, compile, _topology(spec, nvlink_domain, network_gbps),
                    constants)


def _predict(model: nn.Module, config: Any, recipe: str, chosen: Collection[str] | None, spec: GpuSpec, cfg: Any,
             facts: Any, world_size: int, tokens: int, seq_len: int, compile: bool,
             topology: tuple[int, float, str], c: StepConstants) -> StepTime:
    from ...strategies.grad_fp8 import reduce_wire_bytes, replica_reduce_bytes

    shapes, head = linear_shapes(model)
    frozen = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad}
    preds = {n: predict_linear(tokens, k, o, target=spec, recipe=recipe, compile=compile, weight_grad=n not in frozen)
             for n, k, o in shapes}
    # default: every Linear but the head; with a frozen base (LoRA), its Linears only (the adapters stay bf16)
    if chosen is None:
        fp8_names = [n for n, k, o in shapes
                     if n != head and k % 16 == 0 and o % 16 == 0 and (not frozen or n in frozen)]
    else:
        fp8_names = [n for n, _, _ in shapes if n in chosen]
    if chosen is not None and len(fp8_names) != len(set(chosen)):
        unknown = sorted(set(chosen) - set(fp8_names))
        raise ValueError(f"fp8_layers names {unknown[:3]}, not Linear layers of this model: pass names from "
                         "model.named_modules() (or None for every Linear but the output head).")
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gathered_fp8 = recipe_named(recipe).fp8_all_gather and facts.dtensor_shards
    fp8_params = sum(k * o for n, k, o in shapes if n in fp8_names) if gathered_fp8 else 0
    # fp8: one byte and the block's share of its fp32 scale (HSDP's all-reduce across replicas stays fp32)
    reduce_bytes = reduce_wire_bytes(cfg.parallel), replica_reduce_bytes(cfg.parallel)
    attention_s, attention_flops = _attention(config, spec, tokens, seq_len, c)
    bandwidth = spec.memory_tbps * 1e12 * spec.calibration.memory_fraction
    # bf16 bytes of every Linear's input and output (memory_traffic is per byte of a transformer's Linears: with a
    # frozen base, its Linears'; the adapters beside them at adapter_traffic)
    activation = 2 * sum(k + o for n, k, o in shapes if not frozen or n in frozen) * tokens
    adapters = 2 * sum(k + o for n, k, o in shapes if frozen and n not in frozen) * tokens
    # eager runs unfused what compile fuses: (eager_traffic - 1) more passes over the ideal (once-each) traffic
    traffic = c.memory_traffic + (0 if compile else c.eager_traffic - 1)
    memory_s = 3 * (traffic * activation + c.adapter_traffic * adapters) / bandwidth
    optimizer_s = trainable / (facts.shard_degree or 1) * c.optimizer_bytes / bandwidth
    blocks = getattr(config, "num_hidden_layers", 1) or 1
    mode, shards = cfg.parallel.activation_checkpointing, facts.shards_params
    bf16_gemm = sum(p.bf16_s for p in preds.values())
    fp8_gemm = bf16_gemm - sum(preds[n].bf16_s - preds[n].fp8_gemm_s for n in fp8_names)
    fp8_casts = sum(preds[n].cast_s for n in fp8_names)
    sides = []
    for gemm, casts, fp8 in ((bf16_gemm, 0.0, 0), (fp8_gemm, fp8_casts, fp8_params)):
        collectives = _collectives(spec, facts, world_size, (params, trainable), fp8, reduce_bytes, *topology[:2], c)
        sides.append(_parts(gemm, casts, attention_s, memory_s, optimizer_s, collectives, mode, blocks, shards, c))
    flops = 6 * sum(k * o for _, k, o in shapes) + attention_flops
    calibrated = spec.key == c.fitted_gpu and recipe in c.fitted_recipes and compile
    return StepTime(spec.key, spec.label, recipe, world_size, tokens // seq_len, seq_len,
                    compile, mode, len(fp8_names), params, trainable, *topology, flops, sides[0], sides[1], calibrated,
                    world_size // (facts.shard_degree or world_size) if facts.shards_params else 1,
                    cfg.parallel.reduce_dtype)


def compare_step_recipes(model_or_config: Any, *, target: str | Hardware | GpuSpec,
                         recipes: tuple[str, ...] | None = None, fp8: str = TorchaoBackend.name,
                         **options: Any) -> tuple[StepTime, ...]:
    """:func:`predict_step` under several recipes, the model built once; ``recipes`` None: every Linear recipe of the
    backend that ``target`` runs; ``options``: :func:`predict_step`'s other keywords."""
    model = _meta_model(model_or_config)
    names = recipes if recipes is not None else recipes_for(fp8, target)
    return tuple(predict_step(model, target=target, fp8=fp8, recipe=r, **options) for r in names)


def fastest(steps: tuple[StepTime, ...]) -> StepTime | None:
    """The recipe predicted fastest (None when no recipe is predicted faster than bf16)."""
    best = max(steps, key=lambda s: s.speedup, default=None)
    return best if best is not None and best.speedup > 1 else None
