"""Tied parameters and FSDP units: a block (a unit of its own) that shares a parameter with a module outside it
is left out of the blocks, so the tie lives in one unit. BERT and RoBERTa name their embeddings a block
(``_no_split_modules``) and tie the word embeddings to the masked-LM decoder: FSDP2 refused the decoder's weight
at step 1 ("already managed by another FSDP group"), FSDP1 computed it with its unsharded fp32 original. Now they
train, with losses equal to the engines wired by hand in units that respect the tie."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fp8dist
from fp8dist.strategies.common import block_ties, find_blocks
from fp8dist.strategies.ties import TiedBlock, untie_blocks

STEPS = 2


def bert_tiny(seed: int = 0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    return BertForMaskedLM(BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def roberta_tiny(seed: int = 0):
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(seed)
    return RobertaForMaskedLM(RobertaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=128, max_position_embeddings=130,
                                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


FAMILIES = {"bert": (bert_tiny, "bert", "cls.predictions.decoder.weight"),
            "roberta": (roberta_tiny, "roberta", "lm_head.decoder.weight")}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_embedding_block_tied_to_the_head_is_left_out_and_said(family):
    build, base, decoder = FAMILIES[family]
    with torch.device("meta"):  # names and identities only: no data needed
        model = build()
    blocks, how = find_blocks(model)
    assert [n for n, _ in blocks] == [f"{base}.encoder.layer.1", f"{base}.encoder.layer.0"]
    assert how.endswith(f"; left out, tied to a parameter outside them: {base}.embeddings")
    assert block_ties(model) == (TiedBlock(f"{base}.embeddings", f"{base}.embeddings.word_embeddings.weight",
                                           decoder),)


class _Shared(nn.Module):
    """Two sibling blocks sharing one weight, inside an outer block that holds both; a third block apart."""

    def __init__(self):
        super().__init__()
        self.outer = nn.ModuleDict({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)})
        self.outer.b.weight = self.outer.a.weight
        self.apart = nn.Linear(8, 8)


def test_blocks_sharing_a_parameter_leave_it_to_the_unit_that_holds_every_holder():
    model = _Shared()
    blocks = [("outer.a", model.outer.a), ("outer.b", model.outer.b), ("outer", model.outer),
              ("apart", model.apart)]
    kept, ties = untie_blocks(model, blocks)
    assert [n for n, _ in kept] == ["outer", "apart"]
    assert ties == (TiedBlock("outer.a", "outer.a.weight", "outer.b.weight"),
                    TiedBlock("outer.b", "outer.b.weight", "outer.a.weight"))


def test_apply_fsdp_refuses_tied_blocks_before_sharding_anything():
    from fp8dist.strategies import apply_fsdp
    from fp8dist.strategies.fsdp import build_fsdp_policy

    model = bert_tiny()
    policy = build_fsdp_policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"block 'bert.embeddings' holds bert.embeddings.word_embeddings.weight, "
                                         r"tied to cls.predictions.decoder.weight outside it.* Leave 'bert.embeddings' "
                                         r"out of the blocks \(find_blocks does\)"):
        apply_fsdp(model, [model.bert.embeddings, *model.bert.encoder.layer], mesh=None, device=torch.device("cpu"),
                   mp_policy=policy, reshard_after_forward=True)
    assert type(model).__name__ == "BertForMaskedLM", "nothing sharded"


def _hand_fsdp2(model: nn.Module, world: int, base: str, head: str) -> nn.Module:
    """fully_shard per encoder layer, the embeddings and the tied head as one unit, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    inner = model.get_submodule(base)
    for layer in inner.encoder.layer:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard([inner.embeddings, model.get_submodule(head)], mesh=mesh, mp_policy=policy,
                reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _hand_fsdp1(model: nn.Module) -> nn.Module:
    """FSDP1 wrapping the encoder layers only (the embeddings stay with the tied head in the root unit)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    layer = type(model.bert.encoder.layer[0])
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer}), use_orig_params=True,
                                    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float32,
                                                                   buffer_dtype=torch.float32),
                                    device_id=torch.device("cpu"))


def _tied_case(rank: int, world: int) -> dict:
    from helpers import first_last_filter, train_losses
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    out: dict = {}
    for family, head in (("bert", "cls"), ("roberta", "lm_head")):
        build, base, _ = FAMILIES[family]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = fp8dist.wrap_model(build(), strategy="fsdp")
        out[family] = (train_losses(ours, rank, world, steps=STEPS),
                       train_losses(_hand_fsdp2(build(), world, base, head), rank, world, steps=STEPS),
                       fp8dist.get_wrap_info(ours).sharding)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = fp8dist.wrap_model(bert_tiny(), strategy="fsdp", fp8="torchao")
        ours1 = fp8dist.wrap_model(bert_tiny(), strategy="fsdp1")
    ref = bert_tiny()
    convert_to_float8_training(ref, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=first_last_filter(ref))
    _hand_fsdp2(ref, world, "bert", "cls")
    out["bert_torchao"] = (train_losses(ours, rank, world, steps=STEPS),
                           train_losses(ref, rank, world, steps=STEPS,
                                        after_step=lambda: precompute_float8_dynamic_scale_for_fsdp(ref)),
                           len(fp8dist.get_plan(ours).fp8))
    out["bert_fsdp1"] = (train_losses(ours1, rank, world, steps=STEPS),
                         train_losses(_hand_fsdp1(bert_tiny()), rank, world, steps=STEPS),
                         fp8dist.get_wrap_info(ours1).sharding)
    return out


def test_bert_and_roberta_train_under_fsdp2_and_fsdp1_like_the_hand_wired_tie_respecting_units():
    from dist_harness import run_ranks

    for rank in run_ranks(_tied_case):
        for family in ("bert", "roberta"):
            ours, ref, sharding = rank[family]
            assert ours == ref and ours[-1] < ours[0], (family, ours, ref)
            assert sharding.blocks == (f"{family}.encoder.layer.1", f"{family}.encoder.layer.0")
            assert [n for n in sharding.notes if "tied" in n] == [
                f"{family}.embeddings is not sharded as a block of its own: {family}.embeddings.word_embeddings.weight "
                f"is tied to {FAMILIES[family][2]} outside it, and a tied parameter must live in one FSDP unit; it is "
                "sharded with the enclosing unit"]
        ours, ref, fp8_layers = rank["bert_torchao"]
        assert ours == ref and fp8_layers == 12, rank["bert_torchao"]
        ours, ref, sharding = rank["bert_fsdp1"]
        assert ours == ref, rank["bert_fsdp1"]
        assert any("bert.embeddings is not sharded as a block" in n for n in sharding.notes)
