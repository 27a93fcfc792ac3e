"""Activation memory per FP8 recipe (issue 52 item 4): what each recipe keeps for backward, as torchao's code saves
it — MXFP8 and float8 the bf16 input (``mx_mm`` saves ``input_hp``), NVFP4 a quantized copy of each FP4 Linear's
input and of its weight's transpose (``nvfp4_mm_triton`` saves ``x_col_codes``, ``x_col_sf``, ``Wt_fp4_x2``,
``Wt_sf``) — and the estimate beside torchtitan #3914's measured peaks."""

from __future__ import annotations

import copy
import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fp8dist
from fp8dist import estimate_memory
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


def _memory_benchmark():
    """benchmarks/step_model/memory.py, imported as agree.py is in test_step_model.py."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_model" / "memory.py"
    spec = importlib.util.spec_from_file_location("step_model_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_torchtitan_3914_s_three_peaks_predicted_per_recipe_and_the_nvfp4_miss_recorded():
    """torchtitan #3914 (Llama3-8B, 4 GB200s, FSDP, local batch 32 x 2,048): measured peaks bf16 174.5, MXFP8 179.9,
    NVFP4 103.0 GiB. The estimate of that run as torchtitan ran it (its selective policy counting aten.mm only, its
    chunked loss, memory.py) puts bf16 and MXFP8 within 15% and the recipes in #3914's order; NVFP4 is a miss
    (-20.9%): what it keeps is what torch's partitioner keeps (the test below), the rest is a residual every recipe's
    peak shows (benchmarks/step_model/README.md). Before: 213.0 GiB for every recipe (+22%, +18%, +107%): Hugging
    Face's whole-batch logits and fp32 log-softmax (47 GiB) and every other NVFP4 GEMM output kept."""
    memory = _memory_benchmark()
    rows = {r["recipe"]: r for r in memory.table(memory.predict(memory.meta_llama3_8b()))}
    predicted = {name: r["predicted_gib"] for name, r in rows.items()}
    assert predicted == {"bf16": 171.9, "mxfp8": 171.9, "nvfp4": 81.5, "nvfp4_bf16_tail": 95.8}
    errors = {name: r["error_pct"] for name, r in rows.items()}
    assert errors == {"bf16": -1.5, "mxfp8": -4.5, "nvfp4": -20.9, "nvfp4_bf16_tail": -13.7}  # goal: within 15%
    assert [name for name, r in rows.items() if not r["within_goal"]] == ["nvfp4"]  # the README's miss
    assert predicted["nvfp4"] < predicted["bf16"] <= predicted["mxfp8"]  # #3914: 103.0 < 174.5 <= 179.9
    # fp8dist's own run (its policy keeps every other GEMM output whatever the recipe; Hugging Face's loss)
    assert {name: r["fp8dist_run_gib"] for name, r in rows.items()} == \
        {"bf16": 213.0, "mxfp8": 213.0, "nvfp4": 211.7, "nvfp4_bf16_tail": 213.0}
    recorded = json.loads((Path(memory.__file__).parent / "memory.json").read_text())
    assert recorded["rows"] == list(rows.values())  # memory.json is this run's output
    readme = memory.README.read_text()
    assert memory.render(recorded["rows"], recorded["compiled_block"]["saved_bytes"]) in readme


def test_a_compiled_block_keeps_what_the_estimate_counts_and_torchtitan_s_policy_recomputes_nvfp4_s_saves():
    """What #3914's runs keep between forward and backward, read from torch's own partitioner (block_saves.py): a
    torchtitan-shaped block compiled with the min-cut partitioner inductor uses, its Linears torchao 0.18's NVFP4
    autograd Function (its saves and F.scaled_mm as they are; its SM100-only Triton kernels stood in by CPU ops of
    the shapes torchao's fake kernels give). Without checkpointing each NVFP4 Linear keeps its input and its weight's
    transpose quantized, at the backend's saved_input_bytes / autograd_weight_bytes (0.5625 bytes per element; w1
    and w3 share one copy of their common input: compile's CSE). Under torchtitan's selective policy, which counts no
    NVFP4 GEMM and tags torchao's quantize ops PREFER_RECOMPUTE, none is kept: the block keeps its input, attention's
    output and log-sum-exp and 5 amax scalars (aten.max, on torchtitan's save list) — the estimate's NVFP4 layer
    under that policy. bf16 under it keeps the 1st and 3rd GEMM outputs (wqkv, w1), not the 5th (w2: MUST_SAVE, but
    no backward op reads it). Measured: 4 compiles, 3.2 s."""
    from fp8dist import resolve_config
    from fp8dist.accounting.activation_families import FAMILIES, Saves, kept_by_selective
    from fp8dist.fp8 import get_backend

    memory = _memory_benchmark()
    from block_saves import BLOCK, all_block_saves  # memory.py put its folder on sys.path

    saves = all_block_saves()
    assert json.loads((Path(memory.__file__).parent / "memory.json").read_text())["compiled_block"] == \
        {"block": BLOCK, "saved_bytes": saves}  # memory.json (and the README's table) is this run's output
    T, h, i, heads, head_dim = (BLOCK[k] for k in ("seq", "h", "inter", "heads", "head_dim"))
    kv = BLOCK["kv_heads"] * head_dim
    params = h * (h + 2 * kv) + h * h + 3 * h * i  # wqkv, wo, w1, w3, w2
    cfg, backend = resolve_config(fp8="torchao", torchao_recipe="nvfp4"), get_backend("torchao")
    inputs = T * (3 * h + i)  # wqkv's, wo's, w1's = w3's, w2's
    assert saves["nvfp4"]["none"]["quantized copies"] == \
        backend.saved_input_bytes(cfg) * inputs + backend.autograd_weight_bytes(cfg) * params == 737_280
    s = Saves(T=T, c=2, r=2, n=2, decisions={}, fp8_input=0.0, swapped_norms=False, kv_cache=False)
    dims = {"h": h, "i": i, "a": heads, "d": head_dim, "kv": BLOCK["kv_heads"], "layers": 1, "V": 0}
    no_gemm_counted = kept_by_selective(FAMILIES["llama"], s, dims, None, [False] * 7)
    assert saves["nvfp4"]["selective"] == {"block input": 2 * T * h, "attention": no_gemm_counted, "GEMM outputs": 0,
                                           "quantized copies": 0, "amax scalars": 4 * 5, "other": 0}
    assert saves["bf16"]["selective"]["GEMM outputs"] == 2 * T * ((h + 2 * kv) + i)


def test_the_loss_chunks_and_the_selective_policy_are_estimate_options_with_clear_errors():
    """loss_chunks: the logits of one chunk at a time; selective_gemms: the ops the policy counts, each converted
    GEMM's op its recipe's ``checkpoint_gemm``."""
    model = _meta_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512)
    run = dict(strategy="fsdp", world_size=2, micro_batch_size=2, seq_len=256, activation_checkpointing="selective")
    whole = dict(estimate_memory(model, **run).activations)
    chunked = dict(estimate_memory(model, **run, loss_chunks=4).activations)
    assert whole["logits (compute dtype) + fp32 log-softmax"] == (2 + 4) * 2 * 256 * 512
    assert chunked["logits of one loss chunk of 128 tokens (compute dtype) + fp32 log-softmax (loss_chunks=4)"] \
        == (2 + 4) * 128 * 512
    kept = "2 decoder layers' attention outputs and every other GEMM output (selective)"
    T, h, heads = 2 * 256, 256, 4
    attention = 2 * T * (2 * h + 4 * heads)  # per layer: bf16 output, fp32 log-sum-exp
    nvfp4 = dict(fp8="torchao", torchao_recipe="nvfp4", **ALL_DECODER_LINEARS)
    ours = dict(estimate_memory(model, **run, **nvfp4).activations)[kept]
    titan = estimate_memory(model, **run, **nvfp4, selective_gemms=("aten.mm.default",))
    assert ours == attention + 2 * T * 2 * (h + 128 + 512 + h)  # q, v, gate, down kept: _scaled_mm_v2 counted
    assert dict(titan.activations)[kept] == attention  # torchtitan's policy: no NVFP4 GEMM output kept
    assert ("selective checkpointing counts aten.mm.default: GEMMs running aten._scaled_mm_v2.default are not "
            "counted, their outputs recomputed in backward") in titan.notes
    for bad in (0, 257, 2.0, True):
        with pytest.raises(ValueError, match=rf"loss_chunks={bad!r} must be an integer from 1 .* to seq_len=256"):
            estimate_memory(model, **run, loss_chunks=bad)
    with pytest.raises(ValueError, match="selective_gemms='aten.mm.default' must be a sequence of op names"):
        estimate_memory(model, **run, selective_gemms="aten.mm.default")


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox"])
def test_a_policy_counting_only_aten_mm_keeps_what_the_estimate_says(model_type, monkeypatch):
    """torchtitan's selective policy counts aten.mm / aten.linear only: the biased GEMMs of GPT-2 and GPT-NeoX
    (aten.addmm) are then recomputed, as NVFP4's _scaled_mm_v2 is in #3914. The policy injected into wrap_model's
    checkpoint, what the forward leaves alive against the estimate with ``selective_gemms``."""
    import fp8dist.pipeline.blocks as blocks
    from fp8dist.accounting.estimate_activations import RECOMPUTE_ITEM
    from test_blocks import _Storages
    from test_estimate import _family_model

    warnings.simplefilter("ignore")  # use_cache turned off
    titan = ("aten.mm.default", "aten.linear.default")
    monkeypatch.setattr(blocks, "SELECTIVE_GEMMS", titan)
    run = dict(strategy="none", fp8="none", param_dtype="fp32", activation_checkpointing="selective")
    model = _family_model(model_type)
    est = estimate_memory(model, micro_batch_size=2, seq_len=128, selective_gemms=titan, **run)
    ours = estimate_memory(model, micro_batch_size=2, seq_len=128, **run)
    item = "2 decoder layers' attention outputs and every other GEMM output (selective)"
    assert dict(est.activations)[item] < dict(ours.activations)[item]  # no GEMM output kept: attention alone
    wrapped = fp8dist.wrap_model(model, **run)
    ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    with _Storages(wrapped) as storages:
        out = wrapped(input_ids=ids, labels=ids)
    kept = sum(n for item, n in est.activations if item != RECOMPUTE_ITEM)
    ratio = kept / storages.alive()
    # measured: gpt2 0.9945, gpt_neox 0.9923 (the ids, the loss's targets: not modelled); fp8dist's count kept 1.98x
    assert out.loss.isfinite() and 0.988 <= ratio <= 1.0, f"{model_type}: estimate / kept = {ratio:.4f}"


def test_fp8dist_estimate_takes_the_loss_chunks_and_the_selective_policy_as_flags(capsys):
    """``fp8dist estimate --loss-chunks 8 --selective-gemms ...``: the same activations as estimate_memory with those
    options, and a bad value is the library's one-line error (exit 2)."""
    from fp8dist.cli import main

    flags = ["estimate", "--model-size", "tiny", "--world-size", "2", "--micro-batch-size", "2", "--seq-len", "64",
             "--activation-checkpointing", "selective", "--fp8", "none", "--json"]

    def activations(*extra: str) -> dict:
        assert main([*flags, *extra]) == 0
        return dict(json.loads(capsys.readouterr().out)["activations"])

    whole, chunked = activations(), activations("--loss-chunks", "8")
    titan = activations("--selective-gemms", "aten.mm.default,aten.linear.default")
    assert any("loss_chunks=8" in item for item in chunked) and not any("loss_chunks" in item for item in whole)
    assert sum(chunked.values()) < sum(whole.values())
    assert titan == whole  # fp8="none": every GEMM is aten.mm, counted by either policy
    assert main([*flags, "--loss-chunks", "65"]) == 2
    assert "loss_chunks=65 must be an integer from 1" in capsys.readouterr().err
