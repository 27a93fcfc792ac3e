"""Files written by ``accelerate config``, read as fp8dist keys.

The tables below say what each key of Accelerate's config format (``config_args.py``, the wizard in ``cluster.py``,
the spellings its launcher also takes) becomes: an fp8dist key and value; nothing, quietly, when the value is what
fp8dist does anyway (``fsdp_use_orig_params: true``); a name in the one launcher notice (``num_processes``); or a
ValueError naming the key, the value, what fp8dist accepts and the way out. fp8dist's own keys may stand beside.

Example::

    flat = translate_accelerate_config(yaml.safe_load(text), source="default_config.yaml")
"""

from __future__ import annotations

import difflib
import enum
import functools
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ._schema import BOOL_WORDS, choice_error, normalize_value
from .options import FP8Config, StrategyConfig

__all__ = ["translate_accelerate_config"]


class _Mark(enum.Enum):
    SAME = "accepted: fp8dist does this anyway"
    LEAVE = "set by another key"


class _Refuse(str):
    """A value fp8dist has no equivalent for; the text says what fp8dist does instead and the way out."""


@dataclass(frozen=True)
class _Rule:
    """What one Accelerate key becomes."""

    to: tuple[str, ...] = ()  # the fp8dist keys it sets (with several, each value below is a tuple)
    values: Mapping[Any, Any] | None = None  # Accelerate -> fp8dist value, SAME or _Refuse; None: as given
    convert: Callable[[Any], Any] | None = None  # Accelerate's spelling of a value given as is -> fp8dist's
    other: str = ""  # why any value outside ``values`` is refused; empty: it is a typo among the choices
    launcher: bool = False  # read only by ``accelerate launch``: named in the launcher notice


def _to(key: str, values: Mapping[Any, Any] | None = None, convert: Callable[[Any], Any] | None = None) -> _Rule:
    return _Rule(to=(key,), values=values, convert=convert)


def _only(why: str, *accepted: Any) -> _Rule:
    """A key fp8dist accepts only with the values it has anyway; any other value is refused with ``why``."""
    return _Rule(values={value: _Mark.SAME for value in accepted}, other=why)


def _listed(value: Any) -> Any:
    """A list Accelerate writes as text: "LlamaDecoderLayer,LlamaMLP", "(false, false, true)" (its docs)."""
    if isinstance(value, str):
        return [item.strip() for item in value.strip("()[] ").split(",") if item.strip()]
    return value


_LAUNCHER = _Rule(launcher=True)
_TPU = ("TPUs are not fp8dist's: it runs on CUDA GPUs and CPUs. Remove the key, or start TPU jobs with "
        "accelerate launch")
_COMPILE = ("fp8dist does not torch.compile the model. Remove dynamo_config (or set dynamo_backend: 'NO'), or "
            "compile in your script")
_NO_HSDP = "fp8dist has no hybrid sharding: it shards over every rank. Use FULL_SHARD (or SHARD_GRAD_OP)"
_NVME = ("fp8dist offloads to the CPU only. Use cpu, or put the NVMe offload block in your own DeepSpeed json "
         "(deepspeed_config_file)")
_OTHER_DEVICE = _Refuse("fp8dist runs on CUDA GPUs and CPUs. Use MULTI_GPU, FSDP or DEEPSPEED on GPUs, NO or "
                        "MULTI_CPU on CPUs")

_TOP: dict[str, _Rule] = {
    "compute_environment": _only("fp8dist does not start SageMaker jobs. Run it on the instances with torchrun, "
                                 "deepspeed or srun and write LOCAL_MACHINE", "LOCAL_MACHINE"),
    "distributed_type": _Rule(to=("strategy", "device"), values={
        "NO": ("none", _Mark.LEAVE), "MULTI_GPU": ("ddp", _Mark.LEAVE), "MULTI_CPU": ("ddp", "cpu"),
        "FSDP": (_Mark.LEAVE, _Mark.LEAVE),  # fsdp or fsdp1: fsdp_config.fsdp_version decides
        "DEEPSPEED": ("deepspeed", _Mark.LEAVE),
        "MEGATRON_LM": _Refuse("fp8dist has no Megatron-LM tensor/pipeline parallelism. Use FSDP or DEEPSPEED"),
        "XLA": _Refuse(_TPU),
        **dict.fromkeys(("MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU",
                         "MULTI_NEURON"), _OTHER_DEVICE)}),
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
    "dynamo_backend": _only(_COMPILE, "NO"),  # Accelerate's older place for dynamo_config.dynamo_backend
    **dict.fromkeys(("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                     "rdzv_backend", "same_network", "gpu_ids", "main_training_function"), _LAUNCHER),
    **dict.fromkeys(("tpu_name", "tpu_zone", "tpu_vm", "tpu_env", "commands", "command_file"), _only(_TPU)),
    **dict.fromkeys(("tpu_use_cluster", "tpu_use_sudo"), _only(_TPU, False)),
}

_RESHARD = {True: True, False: False, "FULL_SHARD": True, "SHARD_GRAD_OP": False,
            "NO_SHARD": _Refuse("NO_SHARD does not shard: use distributed_type: MULTI_GPU (strategy ddp)"),
            "HYBRID_SHARD": _Refuse(_NO_HSDP), "HYBRID_SHARD_ZERO2": _Refuse(_NO_HSDP)}
_PREFETCH = _only("fp8dist keeps torch's backward prefetch (BACKWARD_PRE under FSDP1; FSDP2 prefetches the next "
                  "block itself)", "BACKWARD_PRE")
_WRAP = ("fp8dist shards block by block: the classes in fsdp_transformer_layer_cls_to_wrap, else the model's "
         "_no_split_modules. Use TRANSFORMER_BASED_WRAP")
_CHECKPOINTS = ("fp8dist.save_checkpoint writes sharded checkpoints (torch.distributed.checkpoint, each rank its "
                "shard). Use SHARDED_STATE_DICT; for one full file convert a checkpoint with "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save")

_FSDP: dict[str, _Rule] = {
    "fsdp_version": _to("strategy", {1: "fsdp1", 2: "fsdp"}),
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
    "fsdp_cpu_ram_efficient_loading": _only("fp8dist takes a model that is complete on every rank (no loading "
                                            "on rank 0 only). Load the weights on every rank", False),
    "fsdp_sync_module_states": _only("fp8dist does not broadcast rank 0's weights. Build the same model on every "
                                     "rank (same seed or the same checkpoint)", False),
    "fsdp_activation_checkpointing": _only("fp8dist does not apply activation checkpointing. Enable it in the "
                                           "model before wrap_model (Hugging Face: "
                                           "model.gradient_checkpointing_enable())", False),
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
    "zero3_init_flag": _only("fp8dist takes the model built in full, not under deepspeed.zero.Init", False),
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
    "backend": _to("fp8", {"TE": "te", "AO": "torchao", "MSAMP": "msamp"}),
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

_PARALLELISM: dict[str, _Rule] = {f"parallelism_config_{name}": _only(why, 1) for name, why in (
    ("dp_replicate_size", "fp8dist has no hybrid sharding (HSDP). Remove it: fsdp shards over every rank"),
    ("dp_shard_size", "fp8dist's fsdp shards over every rank. Remove it"),
    ("tp_size", "fp8dist has no tensor parallelism"), ("cp_size", "fp8dist has no context parallelism"),
    ("sp_size", "fp8dist has no sequence parallelism"))}


@dataclass(frozen=True)
class _Section:
    """One of Accelerate's nested blocks."""

    rules: Mapping[str, _Rule]
    prefix: str = ""  # Accelerate's launcher takes its keys with or without it ("version" is "fsdp_version")
    needs: str = ""  # the distributed_type with which Accelerate reads the block
    rest: _Rule | None = None  # the rule for keys not in ``rules``; None: such a key is unknown
    own_keys: bool = False  # fp8dist's FP8 keys are accepted in it under their own names


_SECTIONS: dict[str, _Section] = {
    "fsdp_config": _Section(_FSDP, prefix="fsdp_", needs="FSDP"),
    "deepspeed_config": _Section(_DEEPSPEED, needs="DEEPSPEED"),
    "fp8_config": _Section(_FP8, prefix="fp8_", own_keys=True),
    "dynamo_config": _Section({"dynamo_backend": _only(_COMPILE, "NO")}, prefix="dynamo_",
                              rest=_only(_COMPILE, False)),  # dynamo_mode, dynamo_use_fullgraph, ...
    "parallelism_config": _Section(_PARALLELISM, rest=_only("fp8dist has no context or sequence parallelism")),
    "megatron_lm_config": _Section({}, rest=_only("fp8dist has no Megatron-LM: use distributed_type FSDP/DEEPSPEED")),
    "mpirun_config": _Section({}, rest=_LAUNCHER),
}


@dataclass
class _State:
    flat: dict[str, Any]
    origin: dict[str, str] = field(default_factory=dict)  # fp8dist key -> the Accelerate key that set it
    seen: dict[str, Any] = field(default_factory=dict)  # "section.key" -> the table's value it matched
    launcher: list[str] = field(default_factory=list)  # "key=value" for the launcher notice


@functools.cache
def _schema() -> tuple[dict[str, Any], dict[str, Any], tuple[str, ...]]:
    """fp8dist's fields by key, their types, and the FP8 keys (the config dataclasses are the one source)."""
    by_key = {f.name: f for cls in (StrategyConfig, FP8Config) for f in fields(cls)}
    hints = {**typing.get_type_hints(StrategyConfig), **typing.get_type_hints(FP8Config)}
    return by_key, hints, tuple(f.name for f in fields(FP8Config) if f.name != "fp8")


def _normalized(key: str, value: Any, name: str | None = None) -> Any:
    """``value`` of fp8dist key ``key`` as its config dataclass reads it (errors name ``name``)."""
    by_key, hints, _ = _schema()
    return normalize_value(name or key, value, hints[key], by_key[key].metadata.get("aliases"))


def _unset(value: Any) -> bool:
    """Accelerate leaves out what is None or empty (``fsdp_config: {}``, ``main_process_ip: null``)."""
    return value is None or (isinstance(value, (str, list, tuple, dict)) and not value)


def _lookup(values: Mapping[Any, Any], value: Any) -> tuple[Any, Any]:
    """The entry of ``values`` for ``value``: text case-insensitively, booleans also as true/false/yes/no."""
    text = str(value).strip().lower() if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    for key, result in values.items():
        if isinstance(key, bool):
            if value is key or (text in BOOL_WORDS and BOOL_WORDS[text] is key):
                return key, result
        elif text == str(key).lower():
            return key, result
    raise KeyError(value)


def _match(where: str, rule: _Rule, value: Any) -> tuple[Any, Any]:
    """(the table's value, what it becomes) for ``value`` of a key with a value table."""
    values = rule.values or {}
    accepted = [key for key, result in values.items() if not isinstance(result, _Refuse)]
    try:
        key, result = _lookup(values, value)
    except KeyError:
        if not rule.other:
            raise choice_error(where, value, accepted) from None
        key, result = value, _Refuse(rule.other)
    if isinstance(result, _Refuse):
        shown = f" Accepted here: {', '.join(repr(a) for a in accepted)}." if accepted else ""
        raise ValueError(f"{where}={value!r} has no fp8dist equivalent: {result}.{shown}")
    return key, result


def _set_once(state: _State, key: str, value: Any, where: str) -> None:
    """Set fp8dist key ``key``; a different value set before (by the file's own key or another) is an error."""
    if key in state.flat:
        try:
            before = _normalized(key, state.flat[key])
        except ValueError:
            before = state.flat[key]  # reported with the file's own key when the config is built
        if before != value:
            said = f"{state.origin[key]} says" if key in state.origin else "the file also says"
            raise ValueError(f"{where} sets {key}={value!r} but {said} {key}={state.flat[key]!r}: keep one.")
    state.flat[key] = value
    state.origin[key] = where


def _apply(where: str, rule: _Rule, value: Any, state: _State, name: str) -> None:
    """Translate ``value`` of the Accelerate key ``where`` (known to the tables as ``name``) into ``state``."""
    if rule.launcher:
        state.launcher.append(f"{where}={value!r}")
        return
    if rule.values is None:
        key = rule.to[0]
        matched = result = _normalized(key, rule.convert(value) if rule.convert else value, where)
    else:
        matched, result = _match(where, rule, value)
    state.seen[name] = matched
    if result is _Mark.SAME:
        return
    for key, item in zip(rule.to, result if len(rule.to) > 1 else (result,)):
        if item is not _Mark.LEAVE:
            _set_once(state, key, item, where)


def _section_rule(block: str, section: _Section, key: str) -> tuple[str, _Rule]:
    """(the table's name, rule) for ``key`` in Accelerate's ``block``; an unknown key is an error."""
    for name in (key, section.prefix + key, key.removeprefix(section.prefix)):
        if name in section.rules:
            return name, section.rules[name]
    own = _schema()[2] if section.own_keys else ()
    if key in own:
        return key, _to(key)
    if section.rest is not None:
        return key, section.rest
    choices = [*section.rules, *(k for k in own if k not in section.rules)]
    close = difflib.get_close_matches(key, choices, n=1)
    raise ValueError(f"key {key!r} in {block} is not one fp8dist reads; choose one of: {', '.join(choices)}."
                     + (f" Did you mean {close[0]!r}?" if close else " Remove it."))


def _translate_block(block: str, value: Any, state: _State) -> None:
    """One of Accelerate's nested blocks (``fsdp_config: {...}``), key by key."""
    section = _SECTIONS[block]
    if not isinstance(value, Mapping):
        raise ValueError(f"{block} must be a mapping of keys to values, got {value!r}.")
    given = state.seen.get("distributed_type", "none")
    if section.needs and given != section.needs:
        raise ValueError(f"{block} is read only with distributed_type: {section.needs} (this file: {given}). Set "
                         f"distributed_type: {section.needs}, or remove {block}.")
    for key, item in value.items():
        if not _unset(item):
            name, rule = _section_rule(block, section, str(key))
            _apply(f"{block}.{key}", rule, item, state, f"{block}.{name}")


def _check_foreign(key: str) -> None:
    """A top-level key not Accelerate's: fp8dist's passes; a block's key or a near miss of Accelerate's is named."""
    if key in _schema()[0]:
        return
    for block, section in _SECTIONS.items():
        if key in section.rules:
            raise ValueError(f"{key!r} is a key of Accelerate's {block}: put it under {block}:.")
    close = difflib.get_close_matches(key, [*_TOP, *_SECTIONS], n=1, cutoff=0.8)
    if close:
        raise ValueError(f"option {key!r} is neither fp8dist's nor Accelerate's. Did you mean {close[0]!r}?")


def _finish(state: _State) -> None:
    """What depends on several keys: FSDP's version, the FP8 backend, DeepSpeed's json and its offload."""
    if state.seen.get("distributed_type") == "FSDP" and "fsdp_config.fsdp_version" not in state.seen:
        _set_once(state, "strategy", _FSDP["fsdp_version"].values[1],  # type: ignore[index]
                  "distributed_type: FSDP without fsdp_config.fsdp_version (Accelerate's default is 1)")
    if state.seen.get("mixed_precision") == "fp8" and state.flat.get("fp8") in (None, "none"):
        backends = ", ".join(_FP8["backend"].values or {})
        raise ValueError(f"mixed_precision: fp8 needs a backend: set fp8_config.backend to one of {backends} "
                         "(or fp8dist's key fp8).")
    given = {name.split(".", 1)[1]: v for name, v in state.seen.items() if name.startswith("deepspeed_config.")}
    clash = [key for key in _DS_FILE_DECIDES if key in given]
    if given.get("deepspeed_config_file") and clash:
        raise ValueError(f"deepspeed_config.{clash[0]}={given[clash[0]]!r} beside deepspeed_config_file: the DeepSpeed "
                         f"json decides it, as in Accelerate. Set it in {given['deepspeed_config_file']!r} and remove "
                         "it here.")
    stage = given.get("zero_stage", _schema()[0]["zero_stage"].default)
    if given.get("offload_param_device") == "cpu" and stage != 3:
        raise ValueError(f"deepspeed_config.offload_param_device='cpu' with zero_stage {stage}: only ZeRO-3 "
                         "partitions parameters. Use zero_stage: 3, or offload_param_device: none "
                         "(offload_optimizer_device: cpu offloads the optimizer states).")


def translate_accelerate_config(data: Mapping[str, Any], *, source: str = "config") -> dict[str, Any]:
    """fp8dist's flat keys for a config that may hold Accelerate's (a file written by ``accelerate config``).

    fp8dist's own keys pass through; Accelerate's are translated by this module's tables. The keys only the
    launcher reads are named together in one UserWarning. Two keys setting one fp8dist key differently
    (``fp8: te`` beside ``fp8_config.backend: AO``) are an error.

    Args:
        data: the file's top-level mapping.
        source: where it came from (a file name), for the messages.

    Returns:
        A flat ``{fp8dist key: value}`` dict, not validated yet (:meth:`fp8dist.Config.from_dict` does that);
        a ValueError names a key or value with no fp8dist equivalent, what fp8dist accepts and the way out.
    """
    ours = [*_TOP, *_SECTIONS]  # this order: distributed_type before the blocks it gates
    state = _State(flat={k: v for k, v in data.items() if k not in ours})
    try:
        for key in state.flat:
            _check_foreign(str(key))
        for key in (k for k in ours if k in data and not _unset(data[k])):
            if key in _SECTIONS:
                _translate_block(key, data[key], state)
            else:
                _apply(key, _TOP[key], data[key], state, key)
        _finish(state)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    if state.launcher:
        warnings.warn(f"{source}: Accelerate keys for the launcher, not read here: {', '.join(state.launcher)}. "
                      "fp8dist takes the processes from the launcher that starts them (torchrun, deepspeed, srun; "
                      "see launch/).", UserWarning, stacklevel=3)
    return state.flat
