"""Transformer Engine wiring, checked on CPU through a STAND-IN of TE's API (tests/standins, not TE itself):
which modules are swapped, weights copied exactly, the recipe and the world group reaching fp8_autocast under
every strategy, eval turning FP8 off. The real TE runs in tests/test_fp8_gpu.py on a CUDA machine."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from helpers import BATCH, conv1d_as_linears, engine_losses, optimizer_losses, train_losses
from standin import drop_standins, use_standins
from torch import nn

import fp8dist
from fp8dist import get_plan, wrap_model
from fp8dist.train.models import build_llama
from fp8dist.plan.precision import FP8UnavailableError


@pytest.fixture
def standin_te():
    use_standins()
    yield
    drop_standins()


class Mixed(nn.Module):
    """An eligible Linear, an odd one in the middle, then more eligible layers: conversion must not stop."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 30)
        self.norm = nn.LayerNorm(30)
        self.back = nn.Linear(30, 32, bias=False)
        self.out = nn.Linear(32, 48)
        self.rms = nn.RMSNorm(48, eps=1e-6)

    def forward(self, x):
        return self.rms(self.out(self.back(self.norm(self.odd(self.up(x))))))


def test_swaps_eligible_modules_copies_weights_and_skips_the_rest(standin_te):
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    model = Mixed()
    original = copy.deepcopy(model)
    x = torch.randn(4, 32)
    wrapped = wrap_model(model, strategy="none", fp8="te", param_dtype="fp32")
    plan = get_plan(wrapped)
    assert [(e.name, e.precision, e.converted_to) for e in plan] == [
        ("up", "fp8", "te.Linear"), ("odd", "fp32", None), ("norm", "fp32", "te.LayerNorm"),
        ("back", "fp32", None), ("out", "fp8", "te.Linear"), ("rms", "fp32", "te.RMSNorm")]
    assert "in_features=30 not divisible by 16" in plan.by_name("back").reason
    assert "out_features=30 not divisible by 16" in plan.by_name("odd").reason
    assert type(wrapped.up) is te.Linear and type(wrapped.out) is te.Linear, "converted past the odd layer"
    assert type(wrapped.odd) is nn.Linear and type(wrapped.back) is nn.Linear
    assert type(wrapped.norm) is te.LayerNorm and type(wrapped.rms) is te.RMSNorm and wrapped.rms.eps == 1e-6
    for name, tensor in original.state_dict().items():
        assert torch.equal(wrapped.state_dict()[name], tensor), f"{name} copied exactly"
    assert torch.equal(wrapped(x), original(x)), "the stand-in computes the same math: only the classes changed"


def test_llama_rmsnorm_is_swapped_with_its_epsilon(standin_te):
    import transformer_engine.pytorch as te

    model = wrap_model(build_llama("tiny"), strategy="none", fp8="te")
    assert type(model.model.norm) is te.RMSNorm and model.model.norm.eps == model.config.rms_norm_eps
    assert sum(type(m) is te.Linear for m in model.modules()) == 15, "TE converts first and last Linear too"


def test_recipes_by_name_under_te_autocast_and_dropped_knobs_refused(standin_te):
    """Against TE 2.20's API (the stand-in's default): the forward runs under ``te.autocast`` (not the deprecated
    ``fp8_autocast``); DelayedScaling knobs TE 2.x dropped, which it would ignore without a word, are refused at
    their non-default values before any module is swapped, naming the TE version; their defaults pass."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    for name, cls in (("current", recipe.Float8CurrentScaling), ("mxfp8", recipe.MXFP8BlockScaling)):
        model = wrap_model(Mixed(), strategy="none", fp8="te", te_recipe=name, fp8_format="E4M3")
        model(torch.randn(2, 32))
        assert te.AUTOCAST_CALLS[-1][1] == cls(fp8_format=recipe.Format.E4M3)
        assert te.AUTOCAST_CALLS[-1][3] == "autocast"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        model = wrap_model(Mixed(), strategy="none", fp8="te", margin=2, interval=1,
                           override_linear_precision=(False, False, False))
        model(torch.randn(2, 32))
    assert te.AUTOCAST_CALLS[-1][1] == recipe.DelayedScaling(margin=2)
    for knob, value, why in (("interval", 4, "updates the scales after every step"),
                             ("override_linear_precision", (False, False, True), "backward_override='high_precision'")):
        mixed = Mixed()
        with pytest.raises(ValueError, match=re.escape(f"{knob}={value!r}: Transformer Engine 2.20.0+standin's "
                                                       f"DelayedScaling has no {knob} and would drop it without a "
                                                       "word (") + f".*{re.escape(why)}.*Leave {knob} at its default"):
            wrap_model(mixed, strategy="none", fp8="te", **{knob: value})
        assert all(type(m).__module__.startswith("torch.") for m in mixed.modules() if m is not mixed), \
            "refused before any module was swapped"


def test_before_te_2_9_fp8_autocast_and_the_old_knobs_are_used(monkeypatch):
    """One code path: where TE has no ``te.autocast`` (before 2.9), ``fp8_autocast(fp8_recipe, fp8_group)`` runs,
    and DelayedScaling still takes interval and override_linear_precision."""
    monkeypatch.setenv("FP8DIST_TE_STANDIN_API", "2.8")
    use_standins()
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe

        assert not hasattr(te, "autocast")
        knobs = dict(interval=2, override_linear_precision=(False, True, True))
        model = wrap_model(Mixed(), strategy="none", fp8="te", **knobs)
        model(torch.randn(2, 32))
        assert te.AUTOCAST_CALLS[-1][3] == "fp8_autocast"
        assert te.AUTOCAST_CALLS[-1][1] == recipe.DelayedScaling(**knobs)
    finally:
        drop_standins()


def test_real_te_is_gated_with_a_clear_error_or_an_announced_fallback():
    drop_standins()
    with pytest.raises(FP8UnavailableError, match="fp8='te' cannot run here: Transformer Engine is not installed"
                                                  ".*on_unsupported='fallback'"):
        wrap_model(Mixed(), strategy="none", fp8="te")
    with pytest.warns(UserWarning, match="fp8='te': fallback: Transformer Engine is not installed") as caught:
        model = wrap_model(Mixed(), strategy="none", fp8="te", on_unsupported="fallback")
    assert len([w for w in caught if "fallback" in str(w.message)]) == 1, "one warning"
    assert not get_plan(model).fp8 and all("on_unsupported='fallback'" in e.reason for e in get_plan(model))
    assert all(type(m).__module__.startswith("torch.") for m in model.modules() if m is not model)


def _te_rank_case(rank: int, world: int, strategy: str) -> dict:
    use_standins()
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    group = dist.new_group([0, 1])
    ds = dict(micro_batch_size=BATCH // world, optimizer={"type": "AdamW", "lr": 1e-3}) \
        if strategy == "deepspeed" else {}
    model = wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8="te", fp8_format="E4M3",
                       amax_history_len=16, amax_compute_algo="most_recent", margin=1, **ds)
    if strategy == "deepspeed":
        model = model[0]
        losses = engine_losses(model, rank, world, steps=2)
    else:
        losses = train_losses(model, rank, world, steps=2)
    train_call = te.AUTOCAST_CALLS[-1]
    rows = {row.part: row for row in fp8dist.report(model).rows}
    inner = model.module if hasattr(model, "module") else model
    # isinstance: FSDP2 gives each module it shards a subclass of its own (lm_head, in the final norm + output unit)
    fp8_forwards = {n: m.fp8_forwards for n, m in inner.named_modules() if isinstance(m, te.Linear)}
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    eval_call = te.AUTOCAST_CALLS[-1]
    custom = wrap_model(build_llama("tiny", seed=0), strategy=strategy, fp8="te", fp8_group=group,
                        use_autocast_during_eval=True, **ds)
    custom = custom[0] if strategy == "deepspeed" else custom
    custom.eval()
    with torch.no_grad():
        custom(input_ids=torch.zeros(1, 8, dtype=torch.long))
    expected = recipe.DelayedScaling(margin=1, fp8_format=recipe.Format.E4M3, amax_history_len=16,
                                     amax_compute_algo="most_recent")
    return dict(losses=losses, train_enabled=train_call[0], recipe_ok=train_call[1] == expected,
                world_group=train_call[2] is dist.group.WORLD, fp8_forwards=fp8_forwards,
                eval_enabled=eval_call[0], custom_group=te.AUTOCAST_CALLS[-1][2] is group,
                custom_eval_enabled=te.AUTOCAST_CALLS[-1][0],
                prepared=list(te.distributed.PREPARED), report_gemm=rows["fp8_gemm"].gemm,
                report_fp8_modules=rows["fp8_gemm"].modules)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp1", "ddp", "deepspeed"])
def test_autocast_gets_recipe_and_world_group_under_each_strategy(strategy):
    for r in run_ranks(_te_rank_case, strategy):
        assert r["train_enabled"] and r["recipe_ok"] and r["world_group"]
        assert r["report_gemm"] == "fp8 e4m3 (DelayedScaling)", "fp8dist.report reads the recipe on the forward"
        assert r["report_fp8_modules"] == len(r["fp8_forwards"])
        assert len(r["fp8_forwards"]) == 15 and all(n > 0 for n in r["fp8_forwards"].values()), \
            "every te.Linear ran inside the FP8 autocast (FSDP2 did not lose it)"
        assert r["eval_enabled"] is False, "eval turns FP8 autocast off"
        assert r["custom_group"] and r["custom_eval_enabled"] is True
        assert r["prepared"] == (["FullyShardedDataParallel"] * 2 if strategy == "fsdp1" else [])
        assert r["losses"][1] < r["losses"][0]


# ---- GPT-2's Conv1D under Transformer Engine: TEConv1D computes (out, in), checkpoints keep GPT-2's (in, out)

def _full_optim(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name: s["exp_avg_sq"] for name, s in state.get("state", {}).items()}  # rank 0 only


def _te_gpt2_case(rank: int, world: int, root: str) -> dict:
    """Per strategy: TE GPT-2 vs the hand-swapped Linear GPT-2 (same math under the stand-in); a checkpoint of the
    TE model loaded into a plain GPT-2 and into a fresh TE GPT-2; pretrained= of a plain GPT-2's export; the TE
    model's save_pretrained."""
    from pathlib import Path

    use_standins()
    from test_fp8_families import gpt2_tiny
    from transformers import GPT2LMHeadModel

    from fp8dist.strategies.local_shards import local_params

    warnings_off()
    out = {}
    for strategy in ("fsdp", "fsdp1"):
        where = Path(root) / strategy
        ours = wrap_model(gpt2_tiny(), strategy=strategy, fp8="te")
        opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
        ref = wrap_model(conv1d_as_linears(gpt2_tiny()), strategy=strategy)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        case = dict(losses=optimizer_losses(ours, opt, rank, world, 2),
                    ref=optimizer_losses(ref, ref_opt, rank, world, 2))
        case["transposed"] = sorted(n for p in local_params(ours) if p.transposed for n in p.names)
        fp8dist.save_checkpoint(where / "ckpt", ours, opt, step=2)
        weights = _full(ours)
        moments = _full_optim(ours, opt)
        case["next"] = optimizer_losses(ours, opt, rank, world, 1, start=2)
        fresh = wrap_model(gpt2_tiny(seed=1), strategy=strategy, fp8="te")
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        fp8dist.load_checkpoint(where / "ckpt", fresh, fresh_opt)
        case["resumed"] = optimizer_losses(fresh, fresh_opt, rank, world, 1, start=2)
        plain = wrap_model(gpt2_tiny(seed=1), strategy=strategy)  # Conv1D, no FP8
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        fp8dist.load_checkpoint(where / "ckpt", plain, plain_opt)
        plain_weights = _full(plain)
        case["plain_weights_equal"] = weights.keys() == plain_weights.keys() and \
            all(torch.equal(v, plain_weights[k]) for k, v in weights.items())
        plain_moments = _full_optim(plain, plain_opt)
        case["plain_moments_equal"] = {k: torch.equal(v.t() if k in case["transposed"] else v, plain_moments[k])
                                       for k, v in moments.items()}
        fp8dist.save_pretrained(fresh, where / "export", dtype=torch.float32)
        meta = _meta_gpt2()
        loaded = wrap_model(meta, strategy=strategy, fp8="te", pretrained=str(Path(root) / "source"))
        case["pretrained"] = _full(loaded)
        if rank == 0:
            back = GPT2LMHeadModel.from_pretrained(where / "export").state_dict()
            mine = _full(fresh)
            case["export_equal"] = all(torch.equal(back[k], v) for k, v in mine.items()) and \
                set(mine) <= set(back)
        else:
            _full(fresh)  # a collective: every rank iterates it
        out[strategy] = case
    return out


def _full(model) -> dict[str, torch.Tensor]:
    """Every parameter's full value (checkpoint layout) by its first plain name, on every rank."""
    from fp8dist.strategies.local_shards import gather_full

    return {names[0]: full for names, full in gather_full(model, to_rank0=False)}


def warnings_off() -> None:
    import warnings

    warnings.simplefilter("ignore")


def _meta_gpt2():
    from test_fp8_families import gpt2_tiny

    with torch.device("meta"):
        return gpt2_tiny()


def test_gpt2_conv1d_under_te_trains_as_linears_and_its_checkpoints_stay_gpt2(tmp_path):
    """TEConv1D (stand-in te.Linear) trains exactly as the Conv1D swapped by hand for nn.Linear; its checkpoint
    loads into a plain GPT-2 (weights equal, Adam moments equal after transposing) and resumes a TE GPT-2 exactly;
    pretrained= reads a plain GPT-2's export into it, and its save_pretrained reloads with from_pretrained."""
    from test_fp8_families import gpt2_tiny

    source = gpt2_tiny(seed=3)
    source.save_pretrained(tmp_path / "source")
    expected = {k: v for k, v in source.state_dict().items()}
    use_standins()
    try:
        plan = get_plan(wrap_model(gpt2_tiny(), strategy="none", fp8="te"))
    finally:
        drop_standins()
    conv1d = {e.name: (e.precision, e.converted_to) for e in plan if e.module_type == "Conv1D"}
    assert len(conv1d) == 4 * source.config.n_layer and \
        set(conv1d.values()) == {("fp8", "TEConv1D (te.Linear, checkpoints keep (in, out))")}
    head = plan.by_name("lm_head")
    assert head.converted_to is None and head.reason.startswith("weight tied to transformer.wte.weight"), head
    for rank, result in enumerate(run_ranks(_te_gpt2_case, str(tmp_path), timeout=400)):
        for strategy, case in result.items():
            what = (rank, strategy)
            assert case["losses"] == case["ref"], what
            assert case["transposed"] == sorted(f"{n}.weight" for n in conv1d), what
            assert case["resumed"] == case["next"], what
            assert case["plain_weights_equal"], what
            assert all(case["plain_moments_equal"].values()), (what, case["plain_moments_equal"])
            assert len(case["plain_moments_equal"]) == (len(expected) - 1 if rank == 0 else 0), what  # tied once
            assert case["pretrained"].keys() == expected.keys() - {"lm_head.weight"}, what
            assert all(torch.equal(v, expected[k]) for k, v in case["pretrained"].items()), what
            if rank == 0:
                assert case["export_equal"], what


# ---- MoE experts under fp8="te": TE has no module for fused experts; torchao's MoE grouped GEMMs run them

def _te_mixtral_case(rank: int, world: int) -> dict:
    use_standins()
    import transformer_engine.pytorch as te
    from helpers import hand_wired_fsdp2
    from test_fp8_families import mixtral_tiny
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor
    from torchao.quantization import quantize_

    # norms kept: the stand-in's te.RMSNorm is torch's nn.RMSNorm, whose arithmetic differs from MixtralRMSNorm's
    # (the losses part by 7e-5 at step 3 with them swapped)
    ours = wrap_model(mixtral_tiny(), strategy="fsdp", fp8="te", torchao_moe_recipe="mxfp8_emulated",
                      fp8_exclude=["*norm"])
    plan = get_plan(ours)
    ref = mixtral_tiny()  # by hand: torchao's MoE conversion on the experts; the stand-in te.Linear is nn.Linear
    quantize_(ref, MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL),
              filter_fn=lambda module, fqn: fqn.endswith("mlp.experts"))
    ref = hand_wired_fsdp2(ref, world)
    losses = dict(ours=train_losses(ours, rank, world), ref=train_losses(ref, rank, world))
    rows = {row.part: row for row in _report_after_step(ours, rank, world)}
    return dict(**losses,
        plan={e.name: (e.precision, e.converted_to, e.reason) for e in plan if e.name.endswith(("experts", "gate"))},
        te_linears=sum(isinstance(m, te.Linear) for m in ours.modules()),
        wrapped=isinstance(ours.model.layers[0].mlp.experts.gate_up_proj.to_local(), MXFP8TrainingWeightWrapperTensor),
        experts_row=(rows["fp8_grouped_gemm"].modules, rows["fp8_grouped_gemm"].gemm),
        linears_row=(rows["fp8_gemm"].modules, rows["fp8_gemm"].gemm))


def _report_after_step(model, rank, world):
    """fp8dist.report after one more step."""
    from fp8dist.train.data import Batches
    from helpers import SEQ

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = Batches(batch_size=BATCH, seq_len=SEQ, rank=rank, world_size=world, seed=9)[0]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    rows = fp8dist.report(model, opt).rows
    opt.zero_grad(set_to_none=True)
    return rows


def test_mixtral_experts_under_te_run_torchaos_moe_grouped_gemms():
    """fp8='te' on a Mixtral: attention Linears -> te.Linear (stand-in), the experts through torchao's MoE
    conversion (emulated MXFP8 on CPU), the router kept; losses equal to torchao's MoE conversion + fully_shard by
    hand (the stand-in computes te.Linear in plain precision); fp8dist.report labels both kinds of FP8 GEMM."""
    results = run_ranks(_te_mixtral_case)
    r = results[0]
    assert {n: v[:2] for n, v in r["plan"].items()} == {
        **{f"model.layers.{i}.mlp.experts": ("fp8", "torchao MoE: MXFP8 grouped GEMM, emulated") for i in range(2)},
        **{f"model.layers.{i}.mlp.gate": ("bf16", None) for i in range(2)}}
    assert r["plan"]["model.layers.0.mlp.gate"][2] == "MoE router, kept in high precision (as torchtitan keeps it)"
    assert r["te_linears"] == 2 * 4 + 1 and r["wrapped"], "q, k, v, o per layer and lm_head; experts wrapped"
    assert r["experts_row"] == (2, "mxfp8 e4m3 fwd+grads (32-element blocks, e8m0 scales, emulated)")
    assert r["linears_row"] == (9, "fp8 e4m3 fwd, e5m2 grads (DelayedScaling)")
    for rank in results:
        assert rank["ours"] == rank["ref"], (rank["ours"], rank["ref"])
