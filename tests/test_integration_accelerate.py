"""Accelerate on models from ``fp8dist.wrap_model``, on 2 gloo ranks: ``Accelerator().prepare(model, optimizer)``
passes the model through as already distributed, ``accelerator.backward`` and ``clip_grad_norm_`` train it ==
fp8dist's own loop; a model or an Accelerate run that cannot go together is refused in fp8dist's words."""

from __future__ import annotations

import copy

import pytest
from dist_harness import run_ranks
from helpers import BATCH, SEQ
from integration_helpers import LR, MAX_NORM, accelerate_env, own_loop_losses

pytest.importorskip("accelerate", reason="accelerate is not installed")
pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")

STEPS = 3


def _accelerate_losses(accelerator, model, rank: int, world: int) -> tuple[list[float], bool]:
    """3 steps of the loop Accelerate's README shows; whether ``prepare`` returned the model itself."""
    import torch

    from fp8dist.train.data import Batches

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    prepared, opt = accelerator.prepare(model, opt)
    batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)
    losses = []
    for step in range(STEPS):
        ids = batches[step]
        loss = prepared(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(prepared.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, prepared is model


def _prepare_case(rank: int, world: int) -> dict:
    from accelerate import Accelerator

    from fp8dist import wrap_model
    from fp8dist.train.models import build_llama

    accelerate_env(rank, world)
    accelerator = Accelerator(cpu=True)  # 2 CPU processes: Accelerate's MULTI_CPU, where it wraps in DDP
    base = build_llama("tiny", seed=0)
    out = {}
    for strategy in ("fsdp", "ddp"):
        ours = wrap_model(copy.deepcopy(base), strategy=strategy, fp8="torchao")
        losses, same = _accelerate_losses(accelerator, ours, rank, world)
        ref = own_loop_losses(wrap_model(copy.deepcopy(base), strategy=strategy, fp8="torchao"), rank, world, STEPS,
                              tokens_over_ranks=False)
        out[strategy] = dict(losses=losses, ref=ref, same=same)
    return out


@pytest.mark.slow
def test_accelerator_prepare_passes_wrapped_model_through_equal_to_own_loop():
    for rank, r in enumerate(run_ranks(_prepare_case)):
        for strategy, got in r.items():
            assert got["same"], f"{strategy}: prepare returned the model wrap_model returned, not a wrapper"
            assert got["losses"] == got["ref"], f"{strategy}, rank {rank}"


def _refused(fn) -> str:
    from fp8dist.pipeline.handover import HandOverError

    try:
        fn()
    except HandOverError as e:
        return str(e)
    return "not refused"


def _refusal_case(rank: int, world: int) -> dict:
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from fp8dist import wrap_model
    from fp8dist.train.models import build_llama

    accelerate_env(rank, world)
    base = build_llama("tiny", seed=0)
    fsdp1 = wrap_model(copy.deepcopy(base), strategy="fsdp1", fp8="torchao")
    engine, _ = wrap_model(copy.deepcopy(base), strategy="deepspeed", micro_batch_size=2, optimizer={"type": "AdamW"})
    out = {name: _refused(lambda m=model: Accelerator(cpu=True).prepare(m, torch.optim.AdamW(m.parameters())))
           for name, model in (("fsdp1", fsdp1), ("deepspeed", engine))}
    AcceleratorState._reset_state(True)  # a fresh Accelerate run in this process (its state is process-wide)
    fsdp = wrap_model(copy.deepcopy(base), strategy="fsdp", fp8="torchao")
    bf16 = Accelerator(cpu=True, mixed_precision="bf16")
    out["bf16"] = _refused(lambda: bf16.prepare(fsdp, torch.optim.AdamW(fsdp.parameters())))
    return out


def test_models_and_runs_accelerate_cannot_take_are_refused_in_fp8dist_words():
    r = run_ranks(_refusal_case)[0]
    assert "strategy='fsdp1') cannot be handed to Accelerate or the Hugging Face Trainer" in r["fsdp1"]
    assert "use strategy='fsdp' (FSDP2)" in r["fsdp1"]
    assert "strategy='deepspeed') cannot be handed" in r["deepspeed"] and "steps, scales and clips" in r["deepspeed"]
    assert "use strategy='fsdp' or 'ddp'" in r["deepspeed"]
    assert "mixed_precision='bf16'" in r["bf16"] and "drop bf16=/fp16= from TrainingArguments" in r["bf16"]


def _readme_case(rank: int, world: int, block: str) -> str:
    import contextlib
    import io

    accelerate_env(rank, world)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "README.md", "exec"), {"__name__": "__main__"})
    return printed.getvalue()


def test_readme_accelerate_script_trains():
    import re

    from cli_helpers import ROOT

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Hugging Face Trainer and Accelerate"):]
    block = next(b for b in re.findall(r"```python\n(.*?)```", section, flags=re.S) if "Accelerator(" in b)
    out = run_ranks(_readme_case, block)[0]
    losses = [float(x) for x in re.findall(r"^step \d loss (\d+\.\d+)$", out, flags=re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "prepare returned the model itself: True" in out
