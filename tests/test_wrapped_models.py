"""Issue 40, items 3, 6 and 9: models that cannot be wrapped as they are, refused before anything changes.

- A model an engine already wrapped or sharded (DDP, FSDP1, fully_shard, DeepSpeed, DTensor parameters), anywhere
  in it, one FP8-converted by hand, or one that went through wrap_model (any part of it), is refused naming the
  engine and where, with the way out (it was wrapped a second time, or crashed inside torch).
- The numerics probe refuses the same models, and a model with nothing to measure (it reported 0 layers: "safe").
- Trainable bf16/fp16 parameters are refused where the optimizer steps them with no fp32 master (fsdp, fsdp1, ddp,
  none under the standard level); frozen ones, DeepSpeed (fp32 masters) and memory="lean" (bf16 on purpose) are
  accepted.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks
from torch import nn

from fp8dist import measure_fp8_numerics, unwrap_model, wrap_model
from fp8dist.train.models import build_llama

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
WAY_OUT = "Pass the model as built, before any engine wraps or shards it"


def _as_given(model: nn.Module) -> list[tuple[str, int, torch.dtype]]:
    """What wrap_model must leave as it was: each parameter's name, identity and dtype."""
    return [(n, id(p), p.dtype) for n, p in model.named_parameters()]


def _ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


def _fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))


def _fsdp1_block(model):
    model.model.layers[1] = _fsdp1(model.model.layers[1])
    return model


def _fully_shard(model):
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)


def _fully_shard_block(model):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.model.layers[0])
    return model


def _dtensor_param(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    proj = model.model.layers[0].mlp.up_proj
    proj.weight = nn.Parameter(distribute_tensor(proj.weight.detach(), mesh, [Replicate()]))
    return model


@pytest.mark.parametrize("hand,strategy,said", [
    (_ddp, "ddp", "the model given (DistributedDataParallel) is already wrapped in DistributedDataParallel (DDP)"),
    (_fsdp1, "fsdp", "the model given (FullyShardedDataParallel) is already wrapped in FullyShardedDataParallel "
                     "(FSDP1)"),
    (_fsdp1_block, "fsdp1", "model.layers.1 (FullyShardedDataParallel) of LlamaForCausalLM is already wrapped in "
                            "FullyShardedDataParallel (FSDP1)"),
    (_fully_shard, "fsdp", "the model given (FSDPLlamaForCausalLM) is already sharded by fully_shard (FSDP2)"),
    (_fully_shard_block, "fsdp", "model.layers.0 (FSDPLlamaDecoderLayer) of LlamaForCausalLM is already sharded by "
                                 "fully_shard (FSDP2)"),
    (_dtensor_param, "ddp", "parameter 'model.layers.0.mlp.up_proj.weight' of LlamaForCausalLM is already a DTensor "
                            "(sharded by hand: fully_shard or tensor parallel)"),
], ids=["ddp", "fsdp1", "fsdp1 on a block", "fully_shard", "fully_shard on a block", "dtensor parameter"])
def test_a_model_wrapped_by_hand_is_refused_naming_the_engine_and_where(one_rank_group, hand, strategy, said):
    model = hand(build_llama("tiny", seed=0))
    given, kind = _as_given(model), type(model)
    with pytest.raises(ValueError) as refused:
        wrap_model(model, strategy=strategy)
    assert str(refused.value).startswith(f"wrap_model: {said};"), str(refused.value)
    assert WAY_OUT in str(refused.value) and "without wrap_model" in str(refused.value)
    assert _as_given(model) == given and type(model) is kind, "refused before anything changed"


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1", "ddp", "none"])
def test_what_wrap_model_returned_and_every_part_of_it_is_refused(one_rank_group, strategy):
    wrapped = wrap_model(build_llama("tiny", seed=0), strategy=strategy)
    inner = unwrap_model(wrapped)
    holder = nn.ModuleDict({"block": inner.model.layers[1]})  # a part of it inside a model of the user's
    for part, where in ((wrapped, f"the model given ({type(wrapped).__name__})"),
                        (inner, f"the model given ({type(inner).__name__})"),
                        (inner.model.layers[1], f"the model given ({type(inner.model.layers[1]).__name__})"),
                        (holder, f"block ({type(inner.model.layers[1]).__name__}) of ModuleDict")):
        for again in ("fsdp", "ddp"):
            given = _as_given(part)
            with pytest.raises(ValueError) as refused:
                wrap_model(part, strategy=again)
            assert str(refused.value).startswith(
                f"wrap_model: {where} is already wrapped by fp8dist.wrap_model (strategy={strategy!r}). Train that "
                "model as wrap_model returned it (fp8dist.get_wrap_info(model) says what was done)"), str(refused.value)
            assert _as_given(part) == given


def _float8_by_hand(model):
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model)
    return model


@pytest.mark.parametrize("fp8", ["torchao", None])
def test_a_model_converted_to_fp8_by_hand_is_refused(one_rank_group, fp8):
    """The plan said these layers train in bf16 ("Float8Linear is not converted by torchao") while they ran FP8."""
    model = _float8_by_hand(build_llama("tiny", seed=0))
    given = _as_given(model)
    with pytest.raises(ValueError) as refused:
        wrap_model(model, strategy="fsdp", fp8=fp8)
    assert str(refused.value).startswith(
        "wrap_model: model.layers.0.self_attn.q_proj of LlamaForCausalLM is already a Float8Linear from torchao "
        "(converted by hand)"), str(refused.value)
    assert "Pass the model before conversion, with fp8='torchao'" in str(refused.value)
    assert _as_given(model) == given


def test_a_model_holding_transformer_engine_layers_is_refused(one_rank_group):
    from standin import drop_standins, use_standins

    use_standins()
    try:
        import transformer_engine.pytorch as te

        model = build_llama("tiny", seed=0)
        model.lm_head = te.Linear(64, 256, bias=False, device="cpu")
        with pytest.raises(ValueError, match=r"wrap_model: lm_head of LlamaForCausalLM is already a Linear from "
                                             r"transformer_engine \(converted by hand\).* with fp8='te'"):
            wrap_model(model, strategy="fsdp", fp8="te")
    finally:
        drop_standins()


def _deepspeed_case(rank: int, world: int) -> dict:
    """A DeepSpeed engine built by hand, and its inner module; a bf16 model through strategy="deepspeed"."""
    import os

    import deepspeed

    from fp8dist.strategies.deepspeed import _skip_shm_comm_op

    os.environ.setdefault("LOCAL_RANK", "0")
    _skip_shm_comm_op()  # as fp8dist does on a CPU: no 40 s JIT build of an op training never calls
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    model = build_llama("tiny", seed=0)
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    out = {}
    for name, part in (("engine", engine), ("inner", engine.module)):
        try:
            wrap_model(part, strategy="fsdp")
        except ValueError as err:
            out[name] = str(err)
    half, _ = wrap_model(build_llama("tiny", seed=0).bfloat16(), strategy="deepspeed", micro_batch_size=1,
                         optimizer={"type": "AdamW", "lr": 1e-3})
    out["bf16 model"] = type(half).__name__
    for name, part in (("ours", half), ("ours inner", half.module)):
        try:
            wrap_model(part, strategy="ddp")
        except ValueError as err:
            out[name] = str(err)
    return out


@pytest.mark.slow
def test_a_deepspeed_engine_and_its_inner_module_are_refused_and_a_bf16_model_is_not():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'fp8dist[deepspeed]')")
    [out] = run_ranks(_deepspeed_case, world_size=1, timeout=300)
    assert out["engine"].startswith("wrap_model: the model given (DeepSpeedEngine) is already a DeepSpeed engine "
                                    "(deepspeed.initialize); fp8dist applies the strategy itself"), out["engine"]
    assert out["inner"].startswith("wrap_model: parameter 'model.embed_tokens.weight' of LlamaForCausalLM is already "
                                   "held by DeepSpeed"), out["inner"]
    assert WAY_OUT in out["engine"] and WAY_OUT in out["inner"]
    assert out["bf16 model"] == "DeepSpeedEngine", "DeepSpeed keeps fp32 master weights of bf16 parameters"
    for name, given in (("ours", "DeepSpeedEngine"), ("ours inner", "LlamaForCausalLM")):
        assert out[name].startswith(f"wrap_model: the model given ({given}) is already wrapped by fp8dist.wrap_model "
                                    "(strategy='deepspeed')"), out[name]


# ---- the numerics probe ------------------------------------------------------------------------------------------

PROBE_WAY_OUT = "The probe measures the model as built, in this process: pass it before wrap_model"


@pytest.mark.parametrize("strategy,fp8", [("fsdp", "torchao"), ("ddp", None)])
def test_the_probe_refuses_a_wrapped_model_instead_of_reporting_no_layers(one_rank_group, strategy, fp8):
    wrapped = wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8=fp8)
    with pytest.raises(ValueError) as refused:
        measure_fp8_numerics(wrapped, [IDS])
    assert str(refused.value).startswith(f"measure_fp8_numerics: the model given ({type(wrapped).__name__}) is "
                                         f"already wrapped by fp8dist.wrap_model (strategy={strategy!r})")
    assert PROBE_WAY_OUT in str(refused.value) and "numerics=report" in str(refused.value)


@pytest.mark.parametrize("hand,said", [
    (_fully_shard_block, "model.layers.0 (FSDPLlamaDecoderLayer) of LlamaForCausalLM is already sharded by "
                         "fully_shard (FSDP2)"),
    (_float8_by_hand, "model.layers.0.self_attn.q_proj is already a Float8Linear (converted by hand)"),
], ids=["fully_shard on a block", "Float8Linear"])
def test_the_probe_refuses_a_model_sharded_or_converted_by_hand(one_rank_group, hand, said):
    with pytest.raises(ValueError) as refused:
        measure_fp8_numerics(hand(build_llama("tiny", seed=0)), [IDS])
    assert str(refused.value).startswith(f"measure_fp8_numerics: {said}. {PROBE_WAY_OUT}"), str(refused.value)


class _NoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, 64)

    def forward(self, input_ids, labels=None):
        return self.embed(input_ids).float().square().mean()


@pytest.mark.parametrize("model,options,said", [
    (_NoLinear, {}, "fp8='torchao' would run no layer of _NoLinear in FP8 (embed: Embedding is not converted by "
                    "torchao), so there is nothing to measure"),
    (lambda: build_llama("tiny", seed=0), {"fp8_exclude": ["*"]},
     "fp8='torchao' would run no layer of LlamaForCausalLM in FP8 (15 GEMM modules: matches fp8_exclude '*')"),
], ids=["no Linear", "all excluded"])
def test_the_probe_refuses_a_model_with_nothing_to_measure(model, options, said):
    with pytest.raises(ValueError) as refused:
        measure_fp8_numerics(model(), [IDS], loss_fn=lambda out, batch: getattr(out, "loss", out), **options)
    assert str(refused.value).startswith(f"measure_fp8_numerics: {said}"), str(refused.value)
    assert "fp8_exclude" in str(refused.value)


# ---- half-precision parameters -----------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy,dtype,fp8", [("fsdp", torch.bfloat16, "torchao"), ("fsdp1", torch.float16, None),
                                                ("ddp", torch.bfloat16, None), ("none", torch.float16, None)])
def test_trainable_half_parameters_are_refused_where_nothing_keeps_fp32_masters(one_rank_group, strategy, dtype,
                                                                                fp8):
    model = build_llama("tiny", seed=0).to(dtype)
    given = _as_given(model)
    with pytest.raises(ValueError) as refused:
        wrap_model(model, strategy=strategy, fp8=fp8)
    short = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    said = str(refused.value)
    assert said.startswith(f"wrap_model: LlamaForCausalLM has 21 trainable {short} parameters (e.g. "
                           f"'model.embed_tokens.weight') and strategy={strategy!r} with memory='standard' keeps no "
                           f"fp32 master weights: the optimizer steps them in {short}, where an update smaller than "
                           f"about {'4e-03' if short == 'bf16' else '5e-04'} of a weight is lost."), said
    assert "model.float() before wrap_model" in said and "memory='lean'" in said and "strategy='deepspeed'" in said
    assert _as_given(model) == given


def test_a_meta_model_built_in_bf16_is_refused_before_it_is_materialized(one_rank_group):
    with torch.device("meta"):
        model = build_llama("tiny", seed=0).bfloat16()
    with pytest.raises(ValueError, match="trainable bf16 parameter"):
        wrap_model(model, strategy="fsdp")
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "none"])
def test_frozen_half_parameters_are_accepted_and_stay_as_they_are(one_rank_group, strategy):
    """Nothing steps a frozen parameter, so no master copy is missing (a frozen bf16 base, say). Not fsdp1 here: its
    root unit would mix bf16 and fp32 (the next test)."""
    model = build_llama("tiny", seed=0)
    model.model.embed_tokens.to(torch.bfloat16).requires_grad_(False)
    frozen = model.model.embed_tokens.weight.detach().clone()
    wrapped = wrap_model(model, strategy=strategy)
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    wrapped(input_ids=IDS, labels=IDS).loss.backward()
    opt.step()
    embedding = unwrap_model(wrapped).model.embed_tokens.weight
    full = embedding.full_tensor() if hasattr(embedding, "full_tensor") else embedding
    assert full.dtype == torch.bfloat16 and torch.equal(full, frozen)


def test_memory_lean_takes_a_bf16_model_as_it_is_meant_to(one_rank_group):
    model, _ = wrap_model(build_llama("tiny", seed=0).bfloat16(), strategy="fsdp", memory="lean",
                          optimizer={"type": "AdamW", "lr": 1e-3})
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_fsdp1_refuses_a_unit_that_mixes_dtypes_before_anything_changes(one_rank_group):
    """FSDP1 flattens a unit into one tensor of one dtype: its constructor failed on the frozen bf16 embedding in the
    root unit, after the FP8 conversion had changed the model."""
    model = build_llama("tiny", seed=0)
    model.model.embed_tokens.to(torch.bfloat16).requires_grad_(False)
    given = _as_given(model)
    with pytest.raises(ValueError) as refused:
        wrap_model(model, strategy="fsdp1", fp8="torchao")
    assert str(refused.value) == (
        "strategy='fsdp1' flattens each unit's parameters into one tensor of one dtype, and the root unit (what the "
        "blocks leave) mixes bf16 ('model.embed_tokens.weight') and fp32 ('model.norm.weight'). Cast them to one "
        "dtype (model.float(): fp8dist computes in bf16 anyway), or use strategy='fsdp', whose per-parameter shards "
        "take mixed dtypes.")
    assert _as_given(model) == given and type(model.model.layers[0].mlp.up_proj) is nn.Linear
