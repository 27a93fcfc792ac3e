"""``wrap_model(mesh=...)``: a DeviceMesh (or process group) the user built shards the model instead of fp8dist's
own, with the same losses, on 2 real gloo ranks; a mesh fp8dist cannot use is refused before anything changes."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from helpers import train_losses
from torch.distributed.device_mesh import init_device_mesh

from fp8dist import wrap_model
from fp8dist.train.models import build_llama


def _wrapped_losses(base, mesh=None, **options) -> tuple[list[float], torch.nn.Module]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny model's FP8 coverage note
        model = wrap_model(copy.deepcopy(base), fp8="torchao", **({"mesh": mesh} if mesh is not None else {}),
                           **options)
    return train_losses(model, dist.get_rank(), dist.get_world_size(), steps=2), model


def _same_losses_case(rank: int, world: int) -> dict:
    base = build_llama("tiny", seed=0)
    out = {}
    for strategy in ("fsdp", "ddp", "fsdp1"):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        ours, model = _wrapped_losses(base, mesh, strategy=strategy)
        out[strategy] = dict(ours=ours, own=_wrapped_losses(base, strategy=strategy)[0])
        if strategy == "fsdp":
            weight = model.model.layers[0].mlp.up_proj.weight
            out["fsdp_mesh"] = (weight.device_mesh.mesh_dim_names, weight.device_mesh == mesh)
    out["group"] = dict(ours=_wrapped_losses(base, dist.group.WORLD, strategy="ddp")[0], own=out["ddp"]["own"])
    hsdp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = dict(ours=_wrapped_losses(base, hsdp, strategy="fsdp", replicate_degree=world)[0],
                       own=_wrapped_losses(base, strategy="fsdp", replicate_degree=world)[0])
    errors = {}
    cases = {"part": (hsdp["shard"], {"strategy": "fsdp"}),
             "hsdp_degree": (hsdp, {"strategy": "fsdp"}), "ddp_2d": (hsdp, {"strategy": "ddp"}),
             "not_a_mesh": ("dp", {"strategy": "fsdp"})}
    for name, (mesh, options) in cases.items():
        try:
            wrap_model(copy.deepcopy(base), mesh=mesh, **options)
        except (ValueError, TypeError) as err:
            errors[name] = f"{type(err).__name__}: {err}"
    out["errors"] = errors
    return out


@pytest.mark.slow
def test_a_users_mesh_shards_with_the_same_losses_and_a_wrong_one_is_refused():
    for rank, r in enumerate(run_ranks(_same_losses_case)):
        for case in ("fsdp", "ddp", "fsdp1", "group", "hsdp"):
            assert r[case]["ours"] == r[case]["own"], f"rank {rank} {case}"
        assert r["fsdp_mesh"] == (("dp",), True), "FSDP2 shards over the user's mesh itself"
        errors = r["errors"]
        assert "mesh (1,) covers 1 rank but the job has 2" in errors["part"]
        assert "Pass a mesh over all 2 ranks" in errors["part"]
        assert "mesh is a 2-D mesh (2, 1): 2 replicas, but replicate_degree=1" in errors["hsdp_degree"]
        assert "pass replicate_degree=2 with this mesh" in errors["hsdp_degree"]
        assert "strategy='ddp' replicates or shards over one group, and mesh (2, 1) has 2 dimensions" in (
            errors["ddp_2d"])
        assert errors["not_a_mesh"].startswith("TypeError: wrap_model: mesh=str must be a torch.distributed "
                                               "DeviceMesh")


@pytest.mark.parametrize("strategy", ["none", "deepspeed"])
def test_a_strategy_that_takes_no_mesh_refuses_one(strategy, one_rank_group):
    mesh = init_device_mesh("cpu", (1,))
    with pytest.raises(ValueError, match=rf"mesh= with strategy='{strategy}', which shards over no DeviceMesh of "
                                         r"yours .* Leave mesh out, or use a strategy that takes one: 'fsdp' "):
        wrap_model(build_llama("tiny", seed=0), strategy=strategy, mesh=mesh,
                   **({"optimizer": {"type": "AdamW", "lr": 1e-3}} if strategy == "deepspeed" else {}))
