"""DeepSpeed ZeRO 1-3 for real (CPU accelerator, gloo, 2 processes): configs built from the model, wrap_model
against raw deepspeed.initialize (+ raw torchao), and the real `deepspeed` launcher."""

from __future__ import annotations

import copy
import json

import pytest
from cli_helpers import ROOT, free_port
from dist_harness import run_ranks
from helpers import BATCH, engine_losses, first_last_filter

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'fp8dist[deepspeed]')")

from fp8dist import wrap_model  # noqa: E402
from fp8dist.train.models import build_llama  # noqa: E402
from fp8dist.strategies.deepspeed import (  # noqa: E402
    merge_user_config, torch_adam_on_cpu, validate_with_deepspeed, zero_config)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_config_is_complete_concrete_and_parsed_by_deepspeed(stage):
    config = zero_config(stage, model=build_llama("tiny"), micro_batch_size=2, grad_accum=3, world_size=2)
    zero = config["zero_optimization"]
    assert zero["stage"] == stage and zero["overlap_comm"] and zero["contiguous_gradients"]
    assert zero["reduce_bucket_size"] == 128 * 128, "h^2 for hidden size 128"
    if stage == 3:
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 128 * 128)
        assert zero["stage3_param_persistence_threshold"] == 10 * 128
    assert config["train_batch_size"] == 2 * 3 * 2
    assert config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    assert config["communication_data_type"] == "fp32" and config["gradient_clipping"] == 1.0
    assert "auto" not in json.dumps(config)
    validate_with_deepspeed(config, world_size=2)


def test_without_world_size_deepspeed_derives_the_global_batch():
    assert "train_batch_size" not in zero_config(2, hidden_size=64)


@pytest.mark.parametrize("call,message", [
    (lambda: zero_config(4), "stage=4 is not a ZeRO stage; choose one of 1, 2, 3"),
    (lambda: zero_config(2, micro_batch_size=0), "micro_batch_size=0 must be a positive integer"),
    (lambda: zero_config(2, offload_param=True), "offload_param=True needs stage 3"),
    (lambda: validate_with_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True},
                                      "train_micro_batch_size_per_gpu": 1}), "enables both fp16 and bf16"),
    (lambda: validate_with_deepspeed({"zero_optimization": {"stage": 5}, "train_micro_batch_size_per_gpu": 1}),
     r"zero_optimization.stage=5 does not exist"),
    (lambda: validate_with_deepspeed({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2,
                                      "gradient_accumulation_steps": 1}, world_size=2),
     r"train_batch_size=10 but train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=1 x world size 2 = 4"),
    (lambda: validate_with_deepspeed({"train_micro_batch_size_per_gpu": "auto"}), 'still holds an "auto"'),
    (lambda: validate_with_deepspeed({"train_micro_batch_size_per_gpu": 1,
                                      "zero_optimization": {"stage": 2, "reduce_bucket_size": "lots"}}),
     "DeepSpeed rejects the config"),
])
def test_bad_deepspeed_configs_are_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_user_json_wins_and_only_missing_keys_are_filled(tmp_path):
    user = tmp_path / "mine.json"
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3,
                                                                                          "overlap_comm": False}}))
    merged = merge_user_config(user, zero_config(2, hidden_size=64, world_size=2, micro_batch_size=1))
    assert merged["train_micro_batch_size_per_gpu"] == 4 and "train_batch_size" not in merged
    assert merged["zero_optimization"]["stage"] == 3 and merged["zero_optimization"]["overlap_comm"] is False
    assert merged["zero_optimization"]["reduce_bucket_size"] == 64 * 64 and merged["bf16"]["enabled"]


def test_on_a_cpu_adam_is_torch_unless_the_config_says_or_offloads():
    adamw = {"type": "AdamW", "params": {"lr": 1e-3}}
    assert torch_adam_on_cpu({"optimizer": adamw})["optimizer"]["params"] == {"torch_adam": True, "lr": 1e-3}
    assert adamw == {"type": "AdamW", "params": {"lr": 1e-3}}, "the caller's block is not changed"
    assert torch_adam_on_cpu({"optimizer": {"type": "adam"}})["optimizer"]["params"] == {"torch_adam": True}
    said = {"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}}
    assert torch_adam_on_cpu(said) == said
    lamb = {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    assert torch_adam_on_cpu(lamb) == lamb
    offloaded = {"optimizer": adamw, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert torch_adam_on_cpu(offloaded) == offloaded, "DeepSpeed refuses any optimizer but its CPU Adam there"
    assert torch_adam_on_cpu({"zero_optimization": {"stage": 1}}) == {"zero_optimization": {"stage": 1}}


def test_ds_config_cli_writes_the_committed_example_configs(tmp_path):
    """In-process (cli.main); its bad inputs are rows of tests/test_bad_inputs.py's CLI table."""
    from fp8dist.cli import main

    for stage in (1, 2, 3):
        out = tmp_path / f"ds_zero{stage}.json"
        assert main(["ds-config", "--stage", str(stage), "--model", "llama-tiny", "--micro-batch-size", "4",
                     "--optimizer", "AdamW", "--lr", "3e-3", "-o", str(out)]) == 0
        committed = ROOT / "examples" / "deepspeed" / f"ds_zero{stage}.json"
        assert json.loads(out.read_text()) == json.loads(committed.read_text()), f"{committed} is stale"
    assert main(["ds-config", "--stage", "2", "--offload-param", "-o", str(tmp_path / "bad.json")]) == 2
    assert not (tmp_path / "bad.json").exists() and list(tmp_path.glob(".bad.json*")) == [], "nothing half-written"


def _hand_config(stage: int, world: int) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
            "train_batch_size": BATCH, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "communication_data_type": "fp32", "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}  # as fp8dist on a CPU


def _zero_case(rank: int, world: int, stage: int, port: str) -> dict:
    import glob
    import os

    import deepspeed
    import torch
    from deepspeed.comm import comm as ds_comm
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # what the deepspeed launcher exports for ranks that all sit on this node: there DeepSpeed's shared-memory
    # all-reduce op would map one /dev/shm file per rank, named by user id, MASTER_ADDR, MASTER_PORT and rank (the
    # port only names them here: the harness's ranks have rendezvoused already)
    os.environ.update(LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    base = build_llama("tiny", seed=0)
    out = {}
    for fp8 in (None, "torchao"):
        engine, optimizer = wrap_model(copy.deepcopy(base), strategy="deepspeed", zero_stage=stage, fp8=fp8,
                                       micro_batch_size=BATCH // world, optimizer={"type": "AdamW", "lr": 1e-3})
        ref_model = copy.deepcopy(base)
        if fp8:
            convert_to_float8_training(ref_model, config=Float8LinearConfig(),
                                       module_filter_fn=first_last_filter(ref_model))
        ref, *_ = deepspeed.initialize(model=ref_model, model_parameters=list(ref_model.parameters()),
                                       config=_hand_config(stage, world))
        q = engine.module.model.layers[1].self_attn.q_proj
        out[fp8] = dict(ours=engine_losses(engine, rank, world), ref=engine_losses(ref, rank, world),
                        q_type=type(q).__name__, optimizer=type(optimizer).__name__,
                        inner=type(optimizer.optimizer).__module__ + "." + type(optimizer.optimizer).__name__,
                        partition=(q.weight.ds_tensor.numel(), q.weight.ds_numel) if stage == 3 else None)
    summed = torch.full((1024,), float(rank + 1))
    ds_comm.inference_all_reduce(summed)  # what the op would serve: torch's all-reduce serves it instead
    out["shm"] = dict(op=ds_comm.cdb.shm_comm_op is not None, summed=summed.unique().tolist(),
                      kernel=hasattr(torch.ops.deepspeed, "inference_all_reduce_"),
                      files=glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_raw_deepspeed_with_and_without_torchao(stage):
    for rank, r in enumerate(run_ranks(_zero_case, stage, str(free_port()), timeout=400)):
        for fp8 in (None, "torchao"):
            assert r[fp8]["ours"] == r[fp8]["ref"], f"rank {rank} fp8={fp8}"
            assert r[fp8]["optimizer"].startswith("DeepSpeedZeroOptimizer")
            assert r[fp8]["inner"] == "torch.optim.adamw.AdamW", "on a CPU: torch's AdamW, no FusedAdam build"
            if stage == 3:
                local, full = r[fp8]["partition"]
                assert local * 2 == full, "ZeRO-3 really partitions parameters"
        assert r[None]["q_type"] == "Linear" and r["torchao"]["q_type"] == "Float8Linear"
        assert r[None]["ours"] != r["torchao"]["ours"]
        # on a CPU DeepSpeed's comm starts without its shared-memory op (no C++ build, no 66 MB /dev/shm file per
        # rank left behind); its inference all-reduce still sums both ranks, through torch's process group
        assert r["shm"] == dict(op=False, summed=[3.0], kernel=False, files=[]), r["shm"]


# The real `deepspeed` launcher runs fp8dist train (ZeRO-2 + torchao) on two SLURM nodes through
# launch/slurm/deepspeed.sbatch and launch/deepspeed.sh (tests/test_launch.py); the example with its ZeRO-3 json in
# tests/test_examples.py
