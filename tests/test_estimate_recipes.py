"""Activation memory per FP8 recipe (issue 52 item 4): what each recipe keeps for backward, as torchao's code saves
it — MXFP8 and float8 the bf16 input (``mx_mm`` saves ``input_hp``), NVFP4 a quantized copy of each FP4 Linear's
input and of its weight's transpose (``nvfp4_mm_triton`` saves ``x_col_codes``, ``x_col_sf``, ``Wt_fp4_x2``,
``Wt_sf``) — and the estimate beside torchtitan #3914's measured peaks."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fp8dist
from fp8dist import estimate_memory
from fp8dist.accounting.fit import device_bytes
from fp8dist.cli import main
from fp8dist.accounting.estimate_activations import ROOT_WEIGHTS_ITEM

# every decoder Linear converted (the first one and the tail too), the head kept out: each layer alike
ALL_DECODER_LINEARS = dict(keep_first_last_linear=False, fp8_exclude=["lm_head"], fp8_select="all",
                           keep_last_blocks_share=0.0)
NVFP4_BYTES = 0.5 + 1 / 16  # two e2m1 values a byte, one e4m3 scale per 16


def _meta_llama(**shape):
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**shape))


def test_nvfp4_keeps_each_fp4_linear_s_input_and_weight_quantized_and_mxfp8_its_bf16_input():
    model = _meta_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512)
    run = dict(strategy="fsdp", world_size=2, micro_batch_size=1, seq_len=256, target="b200")
    recipes = {"bf16": dict(fp8=None), "mxfp8": dict(fp8="torchao", torchao_recipe="mxfp8", **ALL_DECODER_LINEARS),
               "nvfp4": dict(fp8="torchao", torchao_recipe="nvfp4", **ALL_DECODER_LINEARS)}
    layers = {name: dict(estimate_memory(model, **run, **recipe).activations)["2 decoder layers"]
              for name, recipe in recipes.items()}
    assert layers["mxfp8"] == layers["bf16"]
    T, h, i = 256, 256, 512
    weights = 2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512  # q, o; k, v; gate, up, down
    # bf16: q/k/v's input and gate/up's input once each (shared), down's input; NVFP4: a copy per GEMM (o_proj's
    # too: its bf16 input is SDPA's saved output anyway) and each weight's transpose
    bf16 = 2 * (T * h + T * h + T * i)
    nvfp4 = NVFP4_BYTES * (3 * T * h + T * h + 2 * T * h + T * i + weights)
    assert layers["bf16"] - layers["nvfp4"] == 2 * (bf16 - nvfp4) == -204_800  # small layers: the weights dominate
    notes = estimate_memory(model, **run, **recipes["nvfp4"]).notes
    assert ("torchao nvfp4: each FP8 Linear keeps a quantized copy of its input (0.5625 bytes per element) and of its "
            "weight's transpose (0.5625 bytes per element)") in notes


def test_mxfp8_s_estimate_is_what_autograd_saves_on_a_real_converted_model():
    """torchao's MXFP8 with emulated GEMMs on a CPU (fp32 weights: its mx_mm does not follow autocast)."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    recipe = dict(strategy="none", param_dtype="fp32", fp8="torchao", torchao_recipe="mxfp8_emulated",
                  **ALL_DECODER_LINEARS)
    est = estimate_memory(model, micro_batch_size=2, seq_len=128, **recipe)
    assert any("keeps its high-precision input" in note for note in est.notes)
    wrapped = fp8dist.wrap_model(copy.deepcopy(model), **recipe)
    assert len(fp8dist.get_plan(wrapped).fp8) == 14
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()  # plain tensors only: no MX copy saved
        return t

    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = wrapped(input_ids=ids, labels=ids).logits
    seen[logits.untyped_storage().data_ptr()] = logits.untyped_storage().nbytes()
    weights = {t.untyped_storage().data_ptr() for p in wrapped.parameters()
               for t in ([getattr(p, n) for n in p.__tensor_flatten__()[0]] if type(p) is not torch.nn.Parameter
                         else [p])}
    saved = sum(n for ptr, n in seen.items() if ptr not in weights)
    estimated = sum(b for item, b in est.activations if item != ROOT_WEIGHTS_ITEM)
    assert estimated / saved == pytest.approx(1, abs=0.01)  # 0.9942 measured (the ids, rotary cos/sin: not modelled)


@pytest.mark.parametrize("torchao_recipe", ["mxfp8_emulated", "tensorwise"])
def test_selective_estimate_is_what_a_converted_model_keeps(torchao_recipe):
    """Selective checkpointing on FP8-converted Linears (emulated on a CPU): what stays alive after the forward
    (block inputs, attention outputs, every other GEMM output; the FP8 input copies are recomputed) against the
    estimate without its recompute transient."""
    from fp8dist.accounting.estimate_activations import RECOMPUTE_ITEM
    from test_blocks import _Storages

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256))
    recipe = dict(strategy="none", param_dtype="fp32", fp8="torchao", torchao_recipe=torchao_recipe,
                  activation_checkpointing="selective", **ALL_DECODER_LINEARS)
    est = estimate_memory(model, micro_batch_size=2, seq_len=128, **recipe)
    wrapped = fp8dist.wrap_model(copy.deepcopy(model), **recipe)
    assert len(fp8dist.get_plan(wrapped).fp8) == 14
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    with _Storages(wrapped) as storages:
        out = wrapped(input_ids=ids, labels=ids)  # holds the graph and what it keeps
    kept = sum(b for item, b in est.activations if item not in (RECOMPUTE_ITEM, ROOT_WEIGHTS_ITEM))
    # 0.9888 measured for both (the ids, rotary cos/sin, the amax scalars: not modelled)
    assert out.loss.isfinite() and kept / storages.alive() == pytest.approx(0.9888, abs=0.005)


# torchtitan #3914: Llama3-8B on 4 GB200s, FSDP, seq 2,048, local batch 32; peak memory per GPU, GiB
TORCHTITAN_3914 = {"bf16": 174.5, "mxfp8": 179.9, "nvfp4": 103.0}
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)


def test_torchtitan_3914_s_peaks_beside_the_estimate_of_the_nearest_run_fp8dist_represents(tmp_path, capsys):
    """Misses, recorded with their measured reasons. torchtitan's llama3_8b config checkpoints selectively (its
    "op" mode: every other ``aten.mm`` output and attention saved, the rest recomputed). fp8dist's selective is
    that policy, estimated: 213.0 GiB for every recipe (the FP8 copies are recomputed, the GEMM outputs are bf16
    whatever the recipe), +22% / +18% / +107% over the measured peaks: it does not fit the GB200, so the run a
    user gets is full checkpointing (108.1 GiB, where one bf16 layer's recompute sets every recipe's peak alike;
    NVFP4's +5% there is a coincidence). Two gaps explain the selective misses, each computed below from the
    estimate's items: (1) the 31.3 GiB fp32 log-softmax of Hugging Face's loss, which a fused or compiled loss
    need not keep (without it bf16 and MXFP8 land at +4% and +1%, in the goal; whether #3914's loss kept it is
    not known, and fp8dist's run keeps it, so it stays counted); (2) NVFP4: torchao's NVFP4 Linear calls ``F.scaled_mm`` (``_scaled_mm_v2``) from its own autograd
    function, which torchtitan's list does not hold, so torchtitan recomputes every GEMM output where fp8dist
    keeps every other (92 GiB here): with torchtitan's choice NVFP4 lands at +17%, -13% without the log-softmax
    too."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA3_8B, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    run = ["estimate", "--model-config", str(path), "--target", "gb200", "--world-size", "4", "--strategy", "fsdp",
           "--seq-len", "2048", "--micro-batch-size", "32", "--json"]
    recipes = {"bf16": ["--fp8", "none"], "mxfp8": ["--fp8", "torchao", "--torchao-recipe", "mxfp8"],
               "nvfp4": ["--fp8", "torchao", "--torchao-recipe", "nvfp4"]}
    gib = {}
    for name, flags in recipes.items():  # as a user asks: the run as torchtitan's, full checkpointing
        assert main([*run, *flags, "--activation-checkpointing", "full"]) == 0
        fit = json.loads(capsys.readouterr().out)["fit"]
        assert fit["fits"] is True
        gib[name] = round(fit["device_bytes"] / 2**30, 1)
    assert gib == {"bf16": 108.1, "mxfp8": 108.1, "nvfp4": 108.1}
    # without checkpointing (no rank fits a GB200; planned without a target: no fit search): NVFP4 saves 35 GiB of
    # bf16's 392 GiB of activations
    model = _meta_llama(**LLAMA3_8B)
    none = {name: round(device_bytes(estimate_memory(model, strategy="fsdp", world_size=4, micro_batch_size=32,
                                                     seq_len=2048, **recipe)) / 2**30, 1)
            for name, recipe in (("bf16", {}), ("mxfp8", dict(fp8="torchao", torchao_recipe="mxfp8")),
                                 ("nvfp4", dict(fp8="torchao", torchao_recipe="nvfp4")))}
    assert none == {"bf16": 472.1, "mxfp8": 472.1, "nvfp4": 437.4}
    ratios = {name: round(gib[name] / measured, 2) for name, measured in TORCHTITAN_3914.items()}
    assert ratios == {"bf16": 0.62, "mxfp8": 0.60, "nvfp4": 1.05}  # the goal is within 15%: two of three miss
    # selective, torchtitan's policy (fp8dist's 'selective'): the same run, and the two gaps named above
    selective = estimate_memory(model, strategy="fsdp", world_size=4, micro_batch_size=32, seq_len=2048,
                                activation_checkpointing="selective")  # every recipe alike: checked below
    total = device_bytes(selective)
    for recipe in (dict(fp8="torchao", torchao_recipe="mxfp8"), dict(fp8="torchao", torchao_recipe="nvfp4")):
        assert device_bytes(estimate_memory(model, strategy="fsdp", world_size=4, micro_batch_size=32, seq_len=2048,
                                            activation_checkpointing="selective", **recipe)) == total
    items = dict(selective.activations)
    kept = next(n for item, n in items.items() if item.endswith("every other GEMM output (selective)"))
    T, h, heads = 32 * 2048, LLAMA3_8B["hidden_size"], LLAMA3_8B["num_attention_heads"]
    attention = LLAMA3_8B["num_hidden_layers"] * T * (2 * h + 4 * heads)  # bf16 output, fp32 log-sum-exp
    log_softmax = 4 * T * LLAMA3_8B["vocab_size"]
    assert round(total / 2**30, 1) == 213.0 and round((kept - attention) / 2**30, 1) == 92.0
    assert round(log_softmax / 2**30, 1) == 31.3

    def against_3914(minus: int) -> dict[str, float]:
        return {name: round((total - minus) / 2**30 / measured, 2) for name, measured in TORCHTITAN_3914.items()}

    assert against_3914(0) == {"bf16": 1.22, "mxfp8": 1.18, "nvfp4": 2.07}  # all three miss
    assert against_3914(log_softmax) == {"bf16": 1.04, "mxfp8": 1.01, "nvfp4": 1.76}  # a fused loss
    assert against_3914(kept - attention)["nvfp4"] == 1.17  # torchtitan's NVFP4: no GEMM output kept
    assert against_3914(kept - attention + log_softmax)["nvfp4"] == 0.87  # and a fused loss

