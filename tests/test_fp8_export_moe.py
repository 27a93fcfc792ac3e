"""FP8 exports of an MoE model (issue 55): a tiny Mixtral trained with its experts in FP8 (torchao's MoE grouped GEMMs,
emulated MXFP8) is exported with its FP8 Linears in e4m3 and its experts in bf16, and the experts are listed as not
converted under the name each loader matches: transformers' FineGrainedFP8 otherwise swaps every ``*.experts`` module
for its FP8Experts on an FP8 GPU, and vLLM quantizes a FusedMoE layer its list does not name (vLLM's Mixtral names it
``model.layers.N.block_sparse_moe.experts``, models/mixtral.py). One process, strategy "none"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fp8dist
from fp8dist.checkpoint.fp8_export import fp8_summary
from fp8dist.fp8.hf_format import scale_name
from test_fp8_checkpoints import _logits  # the tiny models' shared ids, loaded by transformers on a CPU

pytest.importorskip("torchao", reason="FP8 exports need a model trained in FP8 (torchao)")

EXPERTS = [f"model.layers.{i}.mlp.experts" for i in (0, 1)]
LISTED = sorted(["lm_head", *(f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")),  # as Llama's
                 *EXPERTS, *(n.replace(".mlp.", ".block_sparse_moe.") for n in EXPERTS)])  # transformers', vLLM's
HUB = sorted(["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
              *(f"model.layers.{i}.{n}" for i in (0, 1) for n in (
                  "input_layernorm.weight", "post_attention_layernorm.weight", "block_sparse_moe.gate.weight",
                  *(f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
                  *(f"block_sparse_moe.experts.{e}.w{w}.weight" for e in range(4) for w in (1, 2, 3))))])
RAN = "ran FP8 in training (torchao MoE: MXFP8 grouped GEMM, emulated); written bf16: fp8dist's FP8 layouts hold " \
      "Linear weights only"


def _written(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def _quantized_by_loader(path: Path, config: dict) -> set[str]:
    """The modules the loader of ``config``'s layout turns into quantized ones, by its own code, on a meta model:
    transformers' FineGrainedFP8 swap as it runs on an FP8 GPU (on a CPU it dequantizes instead), compressed-tensors'
    matching of the config's targets and ignore list."""
    from compressed_tensors.utils import match_named_modules
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    if config["quant_method"] == "fp8":
        replace_with_fp8_linear(model, modules_to_not_convert=config["modules_to_not_convert"],
                                quantization_config=FineGrainedFP8Config(**config))
        return {n for n, m in model.named_modules() if type(m).__name__.startswith("FP8")}
    targets = [t for group in config["config_groups"].values() for t in group["targets"]]
    return {n for n, _ in match_named_modules(model, targets, config["ignore"])}


def test_a_mixtral_fp8_export_lists_its_bf16_experts_under_each_loaders_name_and_loads_like_the_bf16_export(
        tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from test_fp8_families import mixtral_tiny
    from transformers import FineGrainedFP8Config

    torch.set_num_threads(1)
    model = fp8dist.wrap_model(mixtral_tiny(), strategy="none", fp8="torchao", torchao_moe_recipe="mxfp8_emulated")
    for key, options in {"bf16": {}, "ct": {"dtype": "fp8"},
                         "blocks": {"dtype": "fp8", "fp8_format": "fine-grained"}}.items():
        fp8dist.save_pretrained(model, tmp_path / key, **options)
    bf16 = _written(tmp_path / "bf16")
    for key in ("ct", "blocks"):
        config = json.loads((tmp_path / key / "config.json").read_text())["quantization_config"]
        listed = config.get("ignore", config.get("modules_to_not_convert"))
        assert listed == LISTED, key
        written = _written(tmp_path / key)
        e4m3 = {n.removesuffix(".weight") for n, d in written.items() if d == "F8_E4M3"}
        assert len(e4m3) == 5 and not any(".experts" in n for n in e4m3)
        assert {n: d for n, d in written.items() if ".experts." in n} == {n: d for n, d in bf16.items()
                                                                          if ".experts." in n}  # all BF16
        # the names transformers' own save_pretrained writes (the Hub's, vLLM's Mixtral reads), experts one by one
        scales = {scale_name(n, "compressed-tensors" if key == "ct" else "fine-grained") for n in written}
        assert sorted(n for n in written if n not in scales) == HUB, key
        ours, plain = load_file(tmp_path / key / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
        assert all(torch.equal(ours[n], plain[n]) for n in HUB if ".experts." in n), key
        assert _quantized_by_loader(tmp_path / key, config) == e4m3, key  # no bf16 module is quantized at load
        # measured 2026-12-02: 0.9985 (compressed-tensors, per tensor), 0.9989 (128x128 blocks)
        assert torch.nn.functional.cosine_similarity(_logits(tmp_path / key), _logits(tmp_path / "bf16"),
                                                     dim=0).item() >= 0.995, key
        record = json.loads((tmp_path / key / "fp8_export.json").read_text())
        assert record["modules_bf16"] == {n: {"listed_as": [n, n.replace(".mlp.", ".block_sparse_moe.")],
                                              "reason": RAN} for n in EXPERTS}
        if key == "ct":
            assert QuantizationConfig.model_validate(config).ignore == LISTED  # compressed-tensors' own validation
        else:
            assert FineGrainedFP8Config(**config).modules_to_not_convert == LISTED
    assert fp8_summary(tmp_path / "ct").endswith(
        "; 2 experts modules bf16, listed as not converted (a loader would quantize them)")
