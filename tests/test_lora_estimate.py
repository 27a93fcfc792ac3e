"""The memory estimate of a LoRA run (a PEFT model: a frozen bf16 base, fp32 adapters) against fp8dist.report on
real gloo ranks, to the byte, for every strategy that trains frozen parameters beside trained ones; and its
frozen / trained split, by hand and against a full fine-tune of the same model."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from dist_harness import run_ranks
from transformers import LlamaConfig, LlamaForCausalLM

from fp8dist import estimate_memory
from helpers import deepspeed_report

pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

# h=32, i=96, 2 layers, 2 heads of 16, 1 kv head; 41 rows of vocabulary so embed/lm_head shard unevenly
DIMS = dict(vocab_size=41, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=False, max_position_embeddings=64)
# r=8 on q (32 -> 32) and v (32 -> 16): lora_A 8x32 twice, lora_B 32x8 and 16x8, per layer
ADAPTERS = 2 * (8 * 32 + 32 * 8 + 8 * 32 + 16 * 8)
STEP = 4  # torch AdamW's fp32 step tensor, one per trained parameter


def _lora_llama(*, meta: bool = True, dtype: torch.dtype = torch.bfloat16, dora: bool = False) -> torch.nn.Module:
    """A bf16 Llama base under PEFT LoRA (DoRA: ``dora``): PEFT keeps the adapters in fp32 (autocast_adapter_dtype),
    the base frozen."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**DIMS)).to(dtype)
        return get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], use_dora=dora))


def _measure_lora(rank: int, world: int, cases: list[dict]) -> list[tuple[dict, dict]]:
    """Each case: one optimizer step over the adapters on a fresh copy, then report vs estimate on this rank."""
    import fp8dist

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    ids = torch.randint(0, 41, (2, 16), generator=torch.Generator().manual_seed(rank))
    out = []
    for kw in cases:
        kw = dict(kw)
        dtype, dora = kw.pop("base", torch.bfloat16), kw.pop("dora", False)
        base = _lora_llama(meta=False, dtype=dtype, dora=dora)
        if kw["strategy"] == "deepspeed":
            measured = deepspeed_report(base, ids, **kw)
        else:
            builds = kw.get("memory") == "lean"  # the lean level builds its optimizer from a spec
            wrapped = fp8dist.wrap_model(base, optimizer={"type": "AdamW", "lr": 1e-3} if builds else None, **kw)
            model, optimizer = wrapped if builds else (wrapped, None)
            optimizer = optimizer or torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            measured = fp8dist.report(model, optimizer)
        estimated = estimate_memory(_lora_llama(dtype=dtype, dora=dora), world_size=world, rank=rank,
                                    micro_batch_size=2, **kw)
        assert measured.frozen_params == estimated.groups[0].params == 27_360, kw  # all but the adapters
        assert measured.dtypes["fp8_buffers"] == estimated.dtypes["fp8_buffers"], kw  # kept FP8 copies named alike
        fp8 = [(r.modules, r.params) for r in measured.rows if r.part.value == "fp8_gemm"]
        groups = (measured.groups, estimated.groups, measured.groups_unmeasured, str(measured))
        out.append((dict(measured.bytes), dict(estimated.bytes), groups, *fp8))
    return out


def _check(cases: list[dict], timeout: float) -> None:
    for rank, results in enumerate(run_ranks(_measure_lora, cases, timeout=timeout)):
        for kw, (measured, estimated, groups, *_) in zip(cases, results):
            assert estimated == measured, f"rank {rank} {kw}: measured {measured} estimated {estimated}"
            _check_groups(kw, *groups)
            if kw["strategy"] != "fsdp1":  # FSDP1's flat gradient spans a unit's frozen pieces
                # only the adapters have gradients: a frozen base's would be 16 times these
                assert 0 < measured["gradients"] <= 4 * ADAPTERS, (rank, kw, measured)


def _check_groups(kw: dict, measured: tuple, estimated: tuple, unmeasured: str, text: str) -> None:
    """The report's frozen / trained groups are the estimate's, to the byte, where the strategy can tell the frozen
    parameters' storage apart; where it cannot (FSDP1's flat parameters), the report says so, once, and shows none."""
    if kw["strategy"] == "fsdp1":
        assert measured == () and "not measured under strategy 'fsdp1'" in unmeasured, (kw, measured, unmeasured)
        assert text.count(unmeasured) == 1 and "parameters (this rank)" not in text, text
        return
    assert "parameters (this rank)" in text, text
    assert not unmeasured and [g.label for g in measured] == ["frozen", "trained"], (kw, measured, unmeasured)
    assert [(g.params, g.bytes) for g in measured] == [(g.params, g.bytes) for g in estimated], (kw, measured,
                                                                                                  estimated)
    if kw.get("memory") != "lean":  # lean's 8-bit states are named by format in the estimate, by dtype measured
        assert [g.holds for g in measured] == [g.holds for g in estimated], (kw, measured, estimated)


@pytest.mark.slow
def test_lora_estimate_matches_the_report_fsdp2_hsdp_ddp_lean():
    """FSDP2 (alone, with torchao tensorwise and rowwise, as HSDP), DDP, and the lean level on both: the frozen base
    keeps its bf16 weights and nothing else, the fp32 adapters their gradients and AdamW states."""
    cases = [dict(strategy="fsdp"), dict(strategy="fsdp", fp8="torchao"),
             dict(strategy="fsdp", fp8="torchao", torchao_recipe="rowwise"),
             dict(strategy="fsdp", fp8="torchao", torchao_recipe="auto"),  # each layer's own recipe decides
             dict(strategy="fsdp", replicate_degree=2), dict(strategy="ddp"),
             dict(strategy="fsdp", memory="lean"), dict(strategy="ddp", memory="lean")]
    _check(cases, timeout=300)


@pytest.mark.slow
def test_lora_estimate_matches_the_report_fsdp1_and_deepspeed_zero_1_2_3():
    """FSDP1 (its flat units take one dtype: an fp32 base; a unit's one flat gradient spans its frozen pieces too)
    and DeepSpeed ZeRO-1/2 (frozen parameters stay whole outside the flat group) and ZeRO-3 (partitioned, with
    masters and states for the adapters alone)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'fp8dist[deepspeed]')")
    cases = [dict(strategy="fsdp1", base=torch.float32), dict(strategy="fsdp1", fp8="torchao", base=torch.float32),
             dict(strategy="deepspeed", zero_stage=1), dict(strategy="deepspeed", zero_stage=2),
             dict(strategy="deepspeed", zero_stage=3, fp8="torchao")]
    _check(cases, timeout=400)


def test_lora_estimate_matches_the_report_single_process():
    """One process, torchao tensorwise: where the backend keeps a frozen weight's FP8 cast (fp8/frozen.py), that copy
    is counted by both, 1 byte per element and an fp32 scale per weight, in place of the scale precompute's."""
    cases = [dict(strategy="none", fp8="torchao")]
    for kw, (measured, estimated, groups, (modules, fp8_params)) in zip(cases, _measure_lora(0, 1, cases)):
        assert estimated == measured, f"{kw}: measured {measured} estimated {estimated}"
        _check_groups(kw, *groups)
        assert measured["fp8_buffers"] == fp8_params + 4 * modules, (modules, fp8_params)


def _padded(model: torch.nn.Module, trains: bool, world: int) -> int:
    """Elements FSDP2 stores per rank for the parameters that train (or not): dim 0 padded to ceil(dim0 / world)."""
    return sum(-(-p.shape[0] // world) * math.prod(p.shape[1:]) for p in model.parameters()
               if p.requires_grad is trains)


def test_frozen_and_trained_groups_by_hand_fsdp2():
    model = _lora_llama()
    est = estimate_memory(model, strategy="fsdp", fp8="torchao", world_size=2, rank=0)
    frozen, trained = est.groups
    assert (frozen.label, frozen.params, trained.label, trained.params) == \
        ("frozen", sum(p.numel() for p in model.parameters()) - ADAPTERS, "trained", ADAPTERS)
    # the base: its bf16 shard and nothing else (1.002 B/param: 41-row embed and lm_head padded to 21 rows a rank)
    assert frozen.bytes == 2 * _padded(model, False, 2) and frozen.holds == "bf16 weight"
    # the adapters: fp32 shard, fp32 gradient, two fp32 AdamW states on rank 0's rows (all even: no padding), a step
    assert trained.bytes == (4 + 4 + 8) * _padded(model, True, 2) + 8 * STEP
    assert trained.holds == "fp32 weight, fp32 grad, fp32 optimizer states"
    assert frozen.bytes + trained.bytes + est.bytes["fp8_buffers"] == est.model_state_bytes
    text = str(est)
    assert "frozen                  27,360  1.002" in text and "trained                 1,792   8.018" in text
    # a model where everything trains shows no such table
    assert estimate_memory(_llama_full(), strategy="fsdp", world_size=2).groups == ()


def _llama_full() -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**DIMS))


@pytest.mark.parametrize("kw", [dict(strategy="fsdp", fp8="torchao"), dict(strategy="ddp"),
                                dict(strategy="deepspeed", zero_stage=3)], ids=["fsdp", "ddp", "zero3"])
def test_lora_costs_a_fraction_of_a_full_fine_tune(kw):
    """The same model trained whole (fp32 weights) against its LoRA run: model states a fraction, computed by both
    estimates."""
    lora = estimate_memory(_lora_llama(), world_size=2, **kw)
    full = estimate_memory(_llama_full(), world_size=2, **kw)
    frozen, trained = lora.groups
    assert lora.bytes["gradients"] <= 4 * ADAPTERS and lora.bytes["optimizer_states"] <= 8 * ADAPTERS + 8 * STEP
    # measured ratios: fsdp 0.19, ddp 0.19, ZeRO-3 0.21 (a frozen base keeps no gradient, master nor states)
    assert lora.model_state_bytes < 0.25 * full.model_state_bytes, (lora.model_state_bytes, full.model_state_bytes)
    # the base keeps only its weights: 2 bytes per element, whole (ddp) or in a half share (FSDP2, ZeRO-3)
    assert frozen.bytes / frozen.params <= 2.0 and "grad" not in frozen.holds


def test_unfreezing_restores_full_fine_tune_bytes():
    """A PEFT model with every parameter unfrozen is estimated as a full fine-tune of its parameters."""
    model = copy.deepcopy(_lora_llama()).requires_grad_(True)
    est = estimate_memory(model, strategy="ddp", world_size=2)
    assert est.groups == ()
    assert est.bytes["gradients"] == est.bytes["parameters"]  # every parameter has its gradient


def test_cli_estimates_a_lora_run_as_the_api_does(capsys):
    """``fp8dist estimate --lora-rank 8 --model-dtype bf16``: the built-in model's base in bf16 under PEFT adapters
    on q_proj,v_proj, the same figures as estimate_memory on that PEFT model."""
    import json

    from peft import LoraConfig, get_peft_model

    from fp8dist import cli
    from fp8dist.train.models import build_llama

    argv = ["estimate", "--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--model-dtype", "bf16",
            "--world-size", "2", "--fp8", "torchao"]
    assert cli.main([*argv, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        model = get_peft_model(build_llama("tiny").to(torch.bfloat16), LoraConfig(r=8, target_modules=["q_proj",
                                                                                                         "v_proj"]))
    est = estimate_memory(model, strategy="fsdp", fp8="torchao", world_size=2)
    assert printed["bytes"] == dict(est.bytes) and [g["label"] for g in printed["groups"]] == ["frozen", "trained"]
    assert printed["groups"][0]["holds"] == "bf16 weight"
    assert cli.main(argv) == 0
    assert "parameters (this rank)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--lora-rank", "-1"], "lora_rank=-1 must be 0 (off) or more"),
    (["--lora-targets", "q_proj"], "with lora_rank=0 (LoRA off) has no effect: pass --lora-rank R"),
    (["--lora-rank", "8", "--lora-targets", "qproj"], "choose among its names: down_proj, embed_tokens, gate_proj"),
])
def test_cli_bad_lora_flags_are_clear_errors(argv, message, capsys):
    from fp8dist import cli

    assert cli.main(["estimate", *argv]) == 2
    assert message in capsys.readouterr().err
