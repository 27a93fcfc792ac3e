"""Pre-flight memory estimate: model-state bytes per rank (and activations of one micro-batch) for a strategy, FP8
backend and memory level, on a meta-device model. Model states match :func:`fp8dist.report` to the byte on CPU runs
(TE and MS-AMP rows are derived from their documentation); transient buffers are notes, not counted."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from ..config.text import byte_size as _size
from .estimate_activations import Activations, activation_items
from .optimizers import OPTIMIZER_STATES, STEP_BYTES
from ..config.param_bytes import ParamInfo
from .estimate_states import category_dtypes, element_bytes, fp8_buffer_bytes, param_groups
from .fit import Fit, check_fit
from .rows import text_table
from .tensors import ParamGroup, StateBytes
from ..config.schema import choice_error
from ..config.rules import check, unread_options
from ..config.resolve import Config, resolve_config
from ..config.dtypes import DTYPES, dtype_bytes
from ..runtime.env import runs_on_cpu
from ..runtime.hardware import Hardware, find_gpu, parse_target
from ..config.options import DEFAULT_SEQ_LEN
from ..memory_levels import STANDARD, get_level
from ..fp8 import get_backend
from ..strategies import get_strategy
from ..strategies.grad_fp8 import describe_tally
from ..pipeline.blocks import SELECTIVE_GEMMS

__all__ = ["MemoryEstimate", "estimate_memory", "check_counts", "OPTIMIZER_STATES"]

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}  # the config dtypes, by torch dtype


@dataclass(frozen=True)
class MemoryEstimate(StateBytes):
    """Predicted bytes on one rank, per category of model state, plus activations; ``print`` it for a table."""

    strategy: str
    """The strategy estimated (``strategy=``)."""
    zero_stage: int | None
    """DeepSpeed's ZeRO stage; None for other strategies."""
    fp8: str
    """The FP8 backend estimated ("none" without FP8)."""
    world_size: int
    """Data-parallel ranks the model is spread over."""
    rank: int
    """The rank described: the one holding the most model state unless one was asked for."""
    total_params: int
    """Elements of all parameters of the full model (all ranks)."""
    bytes: Mapping[str, int]
    """Bytes on this rank per category (:data:`~fp8dist.accounting.tensors.CATEGORIES`)."""
    dtypes: Mapping[str, str]
    """The dtypes each category holds, as ``"bf16/fp32"``."""
    micro_batch_size: int
    """Sequences per rank per forward the activations are estimated for."""
    seq_len: int
    """Tokens per sequence the activations are estimated for."""
    activations: tuple[tuple[str, int], ...]
    """(item, bytes) saved for backward for one micro-batch."""
    activations_modelled: bool
    """False (``activations`` empty, a note says why) where no formula covers the model or setting."""
    derived: bool
    """TE / MS-AMP figures come from their documentation, not from a measured run."""
    offloaded: tuple[str, ...]
    """Categories DeepSpeed keeps in host memory; included in ``bytes``."""
    notes: tuple[str, ...]
    """What the user should know of the estimate (assumptions, options it does not read, unmodelled parts)."""
    memory: str = STANDARD.name
    """The memory level estimated (``memory=``)."""
    speed: Any = None
    """The plan's :class:`~fp8dist.plan.selection.Selection` on the GPU ``target=`` named; None without one, or
    where nothing runs in FP8."""
    fit: Fit | None = None
    """Whether a rank fits the ``target=`` GPU and the ways out; None without a target or its memory."""
    groups: tuple[ParamGroup, ...] = ()
    """The frozen (a LoRA base) and the trained parameters apart; () where all train."""
    grad_wire: Any = None
    """reduce_dtype='fp8': the gradient bytes this rank sends per optimizer step (a
    :class:`~fp8dist.strategies.grad_fp8.WireTally`, what ``fp8dist train`` counts at the collectives); else None."""

    @property
    def activation_bytes(self) -> int:
        """The activations' bytes on this rank: the sum of :attr:`activations`."""
        return sum(b for _, b in self.activations)

    def to_dict(self) -> dict[str, Any]:
        """The estimate as JSON data (``fp8dist estimate --json``): every field, with the totals, the step prediction
        and the fit."""
        out = asdict(self)
        out.update(bytes=dict(self.bytes), dtypes=dict(self.dtypes), activations=[list(a) for a in self.activations],
                   offloaded=list(self.offloaded), notes=list(self.notes), model_state_bytes=self.model_state_bytes,
                   activation_bytes=self.activation_bytes, speed=self.speed.to_dict() if self.speed else None,
                   fit=self.fit.to_dict() if self.fit else None)
        return out

    def __str__(self) -> str:
        strategy = self.strategy + (f" (ZeRO-{self.zero_stage})" if self.zero_stage else "")
        summary = get_level(self.memory).summary
        memory = f", memory {self.memory} ({summary})" if summary else ""
        head = (f"fp8dist estimate: strategy {strategy}, fp8 {self.fp8}, world size {self.world_size}, rank "
                f"{self.rank}, {self.total_params:,} parameters"
                + (f" ({self.groups[0].params:,} frozen)" if self.groups else "") + memory
                + (" (TE/MS-AMP rows derived, not measured)" if self.derived else ""))
        rows = self.state_rows(_size, self.offloaded)
        acts = [[item, _size(b)] for item, b in self.activations]
        if self.activations_modelled:
            acts.append(["total activations (estimate)", _size(self.activation_bytes)])
            total = f"total: {_size(self.model_state_bytes + self.activation_bytes)} per rank"
        else:
            acts.append(["not estimated for this model (see the note)", "-"])
            total = f"total: {_size(self.model_state_bytes)} per rank in model states; activations not estimated"
        lines = [head, text_table(["model state (per rank)", "bytes/param", "size", "dtypes"], rows), "",
                 *self.group_table(_size),
                 text_table([f"activations (micro-batch {self.micro_batch_size} x seq {self.seq_len})", "size"], acts),
                 "", total]
        if self.fit is not None:
            lines += self.fit.lines(_size)
        if self.speed is not None and self.speed.step is not None:
            lines.append(self.speed.gemm_summary())
        if self.grad_wire is not None:
            lines.append(f"gradient wire: {describe_tally(self.grad_wire, 'fp8 e4m3 blocks, fp32 scales')}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def check_counts(world_size: Any, micro_batch_size: Any, seq_len: Any, cfg: Config) -> None:
    """Check an estimate's counts before anything is built: ``world_size`` (ranks), ``micro_batch_size`` (sequences
    per rank per forward) and ``seq_len`` (tokens per sequence) must be positive integers, and ``cfg`` must run on
    ``world_size`` ranks. ValueError naming the value otherwise (or the combination rule refusing it)."""
    for name, value, what in (("world_size", world_size, "the number of data-parallel ranks (GPUs)"),
                              ("micro_batch_size", micro_batch_size, "sequences per rank per forward"),
                              ("seq_len", seq_len, "tokens per sequence")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer ({what}).")
    check(cfg, world_size=world_size)


def _param_infos(model: nn.Module, cfg: Config, plan: Any, blocks: list[str], optimizer: str, engine: Any) -> \
        list[ParamInfo]:
    unit_of: dict[str, str] = {}
    for block in blocks:  # innermost first
        for name, _ in model.get_submodule(block).named_parameters():
            unit_of.setdefault(f"{block}.{name}", block)
    converted = {f"{e.name}.weight" for e in plan.fp8}
    level, backend = get_level(cfg.parallel.memory), get_backend(cfg.precision.fp8)
    infos = []
    for name, p in model.named_parameters():
        dtype = _DTYPE_NAMES.get(p.dtype, "fp32")
        per_element = element_bytes(engine, level, backend, cfg, optimizer, dtype, name in converted, p.requires_grad)
        infos.append(ParamInfo(name, p.numel(), tuple(p.shape), unit_of.get(name, ""), per_element, p.requires_grad))
    return infos


_READ_BY_THE_ESTIMATE = ("micro_batch_size", "seq_len")
"""Options the estimate reads itself (the activations' batch shape) whether or not an axis of the run does."""


def estimate_memory(model: nn.Module, config: Any = None, *, world_size: int = 1, micro_batch_size: int | None = None,
                    seq_len: int | None = None, optimizer: str = "adamw", rank: int | None = None,
                    fp8_filter: Any = None, target: str | Hardware | None = None, numerics: Any = None,
                    loss_chunks: int = 1, selective_gemms: Sequence[str] | None = None,
                    **overrides: Any) -> MemoryEstimate:
    """Predict per-rank model-state bytes (and activations of one micro-batch) of ``wrap_model(model, ...)``, on
    a meta-device model (nothing is allocated) or a real one (nothing is changed).

    Args:
        model: the unwrapped model (activations: a Hugging Face llama, mixtral, gpt2 or gpt_neox).
        config, **overrides: as for :func:`fp8dist.wrap_model`.
        world_size: data-parallel ranks.
        micro_batch_size: sequences per rank per forward; default: the config's.
        seq_len: tokens per sequence; default: the config's, else ``DEFAULT_SEQ_LEN`` (2048).
        optimizer: "adamw" / "adam" (2 states), "sgd_momentum" (1) or "sgd" (none).
        rank: default: the one holding the most model state (shards may be uneven).
        fp8_filter: ``(module, fqn) -> bool``, as for ``wrap_model``.
        target: the GPU the run is for ("h100", a :class:`~fp8dist.runtime.hardware.Hardware`): the plan is made for
            it, with its GEMM time (``speed``) and whether a rank fits (``fit``); None: planned as if FP8 ran here,
            no GEMM time.
        numerics: a probe's report, as for ``wrap_model``: the layers it keeps out of FP8, and under
            ``reduce_dtype="fp8"`` the gradients it reduces in fp32 (``grad_wire``).
        loss_chunks: the training loop computes the output head and the loss this many chunks of the sequence at a
            time (torchtitan's ``ChunkedLossWrapper``: 8); 1 (default): the whole micro-batch's logits at once, as a
            Hugging Face model's loss does (its logits and their fp32 log-softmax held together).
        selective_gemms: under ``activation_checkpointing="selective"``, the ops whose every other output the policy
            keeps (each converted Linear's op: its recipe's ``checkpoint_gemm``); None (default): fp8dist's own policy,
            :data:`fp8dist.pipeline.blocks.SELECTIVE_GEMMS`. torchtitan's counts ``("aten.mm.default",
            "aten.linear.default")``.

    Returns:
        A :class:`MemoryEstimate`; ``print`` it for a table.

    Raises:
        ValueError: a bad option, named with its choices and the way out.

    Example::

        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        print(fp8dist.estimate_memory(model, strategy="fsdp", fp8="torchao", world_size=8, seq_len=4096))
    """
    cfg = resolve_config(config, **overrides)
    micro = cfg.parallel.micro_batch_size if micro_batch_size is None else micro_batch_size
    seq_len = seq_len if seq_len is not None else cfg.parallel.seq_len or DEFAULT_SEQ_LEN
    check_counts(world_size, micro, seq_len, cfg)
    if optimizer not in OPTIMIZER_STATES:
        raise choice_error("optimizer", optimizer, OPTIMIZER_STATES,
                           "Its states per parameter decide the optimizer_states bytes.")
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1} (world_size={world_size}).")
    if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int) or not 1 <= loss_chunks <= seq_len:
        raise ValueError(f"loss_chunks={loss_chunks!r} must be an integer from 1 (the whole sequence's logits at "
                         f"once) to seq_len={seq_len} (the chunks the loss splits the sequence into).")
    if isinstance(selective_gemms, str):
        raise ValueError(f"selective_gemms={selective_gemms!r} must be a sequence of op names, e.g. "
                         "('aten.mm.default',); None: fp8dist's own policy.")
    level = get_level(cfg.parallel.memory)
    # each said once as a warning, as wrap_model does; but the activations read the batch shape whatever the axes
    notes = [note for option, note in unread_options(cfg).items() if option not in _READ_BY_THE_ESTIMATE]
    if level.builds_optimizer and optimizer != level.estimate_optimizer:
        notes.append(f"optimizer={optimizer!r} has no effect here (memory={level.name!r} builds its own optimizer: "
                     f"{level.summary}).")
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=2)
    hardware = parse_target(target) if isinstance(target, str) else target
    # what the ways out of a fit keep: all but the config and the rank count
    job = partial(_estimate, model, micro=micro, seq_len=seq_len, optimizer=optimizer, fp8_filter=fp8_filter,
                  hardware=hardware, numerics=numerics, loss_chunks=loss_chunks,
                  selective_gemms=SELECTIVE_GEMMS if selective_gemms is None else tuple(selective_gemms))
    est = job(cfg, world_size, rank)
    if hardware is None:
        return est
    gpu = find_gpu(hardware)
    if gpu.spec is None:
        return replace(est, notes=(*est.notes, f"whether a rank fits is not judged: {gpu.reason}"))

    def rerun(world: int, **changes: Any) -> MemoryEstimate:
        return job(resolve_config(cfg, **changes), world, None)

    # HSDP's rank counts are multiples of its replicas, where the strategy reads replicate_degree at all
    step = 1 if "replicate_degree" in unread_options(cfg) else cfg.parallel.replicate_degree
    return replace(est, fit=check_fit(est, gpu.spec.label, int(gpu.spec.memory_gib * 2**30), rerun, rank_step=step))


def _estimate(model: nn.Module, cfg: Config, world_size: int, rank: int | None, *, micro: int, seq_len: int,
              optimizer: str, fp8_filter: Any, hardware: Hardware | None, numerics: Any = None, loss_chunks: int = 1,
              selective_gemms: Sequence[str] = ()) -> MemoryEstimate:
    from ..plan.precision import plan_precision
    from ..strategies.common import find_blocks

    strategy = get_strategy(cfg.parallel.strategy)
    level = get_level(cfg.parallel.memory)
    backend = get_backend(cfg.precision.fp8)
    check_counts(world_size, micro, seq_len, cfg)
    strategy.check_launch(cfg, world_size)
    optimizer = level.estimate_optimizer if level.builds_optimizer else optimizer  # the level's own
    # the plan predicts FP8 speed at the tokens estimated here
    shaped = replace(cfg, parallel=replace(cfg.parallel, micro_batch_size=micro, seq_len=seq_len))
    plan = plan_precision(model, shaped, device=hardware or torch.device("cpu"), world_size=world_size,
                          fp8_filter=fp8_filter, check_hardware=False, numerics=numerics)
    backend.check_plan(plan)  # what wrap_model would refuse, refused here too
    blocks = [n for n, _ in find_blocks(model, cfg.parallel.block_classes)[0]]
    on_cpu = hardware is None and runs_on_cpu(cfg.parallel.device)
    engine = strategy.estimate_engine(model, cfg, world_size, blocks, optimizer=optimizer, on_cpu=on_cpu)
    params = _param_infos(model, cfg, plan, blocks, optimizer, engine)
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters: nothing to estimate.")
    layout = partial(strategy.rank_state_bytes, cfg=cfg, world_size=world_size, engine=engine,
                     step=STEP_BYTES.get(optimizer, 0), level_states=level.local_state_bytes,
                     backend_optimizer=backend.owns_optimizer)
    per_rank = layout(params)
    # the rank holding the most model state (the lowest such)
    chosen = max(range(len(per_rank)), key=lambda r: sum(per_rank[r].values())) if rank is None else rank
    on_rank = lambda group: layout(group)[chosen]  # noqa: E731  (the layout of any group of parameters, this rank)
    fp8_bytes, kept_fp8 = fp8_buffer_bytes(backend, cfg, plan, params, on_rank)
    c = dtype_bytes(engine.dtype or cfg.parallel.param_dtype)
    stored = dtype_bytes(_DTYPE_NAMES.get(next(model.parameters()).dtype, "fp32"))
    acts: Activations = activation_items(model, plan, cfg, blocks, micro_batch_size=micro, seq_len=seq_len,
                                         stored_bytes=stored, c=c, selective_gemms=selective_gemms,
                                         loss_chunks=loss_chunks, hardware=hardware)
    derived = [f"fp8={backend.name}: figures derived from its documented behaviour, not measured here"]
    return MemoryEstimate(
        strategy=strategy.name, zero_stage=engine.stage, fp8=backend.name, world_size=world_size, rank=chosen,
        total_params=sum(p.numel for p in params), bytes={**per_rank[chosen], "fp8_buffers": fp8_bytes},
        dtypes=category_dtypes(params, fp8_bytes, kept_fp8), micro_batch_size=micro, seq_len=seq_len,
        activations=tuple(acts.items), activations_modelled=acts.modelled, derived=backend.derived_bytes,
        offloaded=engine.offloaded, memory=level.name, speed=plan.selection if hardware is not None else None,
        groups=param_groups(params, on_rank, sum(per_rank[chosen].values())),
        grad_wire=strategy.grad_wire(model, cfg, world_size, blocks,
                                     tuple(e.name for e in plan if e.reduce_fallback)),
        notes=tuple(derived * backend.derived_bytes) + engine.notes + tuple(acts.notes))
