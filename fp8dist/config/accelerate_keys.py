"""What each key of a file written by ``accelerate config`` becomes in fp8dist, as tables :mod:`.accelerate` reads.
The strategy or FP8 backend a value selects is declared by the axis value (``Strategy.accelerate``,
``FP8Backend.accelerate_backend``), read from the registries."""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .axis import BACKENDS, STRATEGIES
from .options import FP8Config, StrategyConfig
from .schema import flat_fields

__all__ = ["NO_ACCELERATE_KEY", "targets"]


class _Mark(enum.Enum):
    SAME = "accepted: fp8dist does this anyway"
    LEAVE = "set by another key"


class _Refuse(str):
    """A value with no fp8dist equivalent; the text says what fp8dist does instead and the way out."""


@dataclass(frozen=True)
class _Rule:
    to: tuple[str, ...] = ()  # the fp8dist keys it sets (with several, each value below is a tuple)
    values: Mapping[Any, Any] | None = None  # Accelerate -> fp8dist value, SAME or _Refuse; None: as given
    convert: Callable[[Any], Any] | None = None  # Accelerate's spelling of a value given as is -> fp8dist's
    other: str = ""  # why any value outside ``values`` is refused; empty: it is a typo among the choices
    launcher: bool = False  # read only by ``accelerate launch``: named in the launcher notice
    model: str = ""  # with a true value: about how the model is built; this line goes in the model notice


def _to(key: str, values: Mapping[Any, Any] | None = None, convert: Callable[[Any], Any] | None = None) -> _Rule:
    return _Rule(to=(key,), values=values, convert=convert)


def _only(why: str, *accepted: Any) -> _Rule:
    """A key accepted only with the values fp8dist has anyway; any other is refused with ``why``."""
    return _Rule(values={value: _Mark.SAME for value in accepted}, other=why)


class _Registry(Mapping):
    """A value table built from the axis registries at each read; ``first``: the order messages list values in."""

    def __init__(self, build: Callable[[], Iterator[tuple[Any, Any]]], first: tuple[Any, ...] = ()) -> None:
        self._build, self._first = build, first

    def _table(self) -> dict[Any, Any]:
        built = dict(self._build())
        return {**{key: built[key] for key in self._first if key in built}, **built}

    def __getitem__(self, key: Any) -> Any:
        return self._table()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def _claims(key: str) -> dict[Any, list[str]]:
    """Accelerate's value of ``key`` -> the strategies that claim it."""
    out: dict[Any, list[str]] = {}
    for name, strategy in STRATEGIES.items():
        given = strategy.accelerate.get(key, ())
        for value in given if isinstance(given, tuple) else (given,):
            out.setdefault(value, []).append(name)
    return out


def _distributed_types() -> Iterator[tuple[str, Any]]:
    """distributed_type -> (strategy, device); LEAVE where several strategies share it (fsdp_version decides)."""
    claims = _claims("distributed_type")
    for value, names in claims.items():
        yield value, (names[0] if len(names) == 1 else _Mark.LEAVE, _DEVICE_OF.get(value, _Mark.LEAVE))
    yield from ((value, refusal) for value, refusal in _NO_STRATEGY.items() if value not in claims)


def _listed(value: Any) -> Any:
    """A list Accelerate writes as text: "LlamaDecoderLayer,LlamaMLP", "(false, false, true)"."""
    if isinstance(value, str):
        return [item.strip() for item in value.strip("()[] ").split(",") if item.strip()]
    return value


_LAUNCHER = _Rule(launcher=True)
_TPU = ("TPUs are not fp8dist's: it runs on CUDA GPUs and CPUs. Remove the key, or start TPU jobs with "
        "accelerate launch")
_BACKEND = ("fp8dist compiles each block with torch.compile's default backend (inductor). Use INDUCTOR, or NO for "
            "no compile")
_COMPILE_ONLY = "fp8dist compiles each block with torch.compile's defaults. Remove the key"
_HYBRID = "HYBRID"  # the sharding keys' HSDP values: replicate_degree comes from num_machines
_NVME = ("fp8dist offloads to the CPU only. Use cpu, or put the NVMe offload block in your own DeepSpeed json "
         "(deepspeed_config_file)")
_OTHER_DEVICE = _Refuse("fp8dist runs on CUDA GPUs and CPUs. Use MULTI_GPU, FSDP or DEEPSPEED on GPUs, NO or "
                        "MULTI_CPU on CPUs")

_DEVICE_OF = {"MULTI_CPU": "cpu"}
_NO_STRATEGY = {  # distributed types no fp8dist strategy claims
    "MEGATRON_LM": _Refuse("fp8dist has no Megatron-LM tensor/pipeline parallelism. Use FSDP or DEEPSPEED"),
    "XLA": _Refuse(_TPU),
    **dict.fromkeys(("MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON"),
                    _OTHER_DEVICE)}

_TOP: dict[str, _Rule] = {
    "compute_environment": _only("fp8dist does not start SageMaker jobs. Run it on the instances with torchrun, "
                                 "deepspeed or srun and write LOCAL_MACHINE", "LOCAL_MACHINE"),
    "distributed_type": _Rule(to=("strategy", "device"), values=_Registry(
        _distributed_types, first=("NO", "MULTI_GPU", "MULTI_CPU", "FSDP", "DEEPSPEED"))),
    "mixed_precision": _Rule(to=("param_dtype", "fp8"), values={
        "no": ("fp32", None), "fp16": ("fp16", None), "bf16": ("bf16", None),
        "fp8": ("bf16", _Mark.LEAVE)}),  # the backend comes from fp8_config.backend
    "fp16": _to("param_dtype", {True: "fp16", False: _Mark.SAME}),  # Accelerate's older spelling of fp16
    "use_cpu": _to("device", {True: "cpu", False: _Mark.SAME}),
    "debug": _only("Accelerate's debug mode checks the shapes of every collective; fp8dist has none. For torch's "
                   "own checks set TORCH_DISTRIBUTED_DEBUG=DETAIL in the environment", False),
    "enable_cpu_affinity": _only("fp8dist does not pin processes to NUMA nodes. Launch with torchrun "
                                 "--numa-binding node (or numactl)", False),
    "downcast_bf16": _only(_TPU, "no", False),
    "dynamo_backend": _to("compile", {"NO": _Mark.SAME, "INDUCTOR": True}),  # older place of dynamo_config's
    **dict.fromkeys(("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                     "rdzv_backend", "same_network", "gpu_ids", "main_training_function"), _LAUNCHER),
    **dict.fromkeys(("tpu_name", "tpu_zone", "tpu_vm", "tpu_env", "commands", "command_file"), _only(_TPU)),
    **dict.fromkeys(("tpu_use_cluster", "tpu_use_sudo"), _only(_TPU, False)),
}

_RESHARD = {True: True, False: False, "FULL_SHARD": True, "SHARD_GRAD_OP": False,
            "NO_SHARD": _Refuse("NO_SHARD does not shard: use distributed_type: MULTI_GPU (strategy ddp)"),
            "HYBRID_SHARD": True, "HYBRID_SHARD_ZERO2": False}  # + replicate_degree from num_machines (_finish)
_PREFETCH = _only("fp8dist keeps torch's backward prefetch (BACKWARD_PRE under FSDP1; FSDP2 prefetches the next "
                  "block itself)", "BACKWARD_PRE")
_WRAP = ("fp8dist shards block by block: the classes in fsdp_transformer_layer_cls_to_wrap, else the model's "
         "_no_split_modules. Use TRANSFORMER_BASED_WRAP")
_CHECKPOINTS = ("fp8dist.save_checkpoint writes sharded checkpoints (torch.distributed.checkpoint, each rank its "
                "shard). Use SHARDED_STATE_DICT; for one full file convert a checkpoint with "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save")

_FSDP: dict[str, _Rule] = {
    "fsdp_version": _to("strategy", _Registry(lambda: sorted((v, n[0]) for v, n in _claims("fsdp_version").items()))),
    "fsdp_reshard_after_forward": _to("reshard_after_forward", _RESHARD),
    "fsdp_sharding_strategy": _to("reshard_after_forward", _RESHARD),  # FSDP1's older spelling
    "fsdp_transformer_layer_cls_to_wrap": _to("block_classes", convert=_listed),
    "fsdp_auto_wrap_policy": _Rule(values={"TRANSFORMER_BASED_WRAP": _Mark.SAME}, other=_WRAP),
    "fsdp_min_num_params": _only("it belongs to SIZE_BASED_WRAP; fp8dist shards block by block. Remove it "
                                 "(fsdp_transformer_layer_cls_to_wrap picks the blocks)"),
    "fsdp_offload_params": _only("fp8dist does not offload FSDP parameters to the CPU. For CPU offload use "
                                 "distributed_type: DEEPSPEED with deepspeed_config.offload_param_device: cpu "
                                 "(ZeRO-3)", False),
    "fsdp_backward_prefetch": _PREFETCH,
    "fsdp_backward_prefetch_policy": _PREFETCH,  # the older spelling in Accelerate's docs
    "fsdp_forward_prefetch": _only("fp8dist does not prefetch the next forward all-gather explicitly", False),
    "fsdp_state_dict_type": _Rule(values={"SHARDED_STATE_DICT": _Mark.SAME}, other=_CHECKPOINTS),
    "fsdp_use_orig_params": _only("fp8dist's FSDP1 always uses use_orig_params=True: FP8 layers need the real "
                                  "parameters (FSDP2 has nothing else)", True),
    "fsdp_cpu_ram_efficient_loading": _Rule(values={True: _Mark.SAME, False: _Mark.SAME}, model=(
        "fsdp_cpu_ram_efficient_loading: build the model on the meta device (with torch.device('meta'): ...) and pass "
        "pretrained=DIR: each rank then allocates and reads only its own shard of the checkpoint")),
    "fsdp_sync_module_states": _Rule(values={True: _Mark.SAME, False: _Mark.SAME}, model=(
        "fsdp_sync_module_states: fp8dist does not broadcast rank 0's weights; every rank loads the same checkpoint "
        "(or seed), and wrap_model checks that the ranks agree (check_ranks)")),
    "fsdp_activation_checkpointing": _to("activation_checkpointing", {True: "full", False: _Mark.SAME}),
}

_DS_OFFLOAD = {"none": False, "cpu": True, "nvme": _Refuse(_NVME)}
_DEEPSPEED: dict[str, _Rule] = {
    "deepspeed_config_file": _to("ds_config"),
    "zero_stage": _to("zero_stage", {
        0: _Refuse("stage 0 is plain data parallelism. Use zero_stage 1, or distributed_type: MULTI_GPU "
                   "(strategy ddp)"), 1: 1, 2: 2, 3: 3}),
    "offload_optimizer_device": _to("offload_optimizer", _DS_OFFLOAD),
    "offload_param_device": _to("offload_param", _DS_OFFLOAD),
    "offload_optimizer_nvme_path": _only(f"it is read only with NVMe offload. {_NVME}", "none"),
    "offload_param_nvme_path": _only(f"it is read only with NVMe offload. {_NVME}", "none"),
    "gradient_accumulation_steps": _to("grad_accum"),
    "gradient_clipping": _to("gradient_clipping"),
    "zero3_init_flag": _Rule(values={True: _Mark.SAME, False: _Mark.SAME}, model=(
        "zero3_init_flag: build the model on the meta device (with torch.device('meta'): ...), with pretrained=DIR "
        "for its weights: under ZeRO-3 fp8dist partitions it through deepspeed.zero.Init, each rank allocating only "
        "its partitions")),
    "zero3_save_16bit_model": _only(
        "fp8dist saves DeepSpeed checkpoints with the engine's own partitioned checkpointing. For 16-bit weights "
        "set zero_optimization.stage3_gather_16bit_weights_on_model_save in your own DeepSpeed json "
        "(deepspeed_config_file) and call engine.save_16bit_model", False),
    "deepspeed_moe_layer_cls_names": _only("fp8dist does not mark MoE layers as ZeRO-3 leaf modules. Call "
                                           "deepspeed.utils.set_z3_leaf_modules(model, [YourMoEBlock]) before "
                                           "wrap_model and remove the key"),
    **dict.fromkeys(("deepspeed_hostfile", "deepspeed_multinode_launcher", "deepspeed_inclusion_filter",
                     "deepspeed_exclusion_filter"), _LAUNCHER),
}

_DS_FILE_DECIDES = ("zero_stage", "offload_optimizer_device", "offload_param_device", "gradient_accumulation_steps",
                    "gradient_clipping", "zero3_save_16bit_model")  # beside a DeepSpeed json: refused, as Accelerate

_FP8: dict[str, _Rule] = {
    "backend": _to("fp8", _Registry(lambda: ((backend.accelerate_backend, name) for name, backend in BACKENDS.items()
                                             if backend.accelerate_backend), first=("TE", "AO", "MSAMP"))),
    **{key: _to(key) for key in ("fp8_format", "margin", "interval", "amax_history_len", "amax_compute_algo",
                                 "use_autocast_during_eval", "opt_level")},
    "override_linear_precision": _to("override_linear_precision", convert=_listed),
    "amax_history_length": _to("amax_history_len"),  # the wizard's spellings of the three above
    "amax_compute_algorithm": _to("amax_compute_algo"),
    "optimization_level": _to("opt_level"),
    "use_mxfp8_block_scaling": _to("te_recipe", {True: "mxfp8", False: _Mark.SAME}),
    "enable_fsdp_float8_all_gather": _to("fp8_all_gather"),
    "pad_inner_dim": _only("fp8dist does not pad: a Linear whose dims are not multiples of 16 stays in the "
                           "strategy's precision, and the plan lists it", False),
}

_DYNAMO: dict[str, _Rule] = {
    "dynamo_backend": _Rule(to=("compile",), values={"NO": _Mark.SAME, "INDUCTOR": True}, other=_BACKEND),
    "dynamo_mode": _Rule(values={"default": _Mark.SAME}, other=_COMPILE_ONLY),
    "dynamo_use_fullgraph": _Rule(values={False: _Mark.SAME}, other=(
        "fp8dist compiles each block on its own and counts the graph breaks in the plan. Remove the key")),
    "dynamo_use_dynamic": _Rule(values={False: _Mark.SAME}, other=_COMPILE_ONLY),
    "dynamo_use_regional_compilation": _Rule(values={True: _Mark.SAME, False: _Mark.SAME}),  # always, per block
}

_PARALLELISM: dict[str, _Rule] = {
    "parallelism_config_dp_replicate_size": _to("replicate_degree"),
    "parallelism_config_dp_shard_size": _Rule(values=None),  # derived from the world size and replicate_degree
    **{f"parallelism_config_{kind}_size": _only(f"fp8dist has no {what} parallelism", 1)
       for kind, what in (("tp", "tensor"), ("cp", "context"), ("sp", "sequence"))}}


@dataclass(frozen=True)
class _Section:
    rules: Mapping[str, _Rule]
    prefix: str = ""  # Accelerate's launcher takes its keys with or without it ("version" is "fsdp_version")
    needs: str = ""  # the distributed_type with which Accelerate reads the block
    rest: _Rule | None = None  # the rule for keys not in ``rules``; None: such a key is unknown
    own_keys: bool = False  # fp8dist's FP8 keys are accepted in it under their own names


_SECTIONS: dict[str, _Section] = {
    "fsdp_config": _Section(_FSDP, prefix="fsdp_", needs="FSDP"),
    "deepspeed_config": _Section(_DEEPSPEED, needs="DEEPSPEED"),
    "fp8_config": _Section(_FP8, prefix="fp8_", own_keys=True),
    "dynamo_config": _Section(_DYNAMO, prefix="dynamo_"),
    "parallelism_config": _Section(_PARALLELISM, rest=_only("fp8dist has no context or sequence parallelism")),
    "megatron_lm_config": _Section({}, rest=_only("fp8dist has no Megatron-LM: use distributed_type FSDP/DEEPSPEED")),
    "mpirun_config": _Section({}, rest=_LAUNCHER),
}


NO_ACCELERATE_KEY = {
    "reduce_dtype": "Accelerate's FSDP plugin takes its mixed-precision policy in code, not from the config file",
    "reduce_fp8_block": "Accelerate reduces gradients in bf16 or fp32 only: its config file has no FP8 reduction",
    "buffer_dtype": "Accelerate's FSDP plugin takes its mixed-precision policy in code, not from the config file",
    "micro_batch_size": "Accelerate takes the batch size from the script's DataLoader, not from the config file",
    "seq_len": "Accelerate takes the sequence length from the script's data, not from the config file",
    "memory": "Accelerate has no model-state memory level (MS-AMP's opt_level, under fp8_config, is the nearest)",
    "check_ranks": "Accelerate does not compare the ranks' settings or weights",
    "nonfinite_step": "Accelerate's config file has no key for what a step with non-finite gradients does",
    "max_skipped_steps": "Accelerate's config file has no key for what a step with non-finite gradients does",
    "pretrained": "Accelerate loads weights in the script (from_pretrained), not from the config file",
}
"""fp8dist options no Accelerate key sets, and why; every other option is a target of the tables (a test holds this)."""


def targets() -> set[str]:
    """Every fp8dist option some Accelerate key sets."""
    tables = (_TOP, _FSDP, _DEEPSPEED, _FP8, _DYNAMO, _PARALLELISM)
    return {key for table in tables for rule in table.values() for key in rule.to} | set(_schema()[2])


def _schema() -> tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]:
    """fp8dist's fields by key, their types, and the FP8 keys (each registered backend's knobs among them)."""
    flat = [pair for cls in (StrategyConfig, FP8Config) for pair in flat_fields(cls)]
    by_key, hints = {f.name: f for _, f in flat}, {f.name: typing.get_type_hints(owner)[f.name] for owner, f in flat}
    return by_key, hints, tuple(f.name for _, f in flat_fields(FP8Config) if f.name != "fp8")
