"""Planning for a machine one is not on (``fp8dist plan --target``, ``plan_precision(device=Hardware)``): every
FP8 decision that depends on the GPU — the backend's hardware gate, torchao's MoE grouped-GEMM recipe, compile's
default — comes out as that machine's. The expected decisions are written here from the published capability
rules (FP8 tensor cores sm_89+, FP8 rowwise grouped GEMM sm_90+, MXFP8 sm_100+), not read from the library."""

from __future__ import annotations

import json

import pytest
import torch

import fp8dist
from fp8dist.cli import main
from fp8dist.runtime.hardware import TARGETS, Hardware, hardware_of, parse_target
from fp8dist.plan.precision import FP8UnavailableError
from fp8dist.train.models import build_llama

pytest.importorskip("torchao", reason="torchao is not installed")

MIXTRAL = {"model_type": "mixtral", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2, "tie_word_embeddings": False}


def _mixtral():
    from transformers import AutoConfig, MixtralForCausalLM

    with torch.device("meta"):
        return MixtralForCausalLM(AutoConfig.for_model(**MIXTRAL))


@pytest.mark.parametrize("text,expected", [
    ("h100", ("cuda", (9, 0), "H100")), ("H200", ("cuda", (9, 0), "H200")), ("b200", ("cuda", (10, 0), "B200")),
    ("sm_89", ("cuda", (8, 9), "sm_89")), ("sm90", ("cuda", (9, 0), "sm_90")), ("SM_100", ("cuda", (10, 0), "sm_100")),
    ("sm_120", ("cuda", (12, 0), "sm_120")), ("cpu", ("cpu", None, "")), (" a100 ", ("cuda", (8, 0), "A100")),
])
def test_a_target_names_a_gpu_a_capability_or_cpu(text, expected):
    hardware = parse_target(text)
    assert (hardware.type, hardware.capability, hardware.name) == expected


@pytest.mark.parametrize("text", ["v100", "sm_9", "sm_", "", "cuda", "sm_1000"])
def test_an_unknown_target_is_an_error_naming_the_choices(text):
    with pytest.raises(ValueError, match=rf"target '{text}' is not a known machine: name a GPU \(a100, .*h100.*\), "
                                         r"a CUDA compute capability \(sm_89, sm_90, sm_100\) or cpu"):
        parse_target(text)


def test_the_local_device_reads_as_hardware():
    assert hardware_of(torch.device("cpu")) == Hardware("cpu")
    assert hardware_of(TARGETS["h100"]) is TARGETS["h100"]
    assert str(TARGETS["h100"]) == "H100 (sm_90)" and str(parse_target("sm_90")) == "sm_90"


def _expected_experts(capability):
    """torchao's MoE recipe under torchao_moe_recipe='auto' on ``capability``: (converted to, reason prefix)."""
    if capability is None:
        return None, "no FP8 grouped GEMM on cpu"
    if capability >= (10, 0):
        return "torchao MoE: MXFP8 grouped GEMM", "converted by torchao"
    if capability >= (9, 0):
        return "torchao MoE: FP8 rowwise grouped GEMM", "converted by torchao"
    return None, "torchao_moe_recipe='fp8_rowwise' needs sm_90+, not "


@pytest.mark.parametrize("name", list(TARGETS))
def test_a_mixtral_planned_for_each_target_gets_that_machines_decisions(name):
    target = TARGETS[name]
    # eligibility, not speed: every eligible layer converts (tiny widths are predicted slower in FP8 on every GPU)
    cfg = fp8dist.resolve_config(strategy="fsdp", fp8="torchao", fp8_select="all")
    if target.type == "cuda" and target.capability < (8, 9):
        with pytest.raises(FP8UnavailableError, match=rf"fp8='torchao' cannot run on the target: {target.name} "
                                                      rf"\(sm_{target.capability[0]}{target.capability[1]}\) has no "
                                                      "FP8 tensor cores: FP8 needs sm_89\\+"):
            fp8dist.plan_precision(_mixtral(), cfg, device=target, check_installed=False)
        return
    plan = fp8dist.plan_precision(_mixtral(), cfg, device=target, check_installed=False)
    assert plan.hardware == target and plan.unavailable is None
    converted_to, reason = _expected_experts(target.capability)
    for layer in (0, 1):
        entry = plan.by_name(f"model.layers.{layer}.mlp.experts")
        assert (entry.converted_to, entry.precision) == (converted_to, "fp8" if converted_to else "bf16")
        assert entry.reason.startswith(reason), entry.reason
        assert plan.by_name(f"model.layers.{layer}.self_attn.o_proj").converted_to == "Float8Linear"
    # compile's default: on for FP8 on CUDA, off on CPU
    assert plan.compile == (target.type == "cuda")


@pytest.mark.parametrize("name,recipe,runs", [("h100", "delayed", True), ("l40s", "current", True),
                                              ("h100", "mxfp8", False), ("b200", "mxfp8", True),
                                              ("a100", "delayed", False)])
def test_transformer_engine_planned_for_a_gpu_without_it_installed_here(name, recipe, runs):
    """TE is not installed on this machine: planning for a target assumes it is (the login-node case), the
    hardware gate still applies; planning for here says it is missing."""
    target = TARGETS[name]
    cfg = fp8dist.resolve_config(strategy="fsdp", fp8="te", te_recipe=recipe, fp8_select="all")  # eligibility only
    model = build_llama("tiny")
    with pytest.raises(FP8UnavailableError, match="cannot run here: Transformer Engine is not installed"):
        fp8dist.plan_precision(model, cfg, device=target)
    if not runs:
        need = "sm_100+" if recipe == "mxfp8" else "sm_89+"
        with pytest.raises(FP8UnavailableError, match=rf"cannot run on the target: .*{need}"):
            fp8dist.plan_precision(model, cfg, device=target, check_installed=False)
        return
    plan = fp8dist.plan_precision(model, cfg, device=target, check_installed=False)
    linears = [e for e in plan if e.module_type == "Linear"]
    assert linears and all(e.converted_to == "te.Linear" for e in linears)


def test_fp8dist_plan_target_prints_the_plan_for_that_machine(tmp_path, capsys):
    config = tmp_path / "mixtral.json"
    config.write_text(json.dumps(MIXTRAL))
    for target, experts in (("h100", "FP8 rowwise grouped GEMM"), ("b200", "MXFP8 grouped GEMM")):
        assert main(["plan", "--model-config", str(config), "--fp8", "torchao", "--target", target,
                     "--fp8-select", "all"]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"planned for {TARGETS[target]} (--target; its FP8 library assumed installed)\n")
        rows = [line for line in out.splitlines() if ".mlp.experts " in line]
        assert len(rows) == MIXTRAL["num_hidden_layers"] and all(f"torchao MoE: {experts}" in r for r in rows)
    assert main(["plan", "--model-config", str(config), "--fp8", "torchao"]) == 0  # here: a CPU
    rows = [line for line in capsys.readouterr().out.splitlines() if ".mlp.experts " in line]
    assert len(rows) == 2 and all("no FP8 grouped GEMM on cpu" in r for r in rows)
