"""LoRA inputs follow one rule in ``fp8dist train`` and in ``wrap_model`` on a PEFT model
(fp8dist/plan/adapter_rules.py): a rank past what a target's weight can use (the smaller of its dims) is refused
before PEFT allocates an adapter, naming the value, the largest allowed and the way out (past int64 too: no torch
overflow); an empty target name is refused, not read as PEFT's defaults; an Embedding takes an adapter in both, and
it trains under FSDP2 + torchao equal to PEFT wired by hand, on 2 real gloo ranks; an alpha whose gradient norm
overflows skips every step, said and counted."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from dist_harness import run_ranks
from helpers import hand_wired_fsdp2, optimizer_losses

from fp8dist.cli import main
from fp8dist.train.config import TrainConfig
from fp8dist.train.models import build_llama

pytest.importorskip("peft", reason="LoRA needs peft (pip install peft)")

# the tiny Llama: q_proj 128x128, k_proj / v_proj 64x128 (out x in), so an adapter on v_proj has rank <= 64
V_PROJ_LIMIT = 64


@pytest.mark.parametrize("rank", [100_000, 2**70])
def test_a_rank_past_the_targets_weight_is_refused_before_peft_allocates(rank):
    from fp8dist.train.lora import apply_lora

    with pytest.raises(ValueError) as err:
        apply_lora(build_llama("tiny"), TrainConfig(lora_rank=rank, lora_targets=("q_proj", "v_proj")))
    assert str(err.value) == (
        f"lora_rank={rank}: rank {rank:,} is larger than model.layers.0.self_attn.v_proj's weight (64x128) can use: "
        f"an adapter's update B @ A has rank at most 64, the smaller of its dims, so the {rank - 64:,} ranks above "
        f"it would add {(rank - 64) * 192:,} parameters there and nothing they can learn. The largest rank allowed "
        "is 64 (the smallest over --lora-targets q_proj,v_proj of LlamaForCausalLM). Pass --lora-rank 64 or less "
        "(8-64 is usual), or leave v_proj out of --lora-targets.")


def test_the_largest_rank_allowed_is_accepted_and_builds_full_rank_adapters():
    from fp8dist.train.lora import apply_lora

    model = apply_lora(build_llama("tiny"), TrainConfig(lora_rank=V_PROJ_LIMIT))  # PEFT's Llama default: q, v
    a = model.base_model.model.model.layers[0].self_attn.v_proj.lora_A.default.weight
    assert a.shape == (V_PROJ_LIMIT, 128)


def test_wrap_model_refuses_the_same_rank_on_a_peft_model_built_by_hand():
    from peft import LoraConfig, get_peft_model

    from fp8dist import wrap_model

    model = get_peft_model(build_llama("tiny", seed=0), LoraConfig(r=65, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError) as err:
        wrap_model(model, strategy="none")
    assert str(err.value) == (
        "wrap_model: PEFT adapter 'default': rank 65 is larger than base_model.model.model.layers.0.self_attn.v_proj's "
        "weight (64x128) can use: an adapter's update B @ A has rank at most 64, the smaller of its dims, so the 1 "
        "rank above it would add 192 parameters there and nothing they can learn. The largest rank allowed is 64. "
        "Build the PEFT model with LoraConfig(r=64) or less (or rank_pattern={'v_proj': ...} for this layer).")


def test_wrap_model_refuses_an_adapter_on_a_layer_kind_the_command_line_refuses_too():
    from peft import LoraConfig, get_peft_model
    from torch import nn

    from fp8dist import wrap_model

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.proj = nn.Conv2d(4, 4, 1), nn.Linear(16, 16)

    model = get_peft_model(Net(), LoraConfig(r=2, target_modules=["conv", "proj"]))
    with pytest.raises(ValueError) as err:
        wrap_model(model, strategy="none")
    assert str(err.value) == ("wrap_model: base_model.model.conv holds a PEFT adapter on a Conv2d; fp8dist trains "
                              "adapters on Linear, Conv1D or Embedding layers only. Leave 'conv' out of the "
                              "LoraConfig's target_modules.")


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "100000"], "fp8dist train: error: lora_rank=100000: rank 100,000 is larger than "
                                "model.layers.0.self_attn.v_proj's weight (64x128) can use"),
    (["--lora-rank", "99999999999999999999"], "The largest rank allowed is 64 (the smallest over PEFT's default "
                                              "targets q_proj,v_proj of LlamaForCausalLM). Pass --lora-rank 64 or "
                                              "less (8-64 is usual), or name --lora-targets without v_proj."),
    (["--lora-rank", "8", "--lora-targets", ""], "fp8dist train: error: lora_targets='' holds an empty name: pass "
                                                 "--lora-targets NAME,... (layer names, e.g. q_proj,v_proj), or "
                                                 "leave it out for PEFT's default of the model's family."),
    (["--lora-rank", "8", "--lora-targets", "q_proj,"], "lora_targets='q_proj,' holds an empty name"),
])
def test_bad_lora_rank_and_targets_on_the_command_line_are_one_line(argv, message, capfd):
    assert main(["train", "--nproc", "1", "--steps", "1", *argv]) == 2
    err = capfd.readouterr().err
    assert message in err and "Traceback" not in err and "overflow" not in err.lower(), err


def test_an_embedding_takes_an_adapter_from_the_command_line_as_from_peft():
    from fp8dist.train.lora import apply_lora

    model = apply_lora(build_llama("tiny"), TrainConfig(lora_rank=8, lora_targets=("embed_tokens", "q_proj")))
    trainable = {n.split(".default")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"lora_embedding_A", "lora_embedding_B", "lora_A", "lora_B"}
    with pytest.raises(ValueError, match=r"'input_layernorm' names no Linear, Conv1D or Embedding layer of "
                                         r"LlamaForCausalLM; choose among its names: down_proj, embed_tokens, "):
        apply_lora(build_llama("tiny"), TrainConfig(lora_rank=8, lora_targets=("input_layernorm",)))


def _embedding_case(rank: int, world: int) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp as precompute

    from fp8dist import get_plan, wrap_model
    from fp8dist.train.lora import apply_lora

    base = apply_lora(build_llama("tiny", seed=0), TrainConfig(lora_rank=8, lora_targets=("embed_tokens", "q_proj")))
    ours, opt = wrap_model(copy.deepcopy(base), strategy="fsdp", fp8="torchao", optimizer={"type": "AdamW", "lr": 1e-2})
    fp8_names = {e.name for e in get_plan(ours).fp8}
    ref = copy.deepcopy(base)  # by hand: torchao on the plan's layers, fully_shard per block and root
    convert_to_float8_training(ref, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda module, fqn: fqn in fp8_names)
    hand_wired_fsdp2(ref, world, layers=ref.base_model.model.model.layers)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    embedding_b = ours.base_model.model.model.embed_tokens.lora_embedding_B.default
    before = embedding_b.full_tensor().clone()
    return dict(ours=optimizer_losses(ours, opt, rank, world, 3, seq_len=32),
                ref=optimizer_losses(ref, ref_opt, rank, world, 3, seq_len=32, after_step=lambda: precompute(ref)),
                moved=not torch.equal(before, embedding_b.full_tensor()), fp8=len(fp8_names))


def test_an_embedding_adapter_trains_under_fsdp2_and_torchao_equal_to_the_hand_wiring():
    pytest.importorskip("torchao", reason="torchao is not installed")
    for rank, r in enumerate(run_ranks(_embedding_case)):
        assert r["ours"] == r["ref"], f"rank {rank}: {r['ours']} != {r['ref']}"
        assert r["moved"] and r["fp8"] == 13, r


def test_an_alpha_whose_gradient_norm_overflows_skips_every_step_and_counts_it(capsys):
    """``--lora-alpha 1e30``: lora_B's gradients are finite (~1e27) and their norm inf; clipping by it zeroed them
    and AdamW stepped on zeros, printing ``grad norm inf`` with ``skipped 0``. Now every such step is skipped, said
    and counted, and the 5th in a row stops the run with one line."""
    code = main(["train", "--strategy", "none", "--nproc", "1", "--fp8", "none", "--lora-rank", "8", "--lora-alpha",
                 "1e30", "--steps", "6", "--batch-size", "2", "--seq-len", "32"])
    out, err = capsys.readouterr()
    steps = re.findall(r"^step +\d+/6 .* grad norm (\S+) \|.* skipped (\d+) \|", out, flags=re.M)
    assert code == 1 and steps == [("inf", "1"), ("inf", "2"), ("inf", "3"), ("inf", "4")], (out, err)
    assert ("fp8dist train: error: 5 consecutive steps had non-finite gradients (the last of norm inf, values past "
            "float32's range when squared), each skipped; the run is not recovering.") in err, err
