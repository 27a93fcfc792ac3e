"""The step model (fp8dist.predict_step) against published runs (benchmarks/step_model/runs.csv, each with its
source and its own settings): its constants are fitted on every source (fit.py, fit.json), and its agreement is
measured on each source left out of the fit (agree.py, agree.json, the README's table). The goals are the issue's
(held-out FP8 speedup within 8 points, tokens/s within 25%, each run group's recipe order right); every row outside
them is listed in misses.csv with what was measured about it, so a change that fixes or breaks one shows."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

import fp8dist
from fp8dist.runtime.gpus import B200_CALIBRATION
from fp8dist.plan.speed.step_time import STEP_CONSTANTS, compare_step_recipes, fastest, predict_step

_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "step_model"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"step_model_{name}", _DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    sys.path.insert(0, str(_DIR))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(_DIR))
    return module


runs = _load("runs")
agree = _load("agree")
AGREE = json.loads((_DIR / "agree.json").read_text())


def test_the_shipped_constants_are_the_all_source_fit():
    fit = json.loads((_DIR / "fit.json").read_text())["constants"]
    shipped = (STEP_CONSTANTS.gemm_efficiency, STEP_CONSTANTS.memory_traffic, *B200_CALIBRATION.block_cast_slowdown)
    assert tuple(fit[k] for k in runs.THETA) == shipped == runs.SHIPPED == (0.924, 6.16, 1.46, 2.08)


def test_the_readme_table_is_agree_json_and_a_fold_is_the_model_under_its_constants():
    """The README's section is agree.json rendered with misses.csv; the torchtitan #3914 fold's predictions are
    predict_step's under the constants fitted without #3914 (agree.json records them)."""
    readme = (_DIR / "README.md").read_text()
    section = readme[readme.index(agree.BEGIN):readme.index(agree.END) + len(agree.END)]
    assert section == agree.render(AGREE, runs.read_misses())
    fold = AGREE["folds"]["torchtitan_3914"]
    theta = tuple(fold["constants"][k] for k in runs.THETA)
    for row, recorded in zip([r for r in runs.read_runs() if r["source"] == "torchtitan_3914"], fold["rows"]):
        step = runs.predict(row, theta)
        tokens = step.tokens_per_s if row["recipe"] else step.bf16_tokens_per_s
        # agree.py recombines the parts affinely: measured 3e-6 relative off the direct prediction (kernel floors)
        assert tokens == pytest.approx(recorded["predicted_tokens_per_s"], rel=2e-5)


def test_every_held_out_miss_has_its_measured_reason_and_no_reason_is_stale():
    """Held out, 16 of 39 rows meet both goals; the 23 that miss (torchao's H100 rowwise; the power-throttled
    B200's and MI300X's tokens/s; Megatron-Bridge's fused stack; TE's GEMM-level rows) each have a reason, and
    every reason names a row or run group that misses."""
    misses = runs.read_misses()
    missed = {(r["table"], r["recipe"]) for fold in AGREE["folds"].values() for r in fold["rows"]
              if agree.classify(r)}
    missed |= {(o["table"], "order") for o in AGREE["orders"] if not o["right"]}
    assert missed == set(misses)
    rows = [r for fold in AGREE["folds"].values() for r in fold["rows"]]
    assert len(rows) == 39 and sum(not agree.classify(r) for r in rows) == 16


def test_te_gemm_rows_are_predicted_as_te_ran_them_and_split_into_gemm_rate_and_casts():
    """TE's benchmark_gemm.py times a 5B layer's 12 GEMMs, each alone as a quantized te.Linear forward (its input and
    weight cast on every call): the shapes are the tutorial's. Its per-layer times, autocast and pre-quantized
    (te_gemm.py, the README's table), put the model's casts near TE's quantization and its FP8 GEMM rate (2.51x
    bf16) above TE's kernels' (1.90x, 1.92x): the GEMM fractions miss, not the casts."""
    fprop = [(15872, 4096, 12288), (15872, 4096, 4096), (15872, 4096, 16384), (15872, 16384, 4096)]
    dgrad = [(15872, 12288, 4096), (15872, 4096, 4096), (15872, 16384, 4096), (15872, 4096, 16384)]
    wgrad = [(4096, 15872, 12288), (4096, 15872, 4096), (4096, 15872, 16384), (16384, 15872, 4096)]
    assert sorted(runs.te_benchmark_gemms(31 * 512)) == sorted(fprop + dgrad + wgrad)
    te = _load("te_gemm")
    readme = (_DIR / "README.md").read_text()
    assert readme[readme.index(te.BEGIN):readme.index(te.END) + len(te.END)] == te.render()
    rows = {(r["gpu"], r["recipe"]): r for r in te.rows()}
    for key in (("b300", "te_current"), ("h200", "te_current"), ("h200", "te_delayed")):
        row = rows[key]
        assert 0.9 < row["te_casts_ms"] / row["model_casts_ms"] < 1.1  # measured 1.09, 1.02, 0.98
        assert abs(row["model_casts_on_te_gemms"] - row["te"]) < 0.03  # measured +2.8, +0.6, -0.5 points
        assert row["model_gemm_ratio"] > 2.5 and row["te_gemm_ratio"] < 1.93  # 2.51x; TE 1.92x, 1.90x


def test_excluded_rows_are_listed_with_their_reason_and_every_row_has_its_source():
    rows = runs.read_runs()
    assert all(r["url"].startswith("https://") for r in rows)
    excluded = {(r["table"], r["recipe"]): r["excluded"] for r in rows if r["excluded"]}
    assert excluded[("megatron_70b_gb200", "te_nvfp4")] == "tensor and pipeline parallel (TP=2 PP=4): not represented"
    assert len(excluded) == 6 and [e["table"] for e in AGREE["excluded"]] == [t for t, _ in excluded]
    assert AGREE["prediction"].startswith("every predicted figure is the step model's")


def test_blackwell_recipes_in_3914s_order_on_gb200_held_out_and_shipped():
    """torchtitan #3914: Llama3-8B on 4 GB200, local batch 32 x 2,048: bf16 21,919, MXFP8 28,084 (1.281x), NVFP4
    31,758 (1.449x). Fitted without #3914 the order holds (measured -3.4 and +4.4 points); with the shipped
    constants too. Before: NVFP4's casts came from torchao's inference-forward table, predicted 1.06x < MXFP8 1.17x."""
    assert next(o for o in AGREE["orders"] if o["table"] == "torchtitan_3914")["right"]
    steps = compare_step_recipes(runs.meta_model("llama3_8b"), target="gb200", recipes=("mxfp8", "nvfp4"),
                                 world_size=4, micro_batch_size=32, seq_len=2048, compile=True,
                                 activation_checkpointing="selective")
    mx, nv = (s.speedup for s in steps)
    assert steps[0].bf16_tokens_per_s < steps[0].tokens_per_s < steps[1].tokens_per_s
    assert abs(100 * (mx - 28084 / 21919)) <= 8 and abs(100 * (nv - 31758 / 21919)) <= 8  # measured 1.26x, 1.46x
    assert fastest(steps) is steps[1]


def test_a_step_record_has_the_parts_the_issue_asks_for():
    from transformers import LlamaConfig

    step = fp8dist.predict_step(LlamaConfig(**runs.LLAMA3_8B), target="h100-hbm2e", world_size=8,
                                micro_batch_size=1, seq_len=8192, activation_checkpointing="selective")
    assert step.calibrated and step.fp8_layers == 224  # 32 blocks x 7 Linears; the output head stays bf16
    for side in (step.bf16, step.fp8):
        assert min(side.gemm_s, side.attention_s, side.memory_s, side.recompute_s, side.optimizer_s) > 0
        assert 0 < side.exposed_s < side.collective_s  # FSDP's gathers hide behind the compute but one block's
    assert step.fp8.collective_s < step.bf16.collective_s  # tensorwise all-gathers the FP8 weights in FP8
    assert abs(100 * (step.speedup - 7689.5 / 6150)) <= 8  # measured 1.212x against torchao's 1.250x (-3.8 points)
    assert 0.33 < step.bf16_mfu < 0.42  # 39.3% (torchao published 36.0%); torchtitan reports 33-39% on 8 H100
    record = step.to_dict()
    assert record["prediction"] and {"speedup", "tokens_per_s", "bf16_tokens_per_s", "mfu", "bf16", "fp8"} <= set(
        record)


def test_more_ranks_over_the_network_expose_more_communication():
    from transformers import LlamaConfig

    config = LlamaConfig(**runs.LLAMA3_8B)
    one_node, many = (predict_step(config, target="h100", world_size=w, micro_batch_size=1, seq_len=8192)
                      for w in (8, 128))
    assert many.bf16.collective_s > one_node.bf16.collective_s
    assert many.bf16_tokens_per_s <= one_node.bf16_tokens_per_s
    single = predict_step(config, target="h100", world_size=1, micro_batch_size=1, seq_len=8192)
    assert single.bf16.collective_s == 0


def test_compare_names_the_fastest_recipe_and_bad_input_is_refused():
    from transformers import LlamaConfig

    steps = compare_step_recipes(LlamaConfig(**runs.LLAMA3_8B), target="h100-hbm2e", world_size=8,
                                 micro_batch_size=1, seq_len=8192)
    assert [s.recipe for s in steps] == ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
    assert fastest(steps).recipe == "tensorwise"
    with pytest.raises(ValueError, match=r"recipe='fp9': backend 'torchao' runs tensorwise, rowwise"):
        predict_step(LlamaConfig(), target="h100", world_size=8, micro_batch_size=1, seq_len=8, recipe="fp9")
    with pytest.raises(ValueError, match=r"world_size=0: a positive integer"):
        predict_step(LlamaConfig(), target="h100", world_size=0, micro_batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match=r"fp8_layers names \['nope'\], not Linear layers of this model"):
        predict_step(LlamaConfig(), target="h100", world_size=1, micro_batch_size=1, seq_len=8, fp8_layers=["nope"])
    with pytest.raises(ValueError, match=r"predict_step takes a model or a Hugging Face config"):
        predict_step("llama", target="h100", world_size=1, micro_batch_size=1, seq_len=8)


def test_plan_compare_recipes_names_the_fastest_recipe_and_prints_each_step(tmp_path, capsys):
    from fp8dist.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**runs.LLAMA3_8B, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    argv = ["plan", "--model-config", str(path), "--target", "h100-hbm2e", "--world-size", "8", "--seq-len", "8192",
            "--activation-checkpointing", "selective", "--compare-recipes"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1] == (
        "predicted fastest for this run: tensorwise (every Linear but the head in FP8), step 1.21x, 8,165 tokens/s "
        "per GPU against 6,737 in bf16 (8x H100 96GB HBM2e, 1 x 8,192 tokens per rank; a prediction)")
    table = out[out.index("predicted training step on 8x H100 96GB HBM2e"):].splitlines()[3:7]
    # every Linear but the head in FP8, then FP8 where the plan's margin says it pays (rowwise: 64 Linears; with the
    # casts fitted against the 2.4 TB/s record this GPU is, rowwise all-FP8 reads 0.98x, not 0.96x; torchao: 1.10x)
    assert [line.split()[:6] for line in table] == [
        ["bf16", "6,737", "1.00x", "-", "-", "39.4%"], ["tensorwise", "8,165", "1.21x", "8,161", "1.21x", "47.8%"],
        ["rowwise", "6,599", "0.98x", "6,883", "1.02x", "38.6%"],
        ["rowwise_with_gw_hp", "7,743", "1.15x", "7,741", "1.15x", "45.3%"]]
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["fastest"] == {"recipe": "tensorwise", "conversion": "every Linear but the head in FP8"}
    assert [s["every_linear"]["recipe"] for s in record["steps"]] == ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
    assert record["steps"][1]["as_planned"]["fp8_layers"] == 64 and record["steps"][0]["every_linear"]["prediction"]


def test_every_gpu_record_has_its_interconnect_from_its_datasheet():
    from fp8dist.runtime.gpus import GPUS

    for spec in GPUS:
        assert spec.interconnect_gbps and any(word in spec.source.note for word in ("NVLink", "PCIe",
                                                                                    "Infinity Fabric")), spec.key
    tw = {spec.key: spec for spec in GPUS}
    assert (tw["h100-hbm2e"].memory_tbps, tw["h100-hbm2e"].memory_gib) == (2.4, 96.0)  # torchtitan's Grand Teton


def test_estimate_prints_the_predicted_step_per_recipe_beside_the_memory(tmp_path, capsys):
    """``fp8dist estimate --target`` gives the same step figures as ``plan --compare-recipes`` (one source), and
    none without a GPU to predict for."""
    from fp8dist.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**runs.LLAMA3_8B, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    argv = ["--model-config", str(path), "--world-size", "8", "--seq-len", "8192", "--activation-checkpointing",
            "selective"]
    assert main(["plan", *argv, "--target", "h100-hbm2e", "--compare-recipes", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["estimate", *argv, "--target", "h100-hbm2e", "--json"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert estimated["steps"] == planned["steps"] and estimated["fastest"] == planned["fastest"]
    assert estimated["model_state_bytes"], "the memory estimate is still there"
    assert main(["estimate", *argv, "--target", "h100-hbm2e"]) == 0
    assert "predicted fastest for this run: tensorwise" in capsys.readouterr().out
    assert main(["estimate", *argv, "--json"]) == 0
    assert "steps" not in json.loads(capsys.readouterr().out), "no GPU given: no step predicted"


def test_te_predicts_with_its_own_defaults_and_a_refused_compile_names_the_way_out():
    """fp8='te' used to fail on predict_step's own compile=True and recipe='tensorwise' defaults: now compile is
    auto (off where the table refuses it, as wrap_model decides) and the recipe the backend's default config runs."""
    from transformers import LlamaConfig

    config = LlamaConfig(**runs.LLAMA3_8B)
    step = predict_step(config, target="h100", world_size=8, micro_batch_size=1, seq_len=8192, fp8="te")
    assert (step.recipe, step.compile) == ("te_delayed", False)
    assert step == predict_step(config, target="h100", world_size=8, micro_batch_size=1, seq_len=8192, fp8="te",
                                recipe="te_delayed", compile=False)
    torchao = predict_step(config, target="h100", world_size=8, micro_batch_size=1, seq_len=8192)
    assert (torchao.recipe, torchao.compile) == ("tensorwise", True)  # the defaults as before
    with pytest.raises(ValueError, match=r"compile=True with fp8='te': .* Use compile=False \(or None: auto "):
        predict_step(config, target="h100", world_size=8, micro_batch_size=1, seq_len=8192, fp8="te", compile=True)
    assert [s.recipe for s in compare_step_recipes(config, target="h100", fp8="te", world_size=8, micro_batch_size=1,
                                                   seq_len=8192)][:2] == ["te_delayed", "te_current"]


@pytest.mark.parametrize("fp8", [None, "none", "msamp"])
def test_a_backend_without_a_speed_model_names_those_with_one(fp8):
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=re.escape(f"fp8={fp8!r} has no speed model: predict_step compares bf16 "
                                                   "with the FP8 step of 'te' or 'torchao'; pass one of those.")):
        predict_step(LlamaConfig(), target="h100", world_size=8, micro_batch_size=1, seq_len=8, fp8=fp8)
    with pytest.raises(ValueError, match=r"fp8='fp9' is not valid; choose one of: .*'te', 'torchao'"):
        predict_step(LlamaConfig(), target="h100", world_size=8, micro_batch_size=1, seq_len=8, fp8="fp9")
    assert predict_step(LlamaConfig(), target="h100", world_size=8, micro_batch_size=1, seq_len=8,
                        fp8="TE").recipe == "te_delayed"


def test_a_config_transformers_builds_no_causal_lm_from_names_it_and_the_way_out():
    from transformers import T5Config

    with pytest.raises(ValueError) as caught:
        predict_step(T5Config(), target="h100", world_size=8, micro_batch_size=1, seq_len=8)
    assert str(caught.value) == (
        "predict_step builds a causal language model (AutoModelForCausalLM) from a config, and T5Config "
        "(model_type='t5') is not one transformers builds that way (a causal LM config is, e.g. LlamaConfig, "
        "Qwen2Config, MistralConfig). Build the model on the meta device yourself and pass the nn.Module: "
        "with torch.device('meta'): model = YourModel(config).")


LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256)  # Meta's config.json of Llama-3-70B


@pytest.fixture(scope="module")
def llama_70b():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA3_70B))


def test_every_gpu_record_has_its_topology():
    """The NVLink domain and the network between domains are data of the GPU record, with their source."""
    from fp8dist.runtime.gpus import GPUS, gpu_by_key

    assert {spec.key for spec in GPUS if spec.nvlink_domain == 72} == {"gb200", "gb300"}  # NVL72 racks
    assert {gpu_by_key(k).nvlink_domain for k in ("h100", "h200", "b200", "b300")} == {8}
    for spec in GPUS:
        assert spec.network_gbps > 0 and "Gb/s" in spec.network_source and "GB/s" in spec.network_source
    assert (gpu_by_key("h100").network_gbps, gpu_by_key("gb300").network_gbps) == (50.0, 100.0)  # 400 / 800 Gb/s
    assert gpu_by_key("gb300").describe().endswith(
        "NVLink domain 72 GPUs, network 100 GB/s per GPU between domains (NVIDIA GB300 NVL72 Enterprise RA (https://"
        "docs.nvidia.com/enterprise-reference-architectures/nvl72-ai-factory/latest/components.html): 4 ConnectX-8 "
        "HCAs per 4-GPU compute tray, one 800 Gb/s per GPU between racks: 100 GB/s; the 72 GPUs share one NVLink 5 "
        "domain (130 TB/s))")
    for key in ("gb200", "b300", "gb300"):  # the Blackwell NICs, each with the published page read
        assert "https://docs.nvidia.com/" in gpu_by_key(key).network_source or "https://www.nvidia.com/" in (
            gpu_by_key(key).network_source)


def test_70b_on_64_gb300_keeps_its_collectives_on_nvlink_and_meets_megatron_bridge(llama_70b):
    """64 GB300s sit in one NVL72 NVLink domain: no collective crosses the network, so a network of 1 GB/s changes
    nothing; taken as 8-GPU nodes over 400 Gb/s NICs (the model's hard-coded topology before), FP8 gained nothing.
    Megatron-Bridge's performance summary: Llama3-70B on 64 GB300, FP8-CS, 5,248 tokens/s per GPU (its TP/PP and
    batch are not represented: FSDP, 1 x 8,192 per rank, no checkpointing, as TE runs here)."""
    options = dict(target="gb300", world_size=64, micro_batch_size=1, seq_len=8192, fp8="te", recipe="te_current",
                   activation_checkpointing="none")
    step = predict_step(llama_70b, **options)
    assert (step.nvlink_domain, step.network_gbps) == (72, 100.0) and "gb300 record" in step.topology_source
    slow_network = predict_step(llama_70b, **options, network_gbps=1)
    assert slow_network.fp8.collective_s == step.fp8.collective_s and slow_network.fp8.step_s == step.fp8.step_s
    nodes = predict_step(llama_70b, **options, nvlink_domain=8, network_gbps=50)
    assert "given: nvlink_domain=8, network_gbps=50" in nodes.topology_source
    assert nodes.fp8.collective_s > 10 * step.fp8.collective_s
    assert round(nodes.tokens_per_s) == 582 and nodes.speedup == pytest.approx(1.0, abs=0.01)  # the issue's figure
    assert abs(step.tokens_per_s / 5248 - 1) <= 0.25  # measured 4,338: -17.3% (held out, at its 2 x 8,192: -17.4%)
    assert step.speedup > 1.4  # measured 1.43x (bf16 3,032)
    assert "NVLink domain 72 GPUs, network 100 GB/s per GPU between domains" in step.describe()
    assert "batch 1 x 8,192 tokens per rank, activation checkpointing none, eager" in step.setting  # TE: no compile
    record = step.to_dict()
    assert (record["nvlink_domain"], record["network_gbps"]) == (72, 100.0) and record["prediction"]


@pytest.mark.parametrize("keyword,value,words", [
    ("nvlink_domain", 0, "nvlink_domain=0: a positive integer, the GPUs one NVLink domain joins"),
    ("nvlink_domain", 8.0, "nvlink_domain=8.0: a positive integer"),
    ("network_gbps", -1, "network_gbps=-1: a positive number, GB/s per GPU between NVLink domains"),
    ("network_gbps", "fast", "network_gbps='fast': a positive number")])
def test_a_bad_topology_is_refused_by_name(keyword, value, words):
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=re.escape(words)):
        predict_step(LlamaConfig(), target="h100", world_size=8, micro_batch_size=1, seq_len=8, **{keyword: value})


def test_a_lora_step_has_no_weight_gradients_optimizer_or_gradient_collective_for_the_frozen_base(llama_70b):
    """torchtune #2833: Llama3.1-70B LoRA on 8 GPUs, FP8 (torchao tensorwise) on the frozen base Linears, bf16
    1,080.7 -> 1,409.8 tokens/s per GPU (1.305x). Its run's batch and sequence are not in the issue: taken here as
    1 x 8,192 tokens per rank, full activation checkpointing, compiled, FSDP2, 8 H100 SXM, LoRA rank 16 on all
    seven projections (torchtune's 70B LoRA config). Predicted as a full fine-tune, the step reads 1.50x."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        lora = get_peft_model(AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA3_70B)), LoraConfig(
            r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"]))
    options = dict(target="h100", world_size=8, micro_batch_size=1, seq_len=8192, activation_checkpointing="full")
    step, full = predict_step(lora, **options), predict_step(llama_70b, **options)
    assert step.fp8_layers == 80 * 7 and step.params > 70e9 and step.trainable_params < 0.01 * step.params
    assert "base frozen (" in step.setting and "parameters trainable)" in step.setting
    assert step.bf16.optimizer_s < full.bf16.optimizer_s / 100  # the adapters' AdamW only
    assert step.bf16.collective_s < full.bf16.collective_s  # no reduce-scatter of the base's gradients
    assert step.bf16.gemm_s < 0.75 * full.bf16.gemm_s  # no grad_weight GEMM for the base (2 of its 3 GEMMs)
    published = 1409.8 / 1080.7  # 1.305x
    # measured 1.296x: -0.9 points (held out of the fit: 1.286x, -1.8; as a full fine-tune: 1.50x)
    assert abs(100 * (step.speedup - published)) <= 8
    assert abs(step.bf16_tokens_per_s / 1080.7 - 1) <= 0.03  # measured 1,079: -0.2% (held out: +0.5%)
    assert abs(step.tokens_per_s / 1409.8 - 1) <= 0.03  # measured 1,398: -0.9% (held out: -0.9%)


def test_hsdp_gathers_inside_each_shard_group_and_all_reduces_the_gradient_shards_across_replicas(capsys):
    """Llama3-8B on 128 H100 (16 nodes of 8): HSDP with 16 replicas gathers the weights twice and reduce-scatters the
    fp32 gradients inside each node at NVLink (450 GB/s a direction x 0.8), then all-reduces each rank's eighth of the
    gradients across the 16 nodes over the network (50 GB/s x 0.8); plain FSDP runs every ring over the network."""
    model = runs.meta_model("llama3_8b")
    options = dict(target="h100", world_size=128, micro_batch_size=2, seq_len=8192, recipe="rowwise")
    hsdp, flat = (predict_step(model, **options, replicate_degree=r) for r in (16, 1))
    params = sum(p.numel() for p in model.parameters())
    inside = (2 * 2 * params + 4 * params) * 7 / 8 / (450e9 * 0.8)
    across = 2 * 4 * params / 8 * 15 / 16 / (50e9 * 0.8)
    assert hsdp.bf16.collective_s == pytest.approx(inside + across, rel=1e-9)  # measured 0.31 s (flat FSDP: 1.25 s)
    assert flat.bf16.collective_s == pytest.approx((2 * 2 * params + 4 * params) * 127 / 128 / (50e9 * 0.8), rel=1e-9)
    assert hsdp.replicate_degree == 16 and "HSDP 16 replicas x 8 ranks" in hsdp.setting
    with pytest.raises(ValueError, match=re.escape("replicate_degree=2 with strategy 'ddp': only strategy='fsdp' "
                                                   "(FSDP2) runs HSDP; pass replicate_degree=1 or strategy='fsdp'.")):
        predict_step(model, **options, replicate_degree=2, strategy="ddp")
    with pytest.raises(ValueError, match=r"replicate_degree=3 does not split world size 128 into equal shard groups"):
        predict_step(model, **options, replicate_degree=3)
    from fp8dist.cli import main

    argv = ["plan", "--model-size", "1b", "--target", "h100", "--world-size", "16", "--compare-recipes"]
    assert main([*argv, "--replicate-degree", "2"]) == 0  # plan's step table predicts the HSDP run it plans
    assert "HSDP 2 replicas x 8 ranks" in capsys.readouterr().out
