"""The Hugging Face Trainer on models from ``fp8dist.wrap_model``, on 2 gloo ranks: Trainer (through Accelerate)
passes the model through as already distributed, the FP8 plan holds, and its losses == the same steps in
fp8dist's own loop."""

from __future__ import annotations

import copy

import pytest
from dist_harness import run_ranks
from helpers import BATCH
from integration_helpers import LR, ByteRows, accelerate_env, own_loop_losses

pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed")
pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")

STEPS = 3


def _trainer(model, out: str, steps: int, base: type | None = None, **args):
    """A Trainer (``base``, default transformers') on ``model`` recording each rank's per-step loss (what
    ``training_step`` returns), with a fixed AdamW and a constant learning rate; every other argument Trainer's
    default unless given."""
    import torch
    from transformers import Trainer, TrainingArguments

    class Recording(base or Trainer):
        losses: list[float] = []

        def training_step(self, *a, **k):
            loss = super().training_step(*a, **k)
            self.losses.append(loss.item())
            return loss

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    args = TrainingArguments(**{**dict(output_dir=out, max_steps=steps, per_device_train_batch_size=2, use_cpu=True,
                                       report_to="none", save_strategy="no", disable_tqdm=True,
                                       train_sampling_strategy="sequential"), **args})
    trainer = Recording(model=model, args=args, train_dataset=ByteRows(steps),
                        optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)))
    trainer.losses = []
    return trainer


def _trainer_case(rank: int, world: int, strategy: str, out: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from fp8dist import get_plan, unwrap_model, wrap_model
    from fp8dist.fp8.weight_wrapper import FP8Gemms
    from fp8dist.train.models import build_llama

    accelerate_env(rank, world)
    base = build_llama("tiny", seed=0)
    ours = wrap_model(copy.deepcopy(base), strategy=strategy, fp8="torchao")
    trainer = _trainer(ours, out, STEPS, per_device_train_batch_size=BATCH // world)
    with FP8Gemms() as gemms:
        trainer.train()
    ref = wrap_model(copy.deepcopy(base), strategy=strategy, fp8="torchao")
    with FP8Gemms() as ref_gemms:
        ref_losses = own_loop_losses(ref, rank, world, STEPS, tokens_over_ranks=True)
    ddp_layers = sum(isinstance(m, DistributedDataParallel) for m in trainer.model_wrapped.modules())
    return dict(losses=trainer.losses, ref=ref_losses, gemms=gemms.count, ref_gemms=ref_gemms.count,
                trained_ours=trainer.model_wrapped is ours and unwrap_model(trainer.model) is unwrap_model(ours),
                ddp_layers=ddp_layers, fp8_planned=len(get_plan(ours).fp8))


@pytest.mark.slow
@pytest.mark.parametrize("strategy,world", [("fsdp", 2), ("ddp", 2), ("none", 1)])
def test_trainer_trains_wrapped_model_equal_to_own_loop(strategy, world, tmp_path):
    """Trainer's default arguments (remove_unused_columns=True: the dataset's ``idx`` column is dropped by the
    signature of the model's own forward, not all columns by DDP's ``forward(*inputs, **kwargs)``)."""
    for rank, r in enumerate(run_ranks(_trainer_case, strategy, str(tmp_path), world_size=world)):
        assert r["trained_ours"], "Trainer trains the model wrap_model returned, not a new wrapper around it"
        assert r["ddp_layers"] == (1 if strategy == "ddp" else 0), "no second DDP around the model"
        assert r["losses"] == r["ref"], f"rank {rank}"
        assert len(r["losses"]) == STEPS
        # the plan holds: each planned FP8 Linear ran its 3 GEMMs (forward, 2 backward) in FP8 at every step
        assert r["gemms"] == r["ref_gemms"] == 3 * r["fp8_planned"] * STEPS and r["fp8_planned"] == 13


def _example_case(rank: int, world: int, script: str, out: str) -> str:
    """The example as torchrun would run it, in a rank of the harness: its printed lines."""
    import contextlib
    import io
    import runpy
    import sys

    accelerate_env(rank, world)
    sys.argv = [script, "--steps", "4", "--output-dir", out]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(script, run_name="__main__")
    return printed.getvalue()


@pytest.mark.slow
def test_example_and_readme_script_train_with_trainer(tmp_path):
    from cli_helpers import ROOT

    script = ROOT / "examples" / "hf_trainer.py"
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Hugging Face Trainer and Accelerate"):]
    assert f"```python\n{script.read_text()}```" in section, "the README shows examples/hf_trainer.py as it is"
    out = run_ranks(_example_case, str(script), str(tmp_path))[0]
    assert "Trainer trained the model wrap_model returned: True; 13 Linear layers in FP8" in out


def _save_resume_case(rank: int, world: int, strategy: str, out: str) -> dict:
    from pathlib import Path

    from safetensors.torch import load_file

    import fp8dist
    from fp8dist import wrap_model
    from fp8dist.integrations.transformers import FP8DistTrainer
    from fp8dist.train.models import build_llama

    accelerate_env(rank, world)
    run = dict(base=FP8DistTrainer, save_strategy="steps", save_steps=2)
    whole = _trainer(wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8="torchao"), out, 4, **run)
    whole.train()
    final = Path(out) / "final"
    whole.save_model(str(final))
    # other weights, then the checkpoint of step 2: the model and optimizer come from the checkpoint
    resumed = _trainer(wrap_model(build_llama("tiny", seed=1), strategy=strategy, fp8="torchao"), out, 4, **run)
    resumed.train(resume_from_checkpoint=str(Path(out) / "checkpoint-2"))
    # fp8dist's Hugging Face loading reads the export back, and writes the same tensors again
    again = wrap_model(build_llama("tiny", seed=2), strategy=strategy, fp8="torchao", pretrained=str(final))
    fp8dist.save_pretrained(again, Path(out) / "again")
    result = dict(whole=whole.losses, resumed=resumed.losses)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        hf, info = AutoModelForCausalLM.from_pretrained(str(final), output_loading_info=True)
        saved, rewritten = load_file(final / "model.safetensors"), load_file(Path(out) / "again" / "model.safetensors")
        result.update(missing=info["missing_keys"], unexpected=info["unexpected_keys"],
                      hf_equal=all(hf.state_dict()[k].to(v.dtype).equal(v) for k, v in saved.items()),
                      rewritten_equal=saved.keys() == rewritten.keys() and all(
                          saved[k].equal(rewritten[k]) for k in saved), tensors=len(saved))
    return result


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_fp8dist_trainer_saves_for_from_pretrained_and_resumes_exactly(strategy, tmp_path):
    for rank, r in enumerate(run_ranks(_save_resume_case, strategy, str(tmp_path))):
        assert r["resumed"] == r["whole"][2:], f"rank {rank}: steps 3-4 after resuming at step 2 == uninterrupted"
        if rank == 0:
            assert not r["missing"] and not r["unexpected"], "from_pretrained finds every weight by its name"
            assert r["hf_equal"] and r["rewritten_equal"] and r["tensors"] > 0


def _trainer_refusal_case(rank: int, world: int, out: str) -> dict:
    from accelerate.state import AcceleratorState

    from fp8dist import wrap_model
    from fp8dist.pipeline.handover import HandOverError
    from fp8dist.train.models import build_llama

    accelerate_env(rank, world)
    refused = {}
    cases = (("fsdp1", "fsdp1", {}, "train"), ("bf16", "fsdp", {"bf16": True}, "train"),
             ("save fsdp", "fsdp", {}, "save"), ("save ddp", "ddp", {}, "save"))
    for name, strategy, args, what in cases:
        AcceleratorState._reset_state(True)  # each Trainer its own Accelerate run (its state is process-wide)
        trainer = _trainer(wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8="torchao"), out, 1, **args)
        try:
            trainer.train()
            if what == "save":
                trainer.save_model(f"{out}/{name}")  # Trainer's own: rank 0 alone calls save_pretrained
            refused[name] = "not refused"
        except HandOverError as e:
            refused[name] = str(e)
    return refused


@pytest.mark.slow
def test_trainer_refuses_what_it_cannot_train_in_fp8dist_words(tmp_path):
    r = run_ranks(_trainer_refusal_case, str(tmp_path))[0]
    assert "(strategy='fsdp1') cannot be handed to Accelerate or the Hugging Face Trainer" in r["fsdp1"]
    assert "use strategy='fsdp' (FSDP2)" in r["fsdp1"]
    assert "mixed_precision='bf16'" in r["bf16"] and "drop bf16=/fp16= from TrainingArguments" in r["bf16"]
    assert "save_pretrained cannot write a model wrapped by fp8dist.wrap_model (strategy='fsdp')" in r["save fsdp"]
    assert "given the state dict of the wrapper" in r["save ddp"]
    assert all("fp8dist.integrations.transformers.FP8DistTrainer" in r[k] for k in ("save fsdp", "save ddp"))


def _deepspeed_refusal_case(rank: int, world: int, out: str) -> dict:
    from pathlib import Path

    import torch
    from transformers import Trainer, TrainingArguments

    from fp8dist import wrap_model
    from fp8dist.pipeline.handover import HandOverError
    from fp8dist.train.models import build_llama

    accelerate_env(rank, world)
    engine, _ = wrap_model(build_llama("tiny", seed=0), strategy="deepspeed", zero_stage=2, fp8="torchao",
                           micro_batch_size=2, optimizer={"type": "AdamW", "lr": LR})
    config = dict(engine.config)
    args = TrainingArguments(output_dir=out, max_steps=1, use_cpu=True, report_to="none")
    try:  # the natural code; anything but fp8dist's refusal (transformers' AttributeError before) fails the test
        Trainer(model=engine, args=args, train_dataset=ByteRows(1))
        said, chained = "not refused", None
    except HandOverError as e:
        said, chained = str(e), e.__context__
    # DeepSpeed's own use of its config is untouched: a step, and a checkpoint holding the config as it was
    ids = ByteRows(1)[0]["input_ids"][None]
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(f"{out}/ds", tag="one")
    saved = torch.load(Path(out) / "ds" / "one" / "mp_rank_00_model_states.pt", weights_only=True)["ds_config"]
    return dict(said=said, chained=repr(chained), config_kept=saved == config and engine.config == config,
                steps=engine.global_steps)


@pytest.mark.slow
def test_trainer_refuses_a_deepspeed_engine_in_its_constructor_in_fp8dist_words(tmp_path):
    r = run_ranks(_deepspeed_refusal_case, str(tmp_path), world_size=1)[0]
    assert r["said"].startswith("a model wrapped by fp8dist.wrap_model (strategy='deepspeed') cannot be handed to "
                                "Accelerate or the Hugging Face Trainer: its engine steps"), r["said"]
    assert "use strategy='fsdp' or 'ddp', or train it in your own loop" in r["said"]
    assert "config.use_cache was set on it as on a model's config" in r["said"]
    assert r["chained"] == "None", "raised by fp8dist itself, not over an error of transformers"
    assert r["config_kept"] and r["steps"] == 1


BAD = 2  # the step whose forward makes an inf, on rank 0 only


def _poison_at(model, rank: int, step: int):
    """A forward hook on one Linear turning its output to inf at forward number ``step`` (from 0), on rank 0."""
    from fp8dist import unwrap_model

    seen = [0]

    def hook(module, args, out):
        seen[0] += 1
        return out * float("inf") if seen[0] == step + 1 and rank == 0 else out

    return unwrap_model(model).model.layers[1].mlp.down_proj.register_forward_hook(hook)


def _own_accumulating_losses(model, rows, rank: int, world: int, steps: int, accum: int) -> list[float]:
    """fp8dist's loop on the rows Trainer gives rank ``rank`` with ``accum`` micro-batches of one row per step,
    its loss arithmetic (label tokens of every micro-batch on every rank as the divisor, times the world size)."""
    import torch
    import torch.distributed as dist

    import fp8dist
    from integration_helpers import MAX_NORM

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        micro = [rows[((step * accum + j) * world + rank)]["input_ids"][None] for j in range(accum)]
        tokens = sum((ids[:, 1:] != -100).sum() for ids in micro)
        dist.all_reduce(tokens)
        for ids in micro:
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=tokens / 1).loss * world
            loss.backward()
            losses.append(loss.item())
        fp8dist.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _meaning_case(rank: int, world: int, out: str) -> dict:
    import warnings

    from fp8dist import get_wrap_info, wrap_model
    from fp8dist.train.models import build_llama

    accelerate_env(rank, world)
    result = {}
    # the non-finite guard: the poisoned step is skipped inside Trainer as in fp8dist's loop, said and counted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="torchao")
        hook = _poison_at(ours, rank, BAD)
        trainer = _trainer(ours, out, 4)
        trainer.train()
        hook.remove()
        ref = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="torchao")
        hook = _poison_at(ref, rank, BAD)
        ref_losses = own_loop_losses(ref, rank, world, 4, tokens_over_ranks=True)
        hook.remove()
    result["guard"] = dict(losses=trainer.losses, ref=ref_losses, skipped=get_wrap_info(ours).skipped_steps,
                           ref_skipped=get_wrap_info(ref).skipped_steps,
                           said=sum("skipped: non-finite gradients" in str(w.message) for w in caught))
    # gradient accumulation: 2 micro-batches of one row per step, Trainer's == fp8dist's loop doing the same
    ours = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="torchao")
    trainer = _trainer(ours, out, 2, per_device_train_batch_size=1, gradient_accumulation_steps=2)
    trainer.train()
    ref = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8="torchao")
    result["accumulation"] = dict(losses=trainer.losses,
                                  ref=_own_accumulating_losses(ref, trainer.train_dataset, rank, world, 2, 2))
    return result


@pytest.mark.slow
def test_guard_and_gradient_accumulation_keep_their_meaning_inside_trainer(tmp_path):
    import math

    for rank, r in enumerate(run_ranks(_meaning_case, str(tmp_path))):
        guard = r["guard"]
        assert guard["skipped"] == guard["ref_skipped"] == 1, "the poisoned step skipped on every rank alike, counted"
        assert guard["said"] == 2, "said once by Trainer's run and once by fp8dist's loop"
        if rank == 0:
            assert not math.isfinite(guard["losses"][BAD]), "the planted step really was non-finite (rank 0)"
        finite = [i for i in range(4) if i != BAD or rank == 1]
        assert [guard["losses"][i] for i in finite] == [guard["ref"][i] for i in finite], f"rank {rank}"
        assert r["accumulation"]["losses"] == r["accumulation"]["ref"] and len(r["accumulation"]["losses"]) == 4
