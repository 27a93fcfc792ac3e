"""Files written by ``accelerate config`` load as they are (fp8dist/config/accelerate.py): every key with an
fp8dist equivalent is translated, the launcher's keys are named in one warning, anything else is an error naming
the key, the value and the way out.

The three files below are written by hand from Accelerate's config format (``ClusterConfig.to_yaml_file`` /
``to_json_file`` of the answers the ``accelerate config`` wizard takes), every top-level key it writes included.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from fp8dist import Config, FP8Config, StrategyConfig, get_wrap_info, resolve_config, wrap_model
from fp8dist.cli import main
from fp8dist.train.models import build_llama

# single machine, FSDP2, torchao FP8 with FP8 all-gather; blocks from _no_split_modules (no class list)
FSDP2_AO = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fp8_config:
  backend: AO
  enable_fsdp_float8_all_gather: true
  pad_inner_dim: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: fp8
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

# single machine, FSDP1 (SHARD_GRAD_OP), Transformer Engine with the wizard's own spellings of the TE knobs
FSDP1_TE = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fp8_config:
  amax_compute_algorithm: most_recent
  amax_history_length: 16
  backend: TE
  fp8_format: E4M3
  interval: 1
  margin: 1
  override_linear_precision:
  - false
  - false
  - true
  use_autocast_during_eval: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: false
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: SHARD_GRAD_OP
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: false
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_training_function: main
mixed_precision: fp8
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

# two machines, DeepSpeed ZeRO-3 with optimizer offload, Transformer Engine; JSON, as to_json_file writes it
DEEPSPEED_TE = json.dumps({
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "deepspeed_config": {
        "deepspeed_hostfile": "/job/hostfile",
        "deepspeed_multinode_launcher": "pdsh",
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "offload_optimizer_device": "cpu",
        "offload_param_device": "none",
        "zero3_init_flag": False,
        "zero3_save_16bit_model": False,
        "zero_stage": 3,
    },
    "distributed_type": "DEEPSPEED",
    "downcast_bf16": "no",
    "enable_cpu_affinity": False,
    "fp8_config": {
        "amax_compute_algorithm": "max",
        "amax_history_length": 1024,
        "backend": "TE",
        "fp8_format": "HYBRID",
        "interval": 1,
        "margin": 0,
        "override_linear_precision": [False, False, False],
        "use_autocast_during_eval": True,
    },
    "machine_rank": 0,
    "main_process_ip": "10.0.0.1",
    "main_process_port": 29500,
    "main_training_function": "main",
    "mixed_precision": "fp8",
    "num_machines": 2,
    "num_processes": 16,
    "rdzv_backend": "static",
    "same_network": True,
    "tpu_env": [],
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "use_cpu": False,
}, indent=2, sort_keys=True) + "\n"

# the 18 top-level keys accelerate config writes for one machine (main_process_ip/port and gpu_ids stay None and
# are left out for FSDP / DeepSpeed on one machine)
ACCELERATE_KEYS = {"compute_environment", "debug", "distributed_type", "downcast_bf16", "enable_cpu_affinity",
                   "fp8_config", "machine_rank", "main_training_function", "mixed_precision", "num_machines",
                   "num_processes", "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo",
                   "use_cpu"}
NOTICE_END = ("fp8dist takes the processes from the launcher that starts them (torchrun, deepspeed, srun; see "
              "launch/).")

FILES = {
    "fsdp2_ao.yaml": (FSDP2_AO, ACCELERATE_KEYS | {"fsdp_config"},
                      {"strategy": "fsdp", "fp8": "torchao", "fp8_all_gather": True},
                      "num_processes=2, num_machines=1, machine_rank=0, rdzv_backend='static', same_network=True, "
                      "main_training_function='main'",
                      "precision plan: fp8=torchao (recipe tensorwise, module_swap (auto), FP8 all-gather on), "
                      "strategy=fsdp -- "),
    "fsdp1_te.yaml": (FSDP1_TE, ACCELERATE_KEYS | {"fsdp_config"},
                      {"strategy": "fsdp1", "block_classes": ["LlamaDecoderLayer"], "reshard_after_forward": False,
                       "fp8": "te", "fp8_format": "E4M3", "margin": 1, "amax_history_len": 16,
                       "amax_compute_algo": "most_recent", "override_linear_precision": [False, False, True]},
                      "num_processes=8, num_machines=1, machine_rank=0, rdzv_backend='static', same_network=True, "
                      "main_training_function='main'",
                      "precision plan: fp8=te (DelayedScaling E4M3, margin 1, amax_history_len 16, amax_compute_algo "
                      "most_recent), strategy=fsdp1 -- "),
    "deepspeed_te.json": (DEEPSPEED_TE, ACCELERATE_KEYS | {"deepspeed_config", "main_process_ip", "main_process_port"},
                          {"strategy": "deepspeed", "zero_stage": 3, "grad_accum": 4, "gradient_clipping": 0.5,
                           "offload_optimizer": True, "fp8": "te", "use_autocast_during_eval": True},
                          "num_processes=16, num_machines=2, machine_rank=0, main_process_ip='10.0.0.1', "
                          "main_process_port=29500, rdzv_backend='static', same_network=True, "
                          "main_training_function='main', deepspeed_config.deepspeed_hostfile='/job/hostfile', "
                          "deepspeed_config.deepspeed_multinode_launcher='pdsh'",
                          "precision plan: fp8=te (DelayedScaling HYBRID, margin 0, amax_history_len 1024, "
                          "amax_compute_algo max), strategy=deepspeed -- "),
}


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _resolve(source) -> tuple[Config, list[str]]:
    """The config and every warning resolving it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = resolve_config(source)
    return config, [f"{w.category.__name__}: {w.message}" for w in caught]


def _changed(config: Config) -> dict:
    """The strategy, the FP8 backend and every key whose value differs from fp8dist's default."""
    default = Config().to_dict()
    return {k: v for k, v in config.to_dict().items() if v != default[k] or k in ("strategy", "fp8")}


@pytest.mark.parametrize("name", FILES)
def test_accelerate_file_resolves_to_exact_config_and_one_launcher_notice(tmp_path, name):
    text, keys, changed, launcher, _ = FILES[name]
    data = json.loads(text) if name.endswith(".json") else yaml.safe_load(text)
    assert set(data) == keys  # the file holds what accelerate config writes, nothing less
    path = _write(tmp_path, name, text)
    config, notes = _resolve(path)
    assert _changed(config) == changed
    assert notes == [f"UserWarning: {path}: Accelerate keys for the launcher, not read here: {launcher}. "
                     + NOTICE_END]


def test_fsdp1_te_file_every_field():
    config, _ = _resolve(yaml.safe_load(FSDP1_TE))
    assert config == Config(
        parallel=StrategyConfig(strategy="fsdp1", param_dtype="bf16", reduce_dtype="fp32", buffer_dtype="fp32",
                                block_classes=("LlamaDecoderLayer",), reshard_after_forward=False, device="auto"),
        precision=FP8Config(fp8="te", te_recipe="delayed", fp8_format="E4M3", margin=1, interval=1,
                            amax_history_len=16, amax_compute_algo="most_recent",
                            override_linear_precision=(False, False, True), use_autocast_during_eval=False))


@pytest.mark.parametrize("name", FILES)
def test_plan_cli_reads_accelerate_file(tmp_path, capsys, name):
    text, *_, header = FILES[name]
    path = _write(tmp_path, name, text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the launcher notice, checked above
        assert main(["plan", "--config", str(path), "--ignore-hardware"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].startswith(header)
    assert "model.layers.0.mlp.up_proj" in captured.out


def test_fsdp2_torchao_file_trains_one_step(tmp_path, one_rank_group):
    path = _write(tmp_path, "fsdp2_ao.yaml", FSDP2_AO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = wrap_model(build_llama("tiny"), config=path)
    launcher = [w for w in caught if "for the launcher, not read here" in str(w.message)]
    assert len(launcher) == 1
    info = get_wrap_info(model)
    assert (info.config.parallel.strategy, info.config.precision.fp8) == ("fsdp", "torchao")
    up_proj = model.model.layers[0].mlp.up_proj
    assert type(up_proj).__name__ == "Float8Linear"
    assert type(up_proj.weight).__name__ == "DTensor"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = up_proj.weight.full_tensor().clone()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and 4.0 < loss.item() < 7.0  # about ln(256) = 5.5 for a fresh model
    assert not torch.equal(before, up_proj.weight.full_tensor())


def test_launcher_spellings_and_documented_forms(tmp_path):
    """The launcher's spellings (keys without fsdp_, with fp8_), and the docs' forms of lists as text."""
    config, notes = _resolve({
        "distributed_type": "FSDP", "mixed_precision": "fp8",
        "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": "LlamaDecoderLayer, LlamaMLP",
                        "reshard_after_forward": "false", "backward_prefetch_policy": "BACKWARD_PRE"},
        "fp8_config": {"fp8_backend": "te", "override_linear_precision": "(false, true, false)",
                       "use_mxfp8_block_scaling": False, "fp8_exclude": ["lm_head"]},
        "main_process_ip": None, "gpu_ids": None, "main_process_port": None,
        "megatron_lm_config": {}, "dynamo_config": {"dynamo_backend": "NO"}, "compute_environment": "LOCAL_MACHINE",
    })
    assert notes == []  # null and empty launcher keys ask the launcher for nothing
    assert _changed(config) == {"strategy": "fsdp", "block_classes": ["LlamaDecoderLayer", "LlamaMLP"],
                                "reshard_after_forward": False,
                                "fp8": "te", "override_linear_precision": [False, True, False],
                                "fp8_exclude": ["lm_head"]}
    mxfp8, _ = _resolve({"mixed_precision": "fp8", "fp8_config": {"backend": "TE", "use_mxfp8_block_scaling": True}})
    assert mxfp8.precision.te_recipe == "mxfp8"
    ddp, _ = _resolve({"distributed_type": "MULTI_CPU", "mixed_precision": "no", "fp16": False})
    assert _changed(ddp) == {"strategy": "ddp", "device": "cpu", "param_dtype": "fp32", "fp8": None}
    fsdp1, _ = _resolve({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}})
    assert _changed(fsdp1) == {"strategy": "fsdp1", "fp8": None}  # no fsdp_version: Accelerate's default, 1
    ds, _ = _resolve({"distributed_type": "DEEPSPEED", "mixed_precision": "fp16",
                      "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero3_init_flag": False}})
    assert _changed(ds) == {"strategy": "deepspeed", "param_dtype": "fp16", "ds_config": "ds.json", "fp8": None}
    old_place, _ = _resolve({"dynamo_backend": "INDUCTOR"})  # Accelerate's older place for the dynamo backend
    assert old_place.parallel.compile is True


def _yaml(**blocks) -> str:
    return yaml.safe_dump(blocks)


FSDP = {"distributed_type": "FSDP"}
DS = {"distributed_type": "DEEPSPEED"}

# (case, file content, what the message must say: the key, the value, what fp8dist accepts / the way out)
REFUSED = [
    ("sagemaker", _yaml(compute_environment="AMAZON_SAGEMAKER"),
     ["compute_environment='AMAZON_SAGEMAKER'", "does not start SageMaker jobs", "Accepted here: 'LOCAL_MACHINE'"]),
    ("tpu", _yaml(distributed_type="XLA"), ["distributed_type='XLA'", "runs on CUDA GPUs and CPUs",
                                            "Accepted here: 'NO', 'MULTI_GPU', 'MULTI_CPU', 'FSDP', 'DEEPSPEED'"]),
    ("npu", _yaml(distributed_type="MULTI_NPU"), ["distributed_type='MULTI_NPU'", "Use MULTI_GPU, FSDP or DEEPSPEED"]),
    ("megatron", _yaml(distributed_type="MEGATRON_LM"), ["distributed_type='MEGATRON_LM'", "Use FSDP or DEEPSPEED"]),
    ("type typo", _yaml(distributed_type="FSPD"), ["distributed_type='FSPD' is not valid", "Did you mean 'FSDP'?"]),
    ("precision typo", _yaml(mixed_precision="fp4"),
     ["mixed_precision='fp4' is not valid; choose one of: 'no', 'fp16', 'bf16', 'fp8'"]),
    ("fp8 without backend", _yaml(mixed_precision="fp8"),
     ["mixed_precision: fp8 needs a backend: set fp8_config.backend to one of TE, AO, MSAMP"]),
    ("debug", _yaml(debug=True), ["debug=True", "TORCH_DISTRIBUTED_DEBUG=DETAIL", "Accepted here: False"]),
    ("cpu affinity", _yaml(enable_cpu_affinity=True), ["enable_cpu_affinity=True", "torchrun --numa-binding node"]),
    ("downcast", _yaml(downcast_bf16="yes"), ["downcast_bf16='yes'", "TPUs are not fp8dist's"]),
    ("tpu cluster", _yaml(tpu_use_cluster=True), ["tpu_use_cluster=True", "TPUs are not fp8dist's"]),
    ("tpu name", _yaml(tpu_name="pod"), ["tpu_name='pod'", "TPUs are not fp8dist's", "Remove the key"]),
    ("tensor parallel", _yaml(parallelism_config={"parallelism_config_tp_size": 2}),
     ["parallelism_config.parallelism_config_tp_size=2", "no tensor parallelism", "Accepted here: 1"]),
    ("dynamo backend", _yaml(dynamo_config={"dynamo_backend": "EAGER"}),
     ["dynamo_config.dynamo_backend='EAGER'", "default backend (inductor)", "Accepted here: 'NO', 'INDUCTOR'"]),
    ("dynamo mode", _yaml(dynamo_config={"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune"}),
     ["dynamo_config.dynamo_mode='max-autotune'", "torch.compile's defaults", "Accepted here: 'default'"]),
    ("dynamo fullgraph", _yaml(dynamo_config={"dynamo_backend": "INDUCTOR", "dynamo_use_fullgraph": True}),
     ["dynamo_config.dynamo_use_fullgraph=True", "each block on its own", "Accepted here: False"]),
    ("hybrid shard on one node", _yaml(**FSDP, num_machines=1, fsdp_config={"fsdp_version": 2,
                                                                          "fsdp_sharding_strategy": "HYBRID_SHARD"}),
     ["fsdp_config.fsdp_sharding_strategy='HYBRID_SHARD' replicates across nodes", "num_machines is 1",
      "parallelism_config_dp_replicate_size", "use FULL_SHARD"]),
    ("megatron block", _yaml(megatron_lm_config={"megatron_lm_tp_degree": 2}),
     ["megatron_lm_config.megatron_lm_tp_degree=2", "no Megatron-LM"]),
    ("fsdp offload", _yaml(**FSDP, fsdp_config={"fsdp_offload_params": True}),
     ["fsdp_config.fsdp_offload_params=True", "does not offload FSDP parameters",
      "distributed_type: DEEPSPEED with deepspeed_config.offload_param_device: cpu"]),
    ("fsdp version", _yaml(**FSDP, fsdp_config={"fsdp_version": 3}),
     ["fsdp_config.fsdp_version=3 is not valid; choose one of: 1, 2"]),
    ("no shard", _yaml(**FSDP, fsdp_config={"fsdp_reshard_after_forward": "NO_SHARD"}),
     ["fsdp_config.fsdp_reshard_after_forward='NO_SHARD'", "distributed_type: MULTI_GPU",
      "Accepted here: True, False, 'FULL_SHARD', 'SHARD_GRAD_OP'"]),
    ("size wrap", _yaml(**FSDP, fsdp_config={"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}),
     ["fsdp_auto_wrap_policy='SIZE_BASED_WRAP'", "shards block by block", "Use TRANSFORMER_BASED_WRAP"]),
    ("no wrap", _yaml(**FSDP, fsdp_config={"fsdp_auto_wrap_policy": "NO_WRAP"}),
     ["fsdp_auto_wrap_policy='NO_WRAP'", "Use TRANSFORMER_BASED_WRAP"]),
    ("min params", _yaml(**FSDP, fsdp_config={"fsdp_min_num_params": 100000000}),
     ["fsdp_config.fsdp_min_num_params=100000000", "SIZE_BASED_WRAP", "Remove it"]),
    ("backward prefetch", _yaml(**FSDP, fsdp_config={"fsdp_backward_prefetch": "BACKWARD_POST"}),
     ["fsdp_backward_prefetch='BACKWARD_POST'", "Accepted here: 'BACKWARD_PRE'"]),
    ("forward prefetch", _yaml(**FSDP, fsdp_config={"fsdp_forward_prefetch": True}),
     ["fsdp_forward_prefetch=True", "Accepted here: False"]),
    ("full state dict", _yaml(**FSDP, fsdp_config={"fsdp_state_dict_type": "FULL_STATE_DICT"}),
     ["fsdp_state_dict_type='FULL_STATE_DICT'", "sharded checkpoints", "dcp_to_torch_save",
      "Accepted here: 'SHARDED_STATE_DICT'"]),
    ("orig params off", _yaml(**FSDP, fsdp_config={"fsdp_use_orig_params": False}),
     ["fsdp_use_orig_params=False", "always uses use_orig_params=True", "Accepted here: True"]),
    ("fsdp block without FSDP", _yaml(distributed_type="MULTI_GPU", fsdp_config={"fsdp_version": 2}),
     ["fsdp_config is read only with distributed_type: FSDP (this file: MULTI_GPU)", "Set distributed_type: FSDP"]),
    ("fsdp key typo", _yaml(**FSDP, fsdp_config={"fsdp_offload_param": False}),
     ["key 'fsdp_offload_param' in fsdp_config is not one fp8dist reads", "Did you mean 'fsdp_offload_params'?"]),
    ("two reshard keys disagree", _yaml(**FSDP, fsdp_config={"fsdp_sharding_strategy": "FULL_SHARD",
                                                             "fsdp_reshard_after_forward": False}),
     ["fsdp_config.fsdp_sharding_strategy sets reshard_after_forward=True but "
      "fsdp_config.fsdp_reshard_after_forward says reshard_after_forward=False: keep one."]),
    ("version default disagrees", _yaml(**FSDP, strategy="fsdp"),
     ["distributed_type: FSDP without fsdp_config.fsdp_version (Accelerate's default is 1) sets strategy='fsdp1' "
      "but the file also says strategy='fsdp'"]),
    ("zero stage 0", _yaml(**DS, deepspeed_config={"zero_stage": 0}),
     ["deepspeed_config.zero_stage=0", "plain data parallelism", "Accepted here: 1, 2, 3"]),
    ("nvme optimizer", _yaml(**DS, deepspeed_config={"offload_optimizer_device": "nvme"}),
     ["offload_optimizer_device='nvme'", "offloads to the CPU only", "deepspeed_config_file",
      "Accepted here: 'none', 'cpu'"]),
    ("nvme params", _yaml(**DS, deepspeed_config={"zero_stage": 3, "offload_param_device": "nvme"}),
     ["offload_param_device='nvme'", "offloads to the CPU only"]),
    ("nvme path", _yaml(**DS, deepspeed_config={"offload_param_nvme_path": "/nvme"}),
     ["offload_param_nvme_path='/nvme'", "read only with NVMe offload"]),
    ("param offload below stage 3", _yaml(**DS, deepspeed_config={"zero_stage": 2, "offload_param_device": "cpu"}),
     ["offload_param_device='cpu' with zero_stage 2", "Use zero_stage: 3, or offload_param_device: none"]),
    ("16-bit save", _yaml(**DS, deepspeed_config={"zero3_save_16bit_model": True}),
     ["zero3_save_16bit_model=True", "stage3_gather_16bit_weights_on_model_save", "engine.save_16bit_model"]),
    ("moe", _yaml(**DS, deepspeed_config={"deepspeed_moe_layer_cls_names": "MixtralSparseMoeBlock"}),
     ["deepspeed_moe_layer_cls_names='MixtralSparseMoeBlock'", "deepspeed.utils.set_z3_leaf_modules"]),
    ("json beside ds keys", _yaml(**DS, deepspeed_config={"deepspeed_config_file": "ds.json", "zero_stage": 3}),
     ["deepspeed_config.zero_stage=3 beside deepspeed_config_file", "the DeepSpeed json decides it",
      "Set it in 'ds.json'"]),
    ("ds block without DEEPSPEED", _yaml(**FSDP, deepspeed_config={"zero_stage": 3}),
     ["deepspeed_config is read only with distributed_type: DEEPSPEED (this file: FSDP)"]),
    ("accumulation auto", _yaml(**DS, deepspeed_config={"gradient_accumulation_steps": "auto"}),
     ["deepspeed_config.gradient_accumulation_steps='auto' must be an integer"]),
    ("fp8 backend typo", _yaml(mixed_precision="fp8", fp8_config={"backend": "XE"}),
     ["fp8_config.backend='XE' is not valid; choose one of: 'TE', 'AO', 'MSAMP'"]),
    ("pad inner dim", _yaml(mixed_precision="fp8", fp8_config={"backend": "AO", "pad_inner_dim": True}),
     ["fp8_config.pad_inner_dim=True", "does not pad", "stays in the strategy's precision", "Accepted here: False"]),
    ("amax algorithm", _yaml(fp8_config={"backend": "TE", "amax_compute_algorithm": "mean"}),
     ["fp8_config.amax_compute_algorithm='mean' is not valid; choose one of: 'max', 'most_recent'"]),
    ("fp8 key typo", _yaml(fp8_config={"backend": "TE", "amax_history": 3}),
     ["key 'amax_history' in fp8_config is not one fp8dist reads", "Did you mean 'amax_history_len'?"]),
    ("precision and backend disagree", _yaml(mixed_precision="bf16", fp8_config={"backend": "TE"}),
     ["fp8_config.backend sets fp8='te' but mixed_precision says fp8=None: keep one."]),
    ("block key at the top", _yaml(fsdp_offload_params=False),
     ["'fsdp_offload_params' is a key of Accelerate's fsdp_config: put it under fsdp_config:."]),
    ("block name typo", _yaml(fsdp_confg={"fsdp_version": 2}),
     ["option 'fsdp_confg' is neither fp8dist's nor Accelerate's. Did you mean 'fsdp_config'?"]),
    ("block not a mapping", _yaml(**FSDP, fsdp_config="FULL_SHARD"),
     ["fsdp_config must be a mapping of keys to values, got 'FULL_SHARD'."]),
]


@pytest.mark.parametrize("case, text, expected", REFUSED, ids=[case for case, *_ in REFUSED])
def test_unsupported_accelerate_key_or_value_names_it_and_the_way_out(tmp_path, case, text, expected):
    path = _write(tmp_path, "accelerate.yaml", text)
    with pytest.raises(ValueError) as err:
        resolve_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    for part in expected:
        assert part in message
    assert "\n" not in message


def test_no_suggestion_points_at_a_key_of_another_meaning():
    """Before: fsdp_config got "did you mean 'ds_config'", fsdp_offload_params DeepSpeed's 'offload_param'."""
    messages = []
    for data in ({"fsdp_config": {"fsdp_version": 2}},  # read with distributed_type: FSDP only
                 {"distributed_type": "FSDP", "fsdp_config": {"fsdp_offload_params": True}},
                 {"fsdp_offload_params": True}):
        with pytest.raises(ValueError) as err:
            resolve_config(data)
        messages.append(str(err.value))
    assert all("ds_config" not in m and "'offload_param'" not in m and "Did you mean" not in m for m in messages)
    assert "Set distributed_type: FSDP" in messages[0]


def test_unquoted_no_read_by_yaml_as_false_is_the_word_the_file_had(tmp_path):
    """YAML 1.1 reads ``distributed_type: NO`` (unquoted, as people write it by hand) as False: it is 'NO'."""
    path = tmp_path / "default_config.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: NO\nmixed_precision: bf16\n")
    assert yaml.safe_load(path.read_text())["distributed_type"] is False  # what the reader meets
    by_word, _ = _resolve({"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "mixed_precision": "bf16"})
    from_file, _ = _resolve(str(path))
    assert from_file.to_dict() == by_word.to_dict()


@pytest.mark.parametrize("name, text, expected", [
    ("broken.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n bad: [1,\n",
     "broken.yaml' is not valid YAML: line 4, column 2: "),
    ("broken.yml", "fsdp_config: {fsdp_version: 2\n", "broken.yml' is not valid YAML: line 2, column 1: "),
    ("quote.yaml", 'mixed_precision: fp8\nfp8_config: {backend: "TE}\n',
     "quote.yaml' is not valid YAML: line 3, column 1: found unexpected end of stream (while scanning a quoted "
     "scalar at line 2, column 23)."),
    ("broken.json", '{\n  "distributed_type": "FSDP",\n}\n',
     "broken.json' is not valid JSON: line 3, column 1: Expecting property name enclosed in double quotes."),
    ("empty.yaml", "# nothing here yet\n", "empty.yaml' is empty: write at least one key"),
    ("empty.json", "  \n", "empty.json' is empty: write at least one key"),
    ("list.yaml", "- distributed_type: FSDP\n", "list.yaml' must hold a mapping of keys to values, got list."),
])
def test_unreadable_file_names_the_file_and_the_place(tmp_path, name, text, expected):
    path = _write(tmp_path, name, text)
    with pytest.raises(ValueError) as err:
        resolve_config(path)
    assert f"config file '{tmp_path}/{expected}" in str(err.value)
    assert "\n" not in str(err.value)


def test_plan_cli_with_a_broken_file_exits_2_with_one_line(tmp_path, capsys):
    path = _write(tmp_path, "broken.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n bad: [1,\n")
    assert main(["plan", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [captured.err.strip()]
    assert captured.err.startswith(f"fp8dist plan: error: config file '{path}' is not valid YAML: line 4, column 2: ")
    assert "Traceback" not in captured.err


# ---- files as Accelerate 1.15 writes them: its own ClusterConfig.to_yaml_file, with the wizard's answers -----------

def _written_by_accelerate(tmp_path: Path, name: str, **answers) -> Path:
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment

    path = tmp_path / name
    config = ClusterConfig(compute_environment=ComputeEnvironment.LOCAL_MACHINE, use_cpu=False, debug=False, **answers)
    config.to_yaml_file(path) if name.endswith(".yaml") else config.to_json_file(path)
    return path


# the wizard's FSDP answers, its defaults for the rest: cpu-RAM-efficient loading is the wizard's default answer,
# and with it sync_module_states is set for the user (accelerate/commands/config/cluster.py)
FSDP2_ANSWERS = {"fsdp_version": 2, "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
                 "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                 "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                 "fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True,
                 "fsdp_activation_checkpointing": True}


def test_accelerate_written_fsdp2_checkpointing_dynamo_hsdp_ao_loads_as_those_options(tmp_path):
    from accelerate.utils import DistributedType, DynamoBackend

    path = _written_by_accelerate(
        tmp_path, "fsdp2.yaml", distributed_type=DistributedType.FSDP, mixed_precision="fp8", num_processes=4,
        num_machines=2, fsdp_config=FSDP2_ANSWERS,
        parallelism_config={"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2,
                            "parallelism_config_tp_size": 1, "parallelism_config_cp_size": 1},
        dynamo_config={"dynamo_backend": DynamoBackend.INDUCTOR.value, "dynamo_mode": "default",
                       "dynamo_use_fullgraph": False, "dynamo_use_dynamic": False,
                       "dynamo_use_regional_compilation": True},
        fp8_config={"backend": "AO", "enable_fsdp_float8_all_gather": True, "pad_inner_dim": False})
    config, notes = _resolve(path)
    assert _changed(config) == {"strategy": "fsdp", "block_classes": ["LlamaDecoderLayer"],
                                "activation_checkpointing": "full", "compile": True, "replicate_degree": 2,
                                "fp8": "torchao", "fp8_all_gather": True}
    model_notice = [n for n in notes if "about how the model is built" in n]
    assert len(model_notice) == 1 and "build the model on the meta device" in model_notice[0]
    assert "check_ranks" in model_notice[0]  # sync_module_states: fp8dist checks instead of broadcasting


def test_accelerate_written_hybrid_shard_replicates_over_the_nodes(tmp_path):
    from accelerate.utils import DistributedType

    path = _written_by_accelerate(tmp_path, "hybrid.json", distributed_type=DistributedType.FSDP,
                                  mixed_precision="bf16", num_processes=16, num_machines=2,
                                  fsdp_config={**FSDP2_ANSWERS, "fsdp_reshard_after_forward": "HYBRID_SHARD_ZERO2",
                                               "fsdp_activation_checkpointing": False})
    config, _ = _resolve(path)
    assert (config.parallel.replicate_degree, config.parallel.reshard_after_forward) == (2, False)


def test_accelerate_written_zero3_init_is_honoured_by_building_on_meta(tmp_path):
    from accelerate.utils import DistributedType

    path = _written_by_accelerate(tmp_path, "zero3.yaml", distributed_type=DistributedType.DEEPSPEED,
                                  mixed_precision="bf16",
                                  deepspeed_config={"zero_stage": 3, "offload_optimizer_device": "none",
                                                    "offload_param_device": "none", "gradient_accumulation_steps": 1,
                                                    "zero3_save_16bit_model": False, "zero3_init_flag": True})
    config, notes = _resolve(path)
    assert (config.parallel.strategy, config.parallel.zero_stage) == ("deepspeed", 3)
    assert any("zero3_init_flag: build the model on the meta device" in n and "deepspeed.zero.Init" in n
               for n in notes)


# ---- the translator cannot drift from the schema --------------------------------------------------------------------

def test_every_target_is_an_option_and_every_option_is_mapped_or_listed_as_not_in_accelerate():
    """A new fp8dist option fails here until an Accelerate key maps to it or NO_ACCELERATE_KEY says why none does
    (the translator once refused dynamo_config, activation checkpointing and HSDP after fp8dist had all three)."""
    from fp8dist.config.accelerate import NO_ACCELERATE_KEY, targets

    options = set(Config().to_dict())
    assert targets() <= options
    assert targets() | set(NO_ACCELERATE_KEY) == options
    assert not targets() & set(NO_ACCELERATE_KEY)


def test_every_value_the_tables_set_is_valid_for_its_option():
    """Each value a table writes into an option is one the option's own type takes (its schema decides)."""
    import fp8dist.config.accelerate_keys as translator
    from fp8dist.config.accelerate import _normalized

    checked = 0
    for table in (translator._TOP, translator._FSDP, translator._DEEPSPEED, translator._FP8, translator._DYNAMO):
        for rule in table.values():
            for result in (rule.values or {}).values():
                if isinstance(result, (translator._Refuse, translator._Mark)):
                    continue
                items = result if len(rule.to) > 1 else (result,)
                for key, item in zip(rule.to, items):
                    if isinstance(item, (translator._Refuse, translator._Mark)):
                        continue
                    assert _normalized(key, item) == item or isinstance(item, bool)
                    checked += 1
    assert checked >= 20  # the tables write at least that many values (a blind loop would check none)
