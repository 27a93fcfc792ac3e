"""What an export leaves in its folder, as a loader reads it:

- a PEFT model with two adapters is written as PEFT's own ``save_pretrained`` writes it (the adapter "default" in the
  folder, the other in a subfolder of its name, each with its own config, its DoRA magnitudes and modules to save),
  file for file and tensor for tensor, and PEFT loads both back;
- every export that writes a model (``save_merged`` = ``--merge-lora``, ``save_adapters``, ``save_pretrained``)
  removes the model files an earlier export left there (an ``adapter_config.json`` beside merged weights makes
  transformers apply the old adapter to the base again), and keeps the rest (a tokenizer).

One process, strategy "none" (the gathering under FSDP1 and FSDP2 is tested in test_lora_train.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp8dist import save_pretrained, wrap_model
from fp8dist.checkpoint.lora import save_adapters, save_merged
from fp8dist.strategies import unwrap_model
from fp8dist.train.models import build_llama

peft = pytest.importorskip("peft", reason="LoRA exports need peft (pip install peft)")


def _randomized(model, seed: int):
    """Every adapter tensor drawn afresh (PEFT starts lora_B at zero, which would hide a mix-up)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _two_adapters():
    """A tiny Llama with "default" (rank 4 on q_proj, lm_head trained whole) and "second" (DoRA, rank 2 on v_proj),
    wrapped."""
    torch.set_num_threads(1)
    model = peft.get_peft_model(build_llama("tiny", seed=0), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                             modules_to_save=["lm_head"]))
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"], use_dora=True))
    return _randomized(wrap_model(model, strategy="none"), seed=1)


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_two_adapters_are_exported_as_peft_exports_them_and_peft_loads_both(tmp_path):
    from safetensors.torch import load_file

    model = _two_adapters()
    save_adapters(model, tmp_path / "ours")
    unwrap_model(model).save_pretrained(str(tmp_path / "peft"))  # PEFT's own export, the reference
    weights = ["adapter_model.safetensors", "second/adapter_model.safetensors"]
    peft_files = [n for n in _files(tmp_path / "peft") if not n.endswith("README.md")]  # PEFT's model card too
    assert _files(tmp_path / "ours") == peft_files == ["adapter_config.json", weights[0], "second/adapter_config.json",
                                                       weights[1]]
    for name in weights:
        ours, theirs = load_file(tmp_path / "ours" / name), load_file(tmp_path / "peft" / name)
        assert sorted(ours) == sorted(theirs), name
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    for name in ("adapter_config.json", "second/adapter_config.json"):
        ours, theirs = (json.loads((tmp_path / d / name).read_text()) for d in ("ours", "peft"))
        assert {k: ours[k] for k in ("r", "target_modules", "use_dora", "modules_to_save")} == \
            {k: theirs[k] for k in ("r", "target_modules", "use_dora", "modules_to_save")}, name

    loaded = peft.PeftModel.from_pretrained(build_llama("tiny", seed=0), tmp_path / "ours")
    loaded.load_adapter(tmp_path / "ours" / "second", adapter_name="second")
    trained = unwrap_model(model).state_dict()
    adapted = {k: v for k, v in loaded.state_dict().items() if "lora_" in k or "modules_to_save" in k}
    assert len(adapted) == 11  # q_proj A, B and v_proj A, B, magnitude in 2 layers; lm_head kept
    assert all(torch.equal(v, trained[k]) for k, v in adapted.items())


def _one_adapter(seed: int):
    torch.set_num_threads(1)
    model = peft.get_peft_model(build_llama("tiny", seed=0), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    return _randomized(wrap_model(model, strategy="none"), seed)


def test_merge_lora_into_a_folder_holding_an_earlier_runs_adapters_leaves_only_the_merged_model(tmp_path):
    """Run 1 exported its adapters into OUT (naming the base), run 2 merges other adapters into OUT: transformers,
    finding run 1's adapter_config.json, loaded the base with run 1's adapters instead of run 2's merged weights."""
    from transformers import AutoModelForCausalLM

    base, out = tmp_path / "base", tmp_path / "out"
    build_llama("tiny", seed=0).save_pretrained(base)
    save_adapters(_one_adapter(seed=1), out, base_model=str(base))
    (out / "tokenizer.json").write_text("{}")  # the user's, or the job's: stays
    second = _one_adapter(seed=2)
    save_merged(second, out, dtype=torch.float32)
    assert _files(out) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = peft.get_peft_model(build_llama("tiny", seed=0), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    reference.load_state_dict(unwrap_model(second).state_dict())  # run 2's model, in fp32 (wrap_model's runs bf16)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(input_ids=ids).logits
    # measured: 3.6e-7 apart (W + s*B@A summed once vs. the adapter path's two GEMMs); before, with run 1's
    # adapter_config.json left beside, transformers loaded the base with run 1's adapters: 0.063 apart
    assert (merged - expected).abs().max() < 5e-6

    save_adapters(second, out, base_model=str(base))  # and back: the merged weights go, their config.json stays
    assert _files(out) == ["adapter_config.json", "adapter_model.safetensors", "config.json",
                           "generation_config.json", "tokenizer.json"]


def test_every_export_removes_the_model_files_an_earlier_one_left(tmp_path):
    """save_pretrained over two adapters (one in a subfolder, as PEFT keeps a second adapter); a trainer's
    checkpoint subfolder, which holds more than an adapter, is left alone."""
    save_adapters(_two_adapters(), tmp_path)
    (tmp_path / "checkpoint-500").mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt"):
        (tmp_path / "checkpoint-500" / name).write_text("{}")
    save_pretrained(wrap_model(build_llama("tiny", seed=0), strategy="none"), tmp_path)
    assert _files(tmp_path) == ["checkpoint-500/adapter_config.json", "checkpoint-500/adapter_model.safetensors",
                                "checkpoint-500/optimizer.pt", "config.json", "generation_config.json",
                                "model.safetensors"]


def test_adapters_are_not_written_over_the_base_they_name(tmp_path):
    build_llama("tiny", seed=0).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as refused:
        save_adapters(_one_adapter(seed=1), tmp_path, base_model=str(tmp_path))
    assert str(refused.value) == (
        f"save_adapters: out_dir {str(tmp_path)!r} is the base model's folder (base_model): the export removes the "
        "model weights it finds there. Write the adapters into a folder of their own.")
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / "adapter_config.json").exists()


def test_a_module_to_save_is_merged_as_trained_and_what_a_plain_merge_cannot_reproduce_is_refused(tmp_path):
    """lm_head trained whole (modules_to_save) lands under its own name (before: the strict load found no lm_head
    and raised); two adapters or a DoRA one are refused before anything is gathered (before: 'default' alone was
    merged, the rest dropped; DoRA's magnitudes ignored)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    model = _randomized(wrap_model(peft.get_peft_model(build_llama("tiny", seed=0), config), strategy="none"), 3)
    save_merged(model, tmp_path / "merged", dtype=torch.float32)
    reference = peft.get_peft_model(build_llama("tiny", seed=0), config)
    reference.load_state_dict(unwrap_model(model).state_dict())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    expected = reference.merge_and_unload().state_dict()  # PEFT's own merge
    assert sorted(merged) == sorted(expected)
    assert all(torch.equal(merged[k], expected[k]) for k in merged)  # measured: bit for bit, lm_head the trained copy

    with pytest.raises(ValueError) as refused:
        save_merged(_two_adapters(), tmp_path / "two")
    assert str(refused.value) == (
        "save_merged: the model holds the adapters 'default', 'second'; fp8dist merges one, 'default'. Export them "
        "with save_adapters (one folder each, as PEFT does), or delete the others (model.delete_adapter) before "
        "wrap_model.")
    dora = wrap_model(peft.get_peft_model(build_llama("tiny", seed=0), peft.LoraConfig(
        r=2, target_modules=["v_proj"], use_dora=True)), strategy="none")
    with pytest.raises(ValueError, match=r"save_merged: the adapter 'default' is DoRA \(use_dora=True\), whose "
                                         "magnitudes this merge does not apply. Export it with save_adapters"):
        save_merged(dora, tmp_path / "dora")
    assert not (tmp_path / "two").exists() and not (tmp_path / "dora").exists()


def test_adapters_whose_biases_train_are_refused_before_anything_is_gathered(tmp_path):
    """PEFT's file of a bias="lora_only" adapter holds the biases of its layers (Qwen2's q, k, v); the export wrote
    the adapters without them. A model without biases (Llama) exports as before."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(1)
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], bias="lora_only")
    qwen2 = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    model = wrap_model(peft.get_peft_model(qwen2, config), strategy="none")
    with pytest.raises(ValueError) as refused:
        save_adapters(model, tmp_path / "out")
    assert str(refused.value) == (
        "save_adapters: adapter 'default' has bias='lora_only'; fp8dist exports LoRA adapters that train no bias. "
        "Export the whole model instead (save_merged, or fp8dist.save_pretrained).")
    assert not (tmp_path / "out").exists()
    llama = wrap_model(peft.get_peft_model(build_llama("tiny", seed=0), config), strategy="none")
    assert _files(save_adapters(llama, tmp_path / "llama")) == ["adapter_config.json", "adapter_model.safetensors"]
