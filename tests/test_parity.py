"""wrap_model against the same model hand-wired with the raw engine, on 2 real gloo ranks.

Losses must be *exactly* equal step by step: fp8dist adds no numerics of its own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import run_ranks
from helpers import BATCH, SEQ, hand_wired_fsdp2, linear_dtypes, train_losses

from fp8dist import sharding_summary, wrap_model
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama


def _fsdp_case(rank: int, world: int) -> dict:
    base = build_llama("tiny", seed=0)
    out: dict = {}
    for reduce, reduce_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ours = wrap_model(copy.deepcopy(base), strategy="fsdp", reduce_dtype=reduce)
        ref = hand_wired_fsdp2(copy.deepcopy(base), world, reduce_dtype)
        # one backward on the same batch: the gradients the two reduce dtypes produce
        ids = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world)[0]
        ours(input_ids=ids, labels=ids).loss.backward()
        grad = ours.model.layers[0].mlp.down_proj.weight.grad.full_tensor().clone()
        ours.zero_grad(set_to_none=True)
        out[reduce] = dict(ours=train_losses(ours, rank, world), ref=train_losses(ref, rank, world), grad=grad)
        if reduce == "fp32":
            w = ours.model.layers[0].self_attn.q_proj.weight
            out["weight"] = dict(type=type(w).__name__, placements=[repr(p) for p in w.placements],
                                 local_rows=w.to_local().shape[0], rows=w.shape[0], dtype=str(w.dtype),
                                 lm_head_type=type(ours.lm_head.weight).__name__)
            summary = sharding_summary(ours)  # before the eval forward below: the root stays gathered after it
            out["compute"] = linear_dtypes(ours, ours.model.layers[0].mlp.up_proj, rank, world)
            out["summary"] = dict(compute=summary.compute_dtype, reduce=summary.reduce_dtype,
                                  local=summary.local_numel, total=summary.total_numel)
            out["buffer"] = str(ours.model.rotary_emb.inv_freq.dtype)
    return out


def test_fsdp2_matches_hand_wired_fully_shard():
    results = run_ranks(_fsdp_case)
    for rank, r in enumerate(results):
        for reduce in ("fp32", "bf16"):
            assert r[reduce]["ours"] == r[reduce]["ref"], f"rank {rank} reduce={reduce}"
        w = r["weight"]
        assert w["type"] == "DTensor" and w["lm_head_type"] == "DTensor"
        assert w["placements"] == ["Shard(dim=0)"]
        assert w["local_rows"] * 2 == w["rows"], "each of 2 ranks holds half the rows"
        assert w["dtype"] == "torch.float32", "sharded parameters are stored in fp32"
        assert r["compute"] == dict(input="torch.bfloat16", weight="torch.bfloat16", output="torch.bfloat16")
        assert r["summary"]["compute"] == "bf16" and r["summary"]["reduce"] == "fp32"
        assert abs(r["summary"]["local"] / r["summary"]["total"] - 0.5) < 0.01
        assert r["buffer"] == "torch.float32", "rotary buffers stay fp32"
        # a bf16 reduction really changes the reduced gradients (and the training run)
        assert not torch.equal(r["fp32"]["grad"], r["bf16"]["grad"])
        assert r["fp32"]["grad"].dtype == torch.float32
    assert results[0]["fp32"]["ours"] != results[1]["fp32"]["ours"], "ranks saw different data"


def _fsdp1_case(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    base = build_llama("tiny", seed=0)
    ours = wrap_model(copy.deepcopy(base), strategy="fsdp1")
    ref = FSDP(copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
               mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                              buffer_dtype=torch.float32),
               device_id=torch.device("cpu"), use_orig_params=True)
    flats = [m._flat_param for m in FSDP.fsdp_modules(ours) if m._flat_param is not None]
    out = dict(
        ours=train_losses(ours, rank, world), ref=train_losses(ref, rank, world),
        wrapped_blocks=sum(isinstance(m, FSDP) for m in ours.modules()) - 1,
        flat=[(f.numel(), f._unpadded_unsharded_size.numel(), str(f.dtype)) for f in flats],
        policy=(str(ours.mixed_precision.param_dtype), str(ours.mixed_precision.reduce_dtype),
                str(ours.mixed_precision.buffer_dtype)),
        compute=linear_dtypes(ours, ours.module.model.layers[0].mlp.up_proj, rank, world),
    )
    return out


def test_fsdp1_matches_hand_wired_fsdp1():
    for rank, r in enumerate(run_ranks(_fsdp1_case)):
        assert r["ours"] == r["ref"], f"rank {rank}"
        assert r["wrapped_blocks"] == 2, "each LlamaDecoderLayer is its own FSDP unit"
        for local, full, dtype in r["flat"]:
            assert local == -(-full // 2), "flat parameters are split in two (padded) shards"
            assert dtype == "torch.float32"
        assert r["policy"] == ("torch.bfloat16", "torch.float32", "torch.float32")
        assert r["compute"]["weight"] == "torch.bfloat16" and r["compute"]["output"] == "torch.bfloat16"


def _ddp_case(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    base = build_llama("tiny", seed=0)
    ours = wrap_model(copy.deepcopy(base), strategy="ddp")
    ref = DDP(copy.deepcopy(base))
    ours_losses = train_losses(ours, rank, world)
    ref_losses = train_losses(ref, rank, world, autocast_dtype=torch.bfloat16)
    return dict(ours=ours_losses, ref=ref_losses, fp32_ref=train_losses(DDP(copy.deepcopy(base)), rank, world),
                param_dtypes=sorted({str(p.dtype) for p in ours.parameters()}),
                compute=linear_dtypes(ours, ours.module.model.layers[0].mlp.up_proj, rank, world),
                summary=str(sharding_summary(ours)))


def test_ddp_matches_hand_wired_ddp_with_autocast():
    for rank, r in enumerate(run_ranks(_ddp_case)):
        assert r["ours"] == r["ref"], f"rank {rank}"
        assert r["ours"] != r["fp32_ref"], "bf16 autocast really changes the numerics"
        assert r["param_dtypes"] == ["torch.float32"], "DDP keeps fp32 parameters"
        assert r["compute"] == dict(input="torch.float32", weight="torch.float32", output="torch.bfloat16")
        assert "replicated" in r["summary"] and "compute in bf16" in r["summary"]


def test_none_matches_plain_autocast():
    base = build_llama("tiny", seed=0)
    torch.set_num_threads(1)
    ours = wrap_model(copy.deepcopy(base), strategy="none")
    assert train_losses(ours, 0, 1) == train_losses(copy.deepcopy(base), 0, 1, autocast_dtype=torch.bfloat16)
    assert not torch.distributed.is_initialized(), "strategy='none' needs no process group"


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1", "ddp"])
def test_world_size_one_needs_no_launcher(strategy, monkeypatch):
    """Outside any launcher, DDP/FSDP run as a 1-process job in a group wrap_model creates."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    results = run_ranks(_single_rank_case, strategy, world_size=1)
    assert results[0]["world"] == 1 and results[0]["losses"][-1] < results[0]["losses"][0]


def _single_rank_case(rank: int, world: int, strategy: str) -> dict:
    import torch.distributed as dist

    dist.destroy_process_group()  # start like a plain `python train.py`: no group yet
    model = wrap_model(build_llama("tiny", seed=0), strategy=strategy)
    return dict(world=dist.get_world_size(), losses=train_losses(model, 0, 1, steps=6, lr=3e-3))
