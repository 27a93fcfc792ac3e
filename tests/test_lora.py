"""LoRA on an FP8 base: ``wrap_model`` on a PEFT model (``peft.get_peft_model``), on 2 real gloo ranks.

The frozen base Linears (``...base_layer``) are planned like any Linear and run torchao's FP8 GEMM; the adapters
(``lora_A`` / ``lora_B``) stay in bf16 with their reason at any rank; FSDP2 shards units that hold frozen and
trainable parameters together, and losses and adapter weights equal the same engine wired by hand, bit for bit.
FSDP1, DDP, HSDP, memory="lean" and DeepSpeed ZeRO 1-3 train the adapters alone too; the numerics probe measures
the base layers; a non-finite step leaves adapters and their optimizer state as they were.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from dist_harness import run_ranks
from helpers import BATCH, gemms_per_module, hand_wired_fsdp2, one_thread, optimizer_losses  # noqa: F401  (a fixture)

pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")
pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

from fp8dist import clip_grad_norm_, get_plan, get_wrap_info, plan_precision, resolve_config, wrap_model  # noqa: E402
from fp8dist.train.data import Batches  # noqa: E402
from fp8dist.train.models import build_llama  # noqa: E402

TARGETS = ["q_proj", "v_proj", "gate_proj"]
STEPS = 3
SEQ = 32


def peft_llama(r: int = 8, dtype: torch.dtype = torch.float32, targets: list[str] = TARGETS):
    """The tiny Llama (hidden 128, MLP 384, k/v 64: every dim divisible by 16) with LoRA adapters on ``targets``."""
    from peft import LoraConfig, get_peft_model

    model = build_llama("tiny", seed=0).to(dtype)
    torch.manual_seed(0)  # PEFT draws lora_A from the global generator: every build the same
    return get_peft_model(model, LoraConfig(r=r, target_modules=targets))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` as a plain tensor (a DTensor's shard, torchao's FP8 weight wrapper unwrapped)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return getattr(t, "_tensor", t).detach().clone()


@pytest.mark.parametrize("rank", [16, 64])
def test_adapters_stay_bf16_with_their_reason_at_any_rank(rank):
    plan = plan_precision(peft_llama(rank, targets=[*TARGETS, "lm_head"]),
                          resolve_config(strategy="fsdp", fp8="torchao"), device=torch.device("cpu"))
    adapters = [e for e in plan if ".lora_" in e.name]
    assert len(adapters) == 2 * (2 * 3 + 1)  # A and B of 3 targets in 2 layers, and of the output head
    for e in adapters:  # their dims are multiples of 16: only the adapter rule keeps them out
        assert (e.precision, e.converted_to) == ("bf16", None), e
        which = e.name.split(".lora_")[1].split(".")[0]
        assert e.reason == f"PEFT adapter (lora_{which}, rank {rank}): a rank-r GEMM is too small to pay for FP8 casts"
    base = plan.by_name("base_model.model.model.layers.1.mlp.gate_proj.base_layer")
    assert (base.precision, base.reason) == ("fp8", "converted by torchao; frozen weight")
    # the first and last Linear rule means the base model's: a LoRA on the output head runs its lora_B last
    assert plan.by_name("base_model.model.lm_head.base_layer").reason.startswith("last Linear, kept")
    assert plan.by_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer").reason.startswith("first Linear")


def test_dora_magnitudes_and_embedding_adapters_are_adapters_too():
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=16, target_modules=["v_proj", "embed_tokens"], use_dora=True)
    plan = plan_precision(get_peft_model(build_llama("tiny", seed=0), config),
                          resolve_config(strategy="fsdp", fp8="torchao"), device=torch.device("cpu"))
    for name, which in (("layers.1.self_attn.v_proj.lora_magnitude_vector.default", "lora_magnitude_vector)"),
                        ("embed_tokens.lora_embedding_A", "lora_embedding_A, rank 16)")):  # a ParameterDict: its row
        entry = plan.by_name(f"base_model.model.model.{name}")
        assert entry.precision == "bf16" and entry.reason.startswith(f"PEFT adapter ({which}"), entry


def _parity_case(rank: int, world: int, recipe: str) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp as precompute

    base = peft_llama()
    ours, opt = wrap_model(copy.deepcopy(base), strategy="fsdp", fp8="torchao", torchao_recipe=recipe,
                           optimizer={"type": "AdamW", "lr": 1e-2})
    plan = get_plan(ours)
    fp8_names = {e.name for e in plan.fp8}
    ref = copy.deepcopy(base)  # the hand wiring: PEFT, torchao with the plan's filter, fully_shard per block and root
    tensorwise = recipe == "tensorwise"
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True) if tensorwise else \
        Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(ref, config=config, module_filter_fn=lambda module, fqn: fqn in fp8_names)
    hand_wired_fsdp2(ref, world, layers=ref.base_model.model.model.layers)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)

    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    frozen_before = {n: _local(p) for n, p in ours.named_parameters() if not p.requires_grad}
    adapters_before = {n: _local(p) for n, p in ours.named_parameters() if p.requires_grad}
    q = ours.base_model.model.model.layers[1].self_attn.q_proj
    out = dict(
        ours=optimizer_losses(ours, opt, rank, world, STEPS, seq_len=SEQ),
        ref=optimizer_losses(ref, ref_opt, rank, world, STEPS, seq_len=SEQ,
                             after_step=(lambda: precompute(ref)) if tensorwise else None),
        plan={e.name: (e.precision, e.reason) for e in plan},
        optimizer={n for n, p in ours.named_parameters() if any(p is o for g in opt.param_groups for o in g["params"])},
        trainable=trainable, blocks=get_wrap_info(ours).sharding.blocks,
        placements={n: [repr(p) for p in t.placements] for n, t in (("base", q.base_layer.weight),
                                                                        ("lora_A", q.lora_A.default.weight))},
        frozen_same=all(torch.equal(_local(p), frozen_before[n]) for n, p in ours.named_parameters()
                        if not p.requires_grad),
        adapters_moved=sum(not torch.equal(_local(p), adapters_before[n]) for n, p in ours.named_parameters()
                           if p.requires_grad),
        adapters_equal=all(torch.equal(a.full_tensor(), b.full_tensor()) for (n, a), (_, b) in
                           zip(ours.named_parameters(), ref.named_parameters()) if a.requires_grad),
    )
    out["gemms"] = gemms_per_module(ours, Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world)[0])[0]
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp2_lora_on_fp8_base_matches_hand_wiring(recipe):
    for rank, r in enumerate(run_ranks(_parity_case, recipe)):
        assert r["ours"] == r["ref"], f"rank {rank}: {r['ours']} != {r['ref']}"
        assert r["adapters_equal"], "adapter weights equal the hand-wired run's"
        assert r["trainable"] and all(".lora_" in n for n in r["trainable"])
        assert r["optimizer"] == r["trainable"], "only the adapters reach the optimizer"
        assert r["frozen_same"], "the frozen base is unchanged by training"
        assert r["adapters_moved"] == len(r["trainable"]), "every adapter trained"
        # one FSDP2 unit per decoder layer, found inside the PEFT wrapper, shards frozen and trainable weights alike
        assert sorted(r["blocks"]) == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]
        assert r["placements"] == dict(base=["Shard(dim=0)"], lora_A=["Shard(dim=0)"])
        v = "base_model.model.model.layers.1.self_attn.v_proj"
        assert r["plan"][f"{v}.base_layer"][0] == "fp8" and r["plan"][f"{v}.lora_A.default"][0] == "bf16"
        assert r["gemms"][f"{v}.base_layer"] > 0, "the frozen base layer ran torchao's FP8 GEMM"
        assert r["gemms"][f"{v}.lora_A.default"] == r["gemms"][f"{v}.lora_B.default"] == 0


def _held(p: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``p``: ZeRO-3's partition, a DTensor's shard, or the whole tensor."""
    return _local(getattr(p, "ds_tensor", p))


STRATEGIES = {"fsdp1": {}, "ddp": {}, "hsdp": dict(strategy="fsdp", replicate_degree=2),
              "lean": dict(strategy="fsdp", memory="lean"),
              **{f"zero{s}": dict(strategy="deepspeed", zero_stage=s, micro_batch_size=BATCH // 2) for s in (1, 2, 3)}}


def _strategy_case(rank: int, world: int) -> dict:
    os.environ.update(LOCAL_SIZE=str(world))  # DeepSpeed's launcher variable for ranks on one node
    out = {}
    for name, options in STRATEGIES.items():
        options = {"strategy": name, **options}
        engine = options["strategy"] == "deepspeed"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model, opt = wrap_model(peft_llama(), fp8="torchao", optimizer={"type": "AdamW", "lr": 1e-2},
                                        **options)
            except Exception as err:  # noqa: BLE001  (a refusal is the answer for that strategy)
                out[name] = dict(refused=f"{type(err).__name__}: {err}")
                continue
            before = {n: _held(p) for n, p in model.named_parameters()}
            batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)
            losses, norms = [], []
            for step in range(STEPS):
                ids = batches[step]
                loss = model(input_ids=ids, labels=ids).loss
                if engine:
                    model.backward(loss)
                    model.step()
                else:
                    loss.backward()
                    norms.append(clip_grad_norm_(model, 1.0).item())  # over the adapters' gradients only
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
        moved = {n for n, p in model.named_parameters() if not torch.equal(_held(p), before[n])}
        out[name] = dict(losses=losses, norms=norms, moved=moved, trainable={n for n, p in model.named_parameters()
                                                               if p.requires_grad},
                         fp8=len(get_plan(model).fp8), kind=type(model).__name__)
    return out


def test_every_strategy_trains_only_the_adapters_over_an_fp8_base():
    results = run_ranks(_strategy_case, timeout=600)
    for name in STRATEGIES:
        assert all("refused" not in out[name] for out in results), (name, results[0][name])
        runs = [out[name] for out in results]
        for r in runs:
            assert r["fp8"] == 13, f"{name}: the base layers run FP8 (all 15 Linears but the first and last)"
            assert r["losses"][-1] < r["losses"][0], (name, r["losses"])
            assert all(0 < n < float("inf") for n in r["norms"]), (name, r["norms"])
            assert r["trainable"] and all(".lora_" in n for n in r["trainable"]), name
        # FSDP1 gives a rank an empty view of a parameter held wholly in another rank's shard: the ranks together
        moved = set().union(*(r["moved"] for r in runs))
        assert moved == runs[0]["trainable"], f"{name}: only and every adapter changed"


def test_a_frozen_bf16_base_is_accepted_and_bf16_adapters_are_refused():
    from peft import LoraConfig, get_peft_model

    # PEFT keeps adapters of a bf16 base in fp32 (autocast_adapter_dtype): nothing trainable lacks fp32 masters
    model = peft_llama(dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    with pytest.raises(ValueError, match=r"strategy='fsdp1' flattens .* mixes bf16 .* strategy='fsdp'"):
        wrap_model(model, strategy="fsdp1", fp8="torchao")  # one flat tensor per unit: one dtype
    bf16 = get_peft_model(build_llama("tiny", seed=0).to(torch.bfloat16), LoraConfig(r=8, target_modules=TARGETS),
                          autocast_adapter_dtype=False)
    with pytest.raises(ValueError, match=r"has 12 trainable bf16 parameters \(e\.g\. '.*lora_A\.default\.weight'\)"
                       r".* leave get_peft_model's autocast_adapter_dtype=True"):
        wrap_model(bf16, strategy="fsdp", fp8="torchao")


def _bf16_base_case(rank: int, world: int) -> dict:
    model, opt = wrap_model(peft_llama(dtype=torch.bfloat16), strategy="fsdp", fp8="torchao",
                            optimizer={"type": "AdamW", "lr": 1e-2})
    return dict(losses=optimizer_losses(model, opt, rank, world, STEPS, seq_len=SEQ), fp8=len(get_plan(model).fp8))


def test_fsdp2_trains_a_bf16_base_with_fp32_adapters():
    for r in run_ranks(_bf16_base_case):
        assert r["fp8"] == 13 and r["losses"][-1] < r["losses"][0], r


def test_the_numerics_probe_measures_the_base_layers_of_a_peft_model(one_thread):
    from fp8dist import measure_fp8_numerics

    model = peft_llama()
    ids = Batches(batch_size=2, seq_len=SEQ, rank=0, world_size=1, seed=0)[0]
    report = measure_fp8_numerics(model, [ids], fp8="torchao")
    probed = {row.name for row in report.layers}
    assert probed == {e.name for e in plan_precision(model, resolve_config(strategy="fsdp", fp8="torchao"),
                                                     device=torch.device("cpu")).fp8}
    assert "base_model.model.model.layers.1.self_attn.v_proj.base_layer" in probed
    assert not any(".lora_" in name for name in probed), "adapters stay bf16: nothing to probe"
    assert report.recommended_exclude == []


BAD = 1  # the step whose forward makes an inf (on rank 0 only)


def _guard_case(rank: int, world: int) -> dict:
    batches = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=0)

    def run(bad: bool):
        model, opt = wrap_model(peft_llama(), strategy="fsdp", fp8="torchao", optimizer={"type": "AdamW", "lr": 1e-2})
        layer = model.base_model.model.model.layers[1].mlp.down_proj  # a frozen FP8 base layer
        losses, same, said = [], None, []
        for step in range(STEPS + 1):
            if step == BAD and not bad:
                continue  # the twin never sees that batch
            poison = bad and step == BAD and rank == 0
            hook = layer.register_forward_hook(lambda m, a, out: out * float("inf")) if poison else None
            before = [_local(t) for t in (*model.parameters(), *(v for s in opt.state.values() for v in s.values()))]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ids = batches[step]
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if hook is not None:
                hook.remove()
            if step == BAD:
                after = [_local(t) for t in (*model.parameters(), *(v for s in opt.state.values() for v in s.values()))]
                same = len(before) == len(after) and all(torch.equal(x, y) for x, y in zip(before, after))
                said = [str(w.message) for w in caught if "skipped: non-finite" in str(w.message)]
            else:
                losses.append(loss.item())
        return losses, same, said, get_wrap_info(model).skipped_steps

    losses, same, said, skipped = run(bad=True)
    return dict(losses=losses, same=same, said=said, skipped=skipped, never=run(bad=False)[0])


def test_a_non_finite_step_leaves_adapters_and_their_optimizer_state_untouched():
    for rank, r in enumerate(run_ranks(_guard_case)):
        assert r["same"], f"rank {rank}: adapters or their AdamW state changed in the skipped step"
        assert r["skipped"] == 1 and len(r["said"]) == 1 and ".lora_" in r["said"][0], r["said"]
        assert r["losses"] == r["never"], "the run goes on as if the batch had never been seen"
