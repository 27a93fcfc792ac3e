"""`fp8dist train --lora-rank`: LoRA fine-tuning through PEFT on an FP8 base, as a user runs it on 2 real gloo ranks
(FSDP2 + torchao). The checkpoints hold only the adapters and their optimizer state and resume exactly; the exported
adapters are the trained ones, bit for bit, and load with PeftModel.from_pretrained; --merge-lora writes a model
AutoModelForCausalLM.from_pretrained loads, with the PEFT model's logits; every bad LoRA option is refused with the
value, the choices and the way out."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_helpers import run, train_losses_printed, train_on_gloo_ranks
from dist_harness import run_ranks
from text_corpus import write_text_corpus

from fp8dist.cli import main
from fp8dist.train.config import TrainConfig

pytest.importorskip("peft", reason="LoRA jobs need peft (pip install peft)")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return write_text_corpus(tmp_path_factory.mktemp("text"))


def _base_dir(made, directory: Path) -> Path:
    """A tiny Llama over the corpus's 320-id vocabulary saved with its tokenizer (fp32), the base to fine-tune."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(made.tokenizer)).save_pretrained(directory)
    return directory


def _checkpoint_tensors(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint, read with torch's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step_dir), str(tmp / "ckpt.pt"))
    return torch.load(tmp / "ckpt.pt", weights_only=True)["model"]


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's own call
def test_lora_fine_tune_of_a_pretrained_model_exports_its_adapters_and_the_merged_model(made, tmp_path):
    """Two 2-step runs of the same command: the adapters (``fp8dist train`` as a user runs it, ~9 s), then
    --merge-lora (the same flags on the dist harness's 2 ranks, what each launched rank runs: no second launch
    importing torch, ~10 s of CPU). Same losses (the runs are deterministic); the plan keeps the base FP8 and the
    adapters bf16; the checkpoint holds the adapters only and equals the exported file bit for bit; PEFT's loader and
    the merged model give the same logits."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base, adapters, merged, ckpt = (_base_dir(made, tmp_path / "base"), tmp_path / "adapters", tmp_path / "merged",
                                    tmp_path / "ckpt")
    command = ["fp8dist", "train", "--pretrained", str(base), "--data", str(made.jsonl), "--data-cache",
               str(tmp_path / "cache"), "--strategy", "fsdp", "--fp8", "torchao", "--lora-rank", "8",
               "--lora-targets", "q_proj,v_proj,down_proj", "--steps", "2", "--batch-size", "4", "--seq-len", "32"]
    first = run([*command, "--save-pretrained", str(adapters), "--checkpoint-dir", str(ckpt)], timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_ranks(train_on_gloo_ranks, [*command[1:], "--save-pretrained", str(merged), "--merge-lora"])[0]
    losses = train_losses_printed(first.stdout)
    assert len(losses) == 2 and losses == train_losses_printed("\n".join(second))
    assert re.search(r"layers\.1\.mlp\.down_proj\.base_layer +Linear +fp8 +Float8Linear", first.stdout)
    assert re.search(r"layers\.1\.mlp\.down_proj\.lora_A\.default +Linear +bf16", first.stdout)
    assert f"save_pretrained: wrote {adapters} (" in first.stdout and "fp32, LoRA adapters)" in first.stdout

    meta = json.loads((ckpt / "step_00000002" / "meta.json").read_text())
    assert meta["trainable_only"] and len(meta["parameters"]) == 12  # A and B of 3 Linears in 2 layers
    assert all(".lora_A." in n or ".lora_B." in n for n in meta["parameters"])
    saved = _checkpoint_tensors(ckpt / "step_00000002", tmp_path)
    exported = load_file(adapters / "adapter_model.safetensors")
    assert sorted(exported) == sorted(n.replace(".default.", ".") for n in saved)
    for name, value in saved.items():  # fp32 master weights written in fp32: the trained adapters exactly
        assert torch.equal(exported[name.replace(".default.", ".")], value), name
    assert any(v.abs().max() > 0 for n, v in saved.items() if ".lora_B." in n)  # trained away from PEFT's zeros

    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters)(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(base)(ids).logits
    assert AutoModelForCausalLM.from_pretrained(merged).dtype == torch.float32  # as-loaded: the base's fp32
    # measured: 2.7e-7 apart (W + s*B@A summed once vs. the adapter path's two GEMMs); the adapters moved them 0.13
    assert (peft_logits - merged_logits).abs().max() < 2e-6
    assert (peft_logits - base_logits).abs().max() > 1e-2


class _Stop(Exception):
    """Ends a run after its second step (and its checkpoint), as a crash would."""


def _resume_case(rank: int, world: int, directory: str) -> dict:
    """One rank: a 4-step LoRA run on the built-in model; the same run stopped after step 2 and resumed; a full
    (non-LoRA) run's checkpoint for scale."""
    from fp8dist.config.resolve import resolve_config
    from fp8dist.train.job import run_training

    config, quiet = resolve_config(strategy="fsdp", fp8="torchao"), (lambda line: None)
    job = TrainConfig(steps=4, batch_size=4, seq_len=32, lora_rank=8, save_every=2, keep_last=0,
                      checkpoint_dir=f"{directory}/straight")
    straight = run_training(config, job, log=quiet).losses

    def crash(done: int) -> None:
        if done == 2:
            raise _Stop

    job = replace(job, checkpoint_dir=f"{directory}/resumed", resume=True)
    with pytest.raises(_Stop):
        run_training(config, job, log=quiet, progress=crash)
    resumed = run_training(config, job, log=quiet)
    run_training(config, TrainConfig(steps=1, batch_size=4, seq_len=32, checkpoint_dir=f"{directory}/full"),
                 log=quiet)
    return dict(straight=straight, resumed=resumed.losses, start=resumed.start_step)


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.distcp"))


def test_lora_resume_is_exact_and_its_checkpoint_holds_only_the_adapters(tmp_path):
    """Straight, interrupted + resumed, and a full run for scale, on 2 ranks (~10 s)."""
    for r in run_ranks(_resume_case, str(tmp_path)):
        assert r["start"] == 2 and len(r["resumed"]) == 2
        assert r["resumed"] == r["straight"][2:]  # bitwise: adapters, AdamW moments, data position restored
    lora, full = _size(tmp_path / "straight" / "step_00000004"), _size(tmp_path / "full" / "step_00000001")
    # measured: 187 KiB (8,192 adapter parameters, their moments, the optimizer's groups) vs 5.5 MiB for the whole
    # 0.46M-parameter model
    assert lora < full / 20, (lora, full)


def _fsdp1_export_case(rank: int, world: int, directory: str) -> None:
    from fp8dist.config.resolve import resolve_config
    from fp8dist.train.job import run_training

    run_training(resolve_config(strategy="fsdp1", fp8="torchao"),
                 TrainConfig(steps=1, batch_size=4, seq_len=32, lora_rank=8, save_pretrained=directory),
                 log=lambda line: None)


def test_fsdp1s_flat_parameters_export_the_adapters_peft_loads(tmp_path):
    """FSDP1 wraps the module names PEFT finds its adapters by: the export names them as PEFT does all the same
    (2 ranks, ~6 s)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from fp8dist.train.models import build_llama

    run_ranks(_fsdp1_export_case, str(tmp_path))
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert len(saved) == 8 and all(re.search(r"\.(q|v)_proj\.lora_[AB]\.weight$", n) for n in saved)
    loaded = PeftModel.from_pretrained(build_llama("tiny"), tmp_path)
    assert all(torch.equal(loaded.state_dict()[n.replace(".weight", ".default.weight")], v)
               for n, v in saved.items())


@pytest.mark.parametrize("options, message", [
    (dict(lora_rank=-1), "lora_rank=-1 must be 0 (off) or more"),
    (dict(lora_rank=8, lora_alpha=0.0), "lora_alpha=0.0 must be positive and finite (e.g. 16), or none"),
    (dict(lora_rank=8, lora_dropout=1.0), "lora_dropout=1.0 must be in [0, 1)"),
    (dict(lora_alpha=16.0), "lora_alpha=16.0 with lora_rank=0 (LoRA off) has no effect: pass --lora-rank R"),
    (dict(lora_targets=("q_proj",)), "lora_targets=('q_proj',) with lora_rank=0 (LoRA off) has no effect"),
    (dict(lora_rank=8, merge_lora=True), "merge_lora with no save_pretrained: pass --save-pretrained DIR"),
])
def test_bad_lora_options_are_refused_with_the_way_out(options, message):
    with pytest.raises(ValueError) as err:
        TrainConfig(**options)
    assert message in str(err.value)


def test_lora_options_on_the_command_line_parse_and_refuse_before_any_process(capsys):
    import argparse

    from fp8dist.cli import train as train_cli

    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    _, job = train_cli._config_and_job(parser.parse_args(
        ["train", "--lora-rank", "16", "--lora-targets", "q_proj,o_proj", "gate_proj", "--lora-dropout", "0.05"]))
    assert (job.lora_rank, job.lora_targets, job.lora_dropout) == (16, ("q_proj", "o_proj", "gate_proj"), 0.05)
    assert main(["train", "--lora-dropout", "0.1"]) == 2
    assert "lora_dropout=0.1 with lora_rank=0 (LoRA off) has no effect" in capsys.readouterr().err


def test_a_target_matching_no_linear_names_the_models_linears_and_a_close_match():
    from fp8dist.train.lora import apply_lora
    from fp8dist.train.models import build_llama

    with pytest.raises(ValueError) as err:
        apply_lora(build_llama("tiny"), TrainConfig(lora_rank=8, lora_targets=("q_prj",)))
    assert ("lora_targets: 'q_prj' names no Linear, Conv1D or Embedding layer of LlamaForCausalLM; choose among "
            "its names: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj. Did you "
            "mean 'q_proj'?") in str(err.value)
    model = apply_lora(build_llama("tiny"), TrainConfig(lora_rank=8))  # PEFT's Llama default: q_proj, v_proj
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 8 and all(re.search(r"\.(q|v)_proj\.lora_[AB]\.", n) for n in trainable)
    assert model.peft_config["default"].lora_alpha == 16.0  # twice the rank


def test_without_peft_the_error_says_how_to_install_it(monkeypatch):
    from fp8dist.train.lora import import_peft

    monkeypatch.setitem(sys.modules, "peft", None)  # what an environment without peft imports
    with pytest.raises(ImportError, match=r"--lora-rank needs the peft package .* pip install peft"):
        import_peft()


@pytest.mark.parametrize("strategy, reason", [
    ("fsdp1", "strategy 'fsdp1' shards flat parameters, so a rank may hold none of the trainable ones"),
    ("deepspeed", "strategy 'deepspeed' saves in DeepSpeed's own checkpoint format"),
])
def test_lora_checkpoints_are_refused_before_any_step_where_the_base_cannot_be_left_out(strategy, reason):
    """FSDP1 would hang in DCP's optimizer-state initialization on a rank holding no adapter element (seen on 2
    ranks with the tiny model); DeepSpeed's own checkpoint always holds every weight."""
    from fp8dist.config.resolve import resolve_config
    from fp8dist.train.lora import lora_job_model
    from fp8dist.train.models import build_llama

    with pytest.raises(ValueError) as err:
        lora_job_model(resolve_config(strategy=strategy), TrainConfig(lora_rank=8, checkpoint_dir="ckpt"),
                       build_llama("tiny"))
    assert f"checkpoint_dir with lora_rank=8: {reason}" in str(err.value)
    assert str(err.value).endswith("Train the adapters with strategy 'none', 'ddp', 'fsdp', or train without "
                                   "--checkpoint-dir.")
