"""HSDP (FSDP2 on a 2-D mesh: replicate x shard) and the units FSDP2 makes of what the blocks leave (the input
embedding alone, final norm + output layer together), against the hand-wired engine, on real gloo ranks."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fp8dist
from dist_harness import run_ranks
from fp8dist.accounting.estimate_activations import ROOT_WEIGHTS_ITEM
from fp8dist.train.models import build_llama
from fp8dist.strategies.fsdp import RootUnit, root_units
from helpers import first_last_filter, train_losses

REPLICAS, SHARDS = 2, 2


def _hand_wired_hsdp(model, fp8: str | None):
    """torchtitan's FSDP2 wiring by hand on a (replicate, shard) mesh: blocks, the input embedding, final norm +
    output layer (kept gathered for backward), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if fp8:
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                   module_filter_fn=first_last_filter(model))
    mesh = init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=policy)
    fully_shard([model.model.norm, model.lm_head], mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def _hsdp_case(rank: int, world: int) -> dict:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    base = build_llama("tiny", seed=0)
    out = {}
    for fp8 in (None, "torchao"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = fp8dist.wrap_model(copy.deepcopy(base), strategy="fsdp", fp8=fp8, replicate_degree=REPLICAS)
        weight = ours.model.layers[1].mlp.down_proj.weight
        summary = fp8dist.sharding_summary(ours)
        losses = train_losses(ours, rank, world)
        ref = _hand_wired_hsdp(copy.deepcopy(base), fp8)
        after = (lambda: precompute_float8_dynamic_scale_for_fsdp(ref)) if fp8 else None
        out[fp8] = dict(ours=losses, ref=train_losses(ref, rank, world, after_step=after),
                        placements=[repr(p) for p in weight.placements], mesh=tuple(weight.device_mesh.shape),
                        local=weight.to_local().detach().float().clone(), full_shape=tuple(weight.shape),
                        summary=(summary.local_numel, summary.total_numel, summary.replicas, str(summary)))
    return out


def test_hsdp_shards_within_a_group_replicates_across_and_matches_the_hand_wired_2d_mesh():
    results = run_ranks(_hsdp_case, world_size=REPLICAS * SHARDS)
    for fp8 in (None, "torchao"):
        for rank, r in enumerate(results):
            c = r[fp8]
            assert c["ours"] == c["ref"], f"rank {rank}, fp8={fp8}: fp8dist vs fully_shard on a 2-D mesh by hand"
            assert c["placements"] == ["Replicate()", "Shard(dim=0)"] and c["mesh"] == (REPLICAS, SHARDS)
            assert c["local"].shape[0] * SHARDS == c["full_shape"][0], "dim 0 split over the shard group"
            local, total, replicas, text = c["summary"]
            assert local * SHARDS == total and replicas == REPLICAS
            assert f"sharded over {SHARDS} ranks in each of {REPLICAS} replicas" in text
        # rank r = replica * SHARDS + shard: the same shard on both replicas, different shards within one
        for shard in range(SHARDS):
            same = [results[replica * SHARDS + shard][fp8]["local"] for replica in range(REPLICAS)]
            assert all(torch.equal(same[0], other) for other in same[1:]), f"fp8={fp8}: replicas diverged"
        assert not torch.equal(results[0][fp8]["local"], results[1][fp8]["local"])
        assert c["ours"][-1] < c["ours"][0]


def _kept_after_forward(model) -> int:
    """Elements of the FSDP2 units still gathered after forward (what backward will find unsharded)."""
    from torch.distributed.fsdp import FSDPModule

    groups = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                groups[id(group)] = group
    return sum(p._orig_size.numel() for g in groups.values() if g.is_unsharded for p in g.fsdp_params)


def _root_case(rank: int, world: int) -> dict:
    from fp8dist.train.data import Batches

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="fsdp")
    ids = Batches(batch_size=2, seq_len=32, rank=rank, world_size=world, seed=0)[0]
    loss = model(input_ids=ids, labels=ids).loss
    kept = _kept_after_forward(model)
    loss.backward()
    return dict(kept=kept)


def test_after_forward_only_the_final_norm_and_output_layer_stay_gathered_as_the_estimate_says():
    meta = build_llama("tiny", seed=0)
    blocks = ["model.layers.0", "model.layers.1"]
    assert root_units(meta, blocks) == (RootUnit(("model.embed_tokens",), True),
                                        RootUnit(("model.norm", "lm_head"), False))
    expected = meta.model.norm.weight.numel() + meta.lm_head.weight.numel()
    est = fp8dist.estimate_memory(meta, strategy="fsdp", world_size=2, micro_batch_size=2, seq_len=32)
    estimated = dict(est.activations)[ROOT_WEIGHTS_ITEM]
    assert estimated == expected * 2, "bf16 bytes of the final norm and output layer"
    for rank, r in enumerate(run_ranks(_root_case)):
        assert r["kept"] == expected, f"rank {rank}: gathered after forward (embedding freed, blocks resharded)"


def test_tied_embeddings_stay_one_unit():
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=4, tie_word_embeddings=True))
    assert root_units(tied, ["model.layers.0"]) == (RootUnit(("model.embed_tokens", "model.norm", "lm_head"),
                                                              False),)
    assert root_units(tied, []) == ()


@pytest.mark.parametrize("degree,world,message", [
    (3, 4, "replicate_degree=3 does not split world size 4 into equal shard groups: choose one of [1, 2, 4]"),
    (0, 4, "replicate_degree=0 must be at least 1"),
])
def test_a_replicate_degree_that_does_not_split_the_world_is_a_clear_error(degree, world, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        fp8dist.estimate_memory(build_llama("tiny"), strategy="fsdp", replicate_degree=degree, world_size=world)


def test_the_estimate_of_hsdp_is_fsdp_over_the_shard_group():
    model = build_llama("tiny")
    hsdp = fp8dist.estimate_memory(model, strategy="fsdp", replicate_degree=2, world_size=4)
    fsdp = fp8dist.estimate_memory(model, strategy="fsdp", world_size=2)
    assert hsdp.model_state_bytes == fsdp.model_state_bytes
    assert any("HSDP: 2 replicas, each sharded over 2 ranks" in note for note in hsdp.notes)
