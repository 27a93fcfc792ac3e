"""FP8 health under torchao's weight wrapper (``torchao_api="weight_wrapper"``): its Linears keep their class, so the
telemetry finds them by the Float8 weight wrapper on their weight and samples them under the casts the wrapper runs
(torchao's Float8LinearConfig of its recipe). Its records equal those of the module swap on the same model, batches
and recipe, number for number; ``fp8dist train --torchao-api weight_wrapper --lora-rank 4`` reports them."""

from __future__ import annotations

import re

import pytest
import torch

from fp8dist.cli import main

pytest.importorskip("torchao", reason="torchao is not installed")


def _records(api: str, tmp_path) -> tuple[list[dict], list[float]]:
    import fp8dist
    from fp8dist.plan.numerics import FP8Telemetry
    from fp8dist.train.data import Batches
    from fp8dist.train.models import build_llama

    model = fp8dist.wrap_model(build_llama("tiny", seed=0), strategy="none", fp8="torchao", torchao_api=api,
                               fp8_all_gather=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    telemetry = FP8Telemetry(model, every=1, optimizer=opt)
    batches, losses = Batches(batch_size=2, seq_len=32, rank=0, world_size=1, seed=0), []
    for step in range(3):
        loss = model(input_ids=batches[step], labels=batches[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return telemetry.records, losses


def test_weight_wrapped_layers_report_the_health_the_module_swap_reports(tmp_path):
    wrapped, wrapped_losses = _records("weight_wrapper", tmp_path)
    swapped, swapped_losses = _records("module_swap", tmp_path)
    assert wrapped_losses == swapped_losses, "the two APIs run the same FP8 GEMMs"
    assert len(wrapped) == 3 and len(wrapped[0]["layers"]) == 13  # the plan's 13 FP8 Linears, every step
    assert wrapped == swapped
    assert all(e["grad_output"]["amax"] and e["input"]["flushed_share"] is not None
               for record in wrapped for e in record["layers"].values())


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
