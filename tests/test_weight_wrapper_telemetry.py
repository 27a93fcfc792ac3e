"""FP8 health under torchao's weight wrapper (``torchao_api="weight_wrapper"``): its Linears keep their class, so the
telemetry finds them by the Float8 weight wrapper on their weight and samples them under the casts the wrapper runs
(torchao's Float8LinearConfig of its recipe). Its records equal those of the module swap on the same model, batches
and recipe, number for number (in one process and on 2 FSDP2 ranks); ``fp8dist train --torchao-api weight_wrapper
--lora-rank 4`` reports them."""

from __future__ import annotations

import re

import pytest
import torch
from dist_harness import run_ranks

from fp8dist.cli import main

pytest.importorskip("torchao", reason="torchao is not installed")


def _records(api: str, strategy: str = "none", rank: int = 0, world: int = 1) -> tuple[list[dict], list[float]]:
    import fp8dist
    from fp8dist.numerics import FP8Telemetry
    from fp8dist.train.data import Batches
    from fp8dist.train.models import build_llama

    model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8="torchao", torchao_api=api,
                               fp8_all_gather=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    telemetry = FP8Telemetry(model, every=1, optimizer=opt)
    batches, losses = Batches(batch_size=2 * world, seq_len=32, rank=rank, world_size=world, seed=0), []
    for step in range(3):
        loss = model(input_ids=batches[step], labels=batches[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return telemetry.records, losses


def test_weight_wrapped_layers_report_the_health_the_module_swap_reports():
    wrapped, wrapped_losses = _records("weight_wrapper")
    swapped, swapped_losses = _records("module_swap")
    assert wrapped_losses == swapped_losses, "the two APIs run the same FP8 GEMMs"
    assert len(wrapped) == 3 and len(wrapped[0]["layers"]) == 13  # the plan's 13 FP8 Linears, every step
    assert wrapped == swapped
    assert all(e["grad_output"]["amax"] and e["input"]["flushed_share"] is not None
               for record in wrapped for e in record["layers"].values())


def _fsdp_case(rank: int, world: int) -> dict:
    return {api: _records(api, "fsdp", rank, world) for api in ("weight_wrapper", "module_swap")}


def test_under_fsdp2_the_weight_wrappers_sharded_weights_are_read_as_the_module_swaps():
    """2 gloo ranks: each holds half of every wrapped weight (a DTensor over torchao's wrapper); the reduced records
    are the same on both ranks and equal the module swap's."""
    results = run_ranks(_fsdp_case)
    for out in results:
        assert out["weight_wrapper"] == out["module_swap"]
        assert out["weight_wrapper"][0] == results[0]["weight_wrapper"][0], "every rank reports the same records"
    assert all(e["weight"]["amax"] for e in results[0]["weight_wrapper"][0][0]["layers"].values())


def test_fp8_train_with_the_weight_wrapper_and_lora_prints_fp8_health(capsys, tmp_path):
    """The plan's 13 FP8 layers (the frozen base's Linears, LoRA's base_layer where an adapter sits) are sampled."""
    import json

    health = tmp_path / "health.jsonl"
    code = main(["train", "--nproc", "1", "--strategy", "fsdp", "--fp8", "torchao", "--torchao-api",
                 "weight_wrapper", "--lora-rank", "4", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                 "--fp8-health-every", "1", "--fp8-health-file", str(health)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "fp8 health: every 1 step, per FP8 layer the amax, scale and share flushed to zero" in out
    assert re.findall(r"^fp8 health, step (\d+): input flushed <= ", out, flags=re.M) == ["0", "1"], out
    records = [json.loads(line) for line in health.read_text().splitlines()]
    assert [len(r["layers"]) for r in records] == [13, 13]
    assert "base_model.model.model.layers.1.self_attn.v_proj.base_layer" in records[0]["layers"]
