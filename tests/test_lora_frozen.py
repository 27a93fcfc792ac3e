"""A frozen FP8 base (a LoRA model's ``base_layer``s) pays no per-step FP8 weight work (fp8dist.fp8.frozen).

Real torchao on the CPU, real FSDP2 on 2 gloo ranks. The casts are counted by wrapping torchao's own cast functions
in the test; the reference is torchao as fp8dist wires it without the frozen path (a weight cast every step, its
gradient GEMM run and dropped): losses must stay ``==``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from dist_harness import run_ranks
from helpers import train_losses
from torch import nn

pytest.importorskip("torchao.float8")

from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8 import float8_linear as ao_linear  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

from fp8dist import wrap_model  # noqa: E402
from fp8dist.fp8 import frozen, torchao as ao_backend  # noqa: E402
from fp8dist.fp8.frozen import FrozenFloat8Linear, freeze_float8_linears  # noqa: E402
from fp8dist.fp8.weight_wrapper import FP8Gemms  # noqa: E402
from fp8dist.train.models import build_llama  # noqa: E402

STEPS = 3
TRAINABLE = "layers.1.mlp.down_proj"  # one FP8 base weight left trainable by hand: still cast every step


def _lora_llama() -> nn.Module:
    """Tiny Llama under PEFT LoRA (r=8 on q/v/up: the adapters stay bf16), one base FP8 Linear unfrozen by hand."""
    pytest.importorskip("peft")  # a test extra (issue 43); the tests without PEFT run anyway
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build_llama("tiny", seed=0), LoraConfig(r=8, target_modules=["q_proj", "v_proj",
                                                                                       "up_proj"]))
    next(m for n, m in model.named_modules() if n.endswith(TRAINABLE)).weight.requires_grad_(True)
    return model


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _uncached():
    """fp8dist's torchao wiring without the frozen path: every Float8Linear stays torchao's, and the scale
    precompute reads every FP8 weight (torchao's documented call)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    with _patched(frozen, "freeze_float8_linears", lambda model, names, cache_weight: []), \
            _patched(ao_backend, "_precompute", lambda model, opt: precompute_float8_dynamic_scale_for_fsdp(model)):
        yield


class _WeightCasts:
    """Counts torchao's dynamic FP8 casts of weights (``gemm_input_role=WEIGHT``) per module, by the storage of
    the tensor cast; ``step()`` closes a step's tally."""

    def __init__(self, model: nn.Module):
        self.owner = {m.weight.untyped_storage().data_ptr(): n for n, m in model.named_modules()
                      if isinstance(m, Float8Linear)}
        self.steps: list[dict[str, int]] = [{}]

    def wrap(self, cast):
        def counted(t, *args, **kwargs):
            if kwargs.get("gemm_input_role") is GemmInputRole.WEIGHT:
                name = self.owner.get(t.untyped_storage().data_ptr(), "?")
                self.steps[-1][name] = self.steps[-1].get(name, 0) + 1
            return cast(t, *args, **kwargs)
        return counted

    def step(self) -> None:
        self.steps.append({})

    @contextlib.contextmanager
    def counting(self):
        """torchao's cast counted where torchao's matmul and fp8dist's frozen path call it."""
        with _patched(ao_linear, "hp_tensor_to_float8_dynamic", self.wrap(ao_linear.hp_tensor_to_float8_dynamic)), \
                _patched(frozen, "hp_tensor_to_float8_dynamic", self.wrap(frozen.hp_tensor_to_float8_dynamic)):
            yield


def test_frozen_float8_linear_runs_no_weight_gradient_gemm_and_casts_once():
    """One Linear, torchao's Float8Linear against the same made frozen: equal outputs and input gradients; the
    frozen one runs 2 FP8 GEMMs a step (forward, input gradient) instead of 3, and its weight's cast is computed
    once (tensorwise) while torchao computes it twice a step; a changed weight is cast again."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 48, bias=False)
    for recipe in ("tensorwise", "rowwise"):
        config = Float8LinearConfig() if recipe == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe)
        ref = Float8Linear.from_float(copy.deepcopy(linear), config).requires_grad_(False)
        holder = nn.Sequential(Float8Linear.from_float(copy.deepcopy(linear), config).requires_grad_(False))
        assert freeze_float8_linears(holder, {"0"}, cache_weight=recipe == "tensorwise") == ["0"]
        ours = holder[0]
        casts = _WeightCasts(holder)
        casts.owner.update({ref.weight.untyped_storage().data_ptr(): "ref"})
        with casts.counting():
            for step in range(3):
                if step == 2:  # an in-place change (a load) bumps the weight's version: cast again
                    with torch.no_grad():
                        ref.weight.mul_(0.5), ours.weight.mul_(0.5)
                x = torch.randn(4, 32, requires_grad=True)
                x2 = x.detach().clone().requires_grad_(True)
                gemms = {}
                for name, module, inp in (("ref", ref, x), ("ours", ours, x2)):
                    with FP8Gemms() as count:
                        out = module(inp)
                        out.float().pow(2).sum().backward()
                    gemms[name] = (out, inp.grad, count.count)
                assert torch.equal(gemms["ref"][0], gemms["ours"][0]) and torch.equal(gemms["ref"][1], gemms["ours"][1])
                assert (gemms["ref"][2], gemms["ours"][2]) == (3, 2), recipe
                assert ours.weight.grad is None
                casts.step()
        got = [(s.get("ref", 0), s.get("0", 0)) for s in casts.steps[:3]]
        # tensorwise: one cast at step 0 and one after the change; rowwise: two layouts, recast each step
        assert got == ([(2, 1), (2, 0), (2, 1)] if recipe == "tensorwise" else [(2, 2)] * 3), (recipe, got)


def test_lora_llama_single_process_casts_frozen_base_once():
    """strategy='none' (the weights held whole, autocast): each frozen base's FP8 weight is cast once over 3 steps;
    the trainable FP8 weight twice per step; losses and adapters == torchao without the frozen path."""
    torch.set_num_threads(1)
    model = _lora_llama()
    runs = {}
    for name, ctx in (("ours", contextlib.nullcontext), ("ref", _uncached)):
        with ctx():
            wrapped = wrap_model(copy.deepcopy(model), strategy="none", fp8="torchao")
        casts = _WeightCasts(wrapped)
        with casts.counting():
            losses = train_losses(wrapped, 0, 1, steps=STEPS, after_step=casts.step)
        adapters = {n: p.detach().clone() for n, p in wrapped.named_parameters() if "lora_" in n}
        runs[name] = dict(losses=losses, casts=casts.steps[:STEPS], adapters=adapters, model=wrapped)
    ours, ref = runs["ours"], runs["ref"]
    assert ours["losses"] == ref["losses"]
    assert ours["adapters"].keys() == ref["adapters"].keys() and \
        all(torch.equal(ours["adapters"][k], ref["adapters"][k]) for k in ref["adapters"])
    frozen_names = [n for n, m in ours["model"].named_modules() if isinstance(m, FrozenFloat8Linear)]
    trainable = [n for n in ours["casts"][0] if n.endswith(TRAINABLE)]
    assert len(frozen_names) == 12 and len(trainable) == 1 and trainable[0] not in frozen_names
    assert [sum(s.get(n, 0) for n in frozen_names) for s in ours["casts"]] == [12, 0, 0]  # once each, at step 0
    # torchao: forward and backward, but layer 0's k_proj and v_proj (inputs from frozen layers: no backward)
    assert [sum(s.get(n, 0) for n in frozen_names) for s in ref["casts"]] == [22] * STEPS
    assert [s[trainable[0]] for s in ours["casts"]] == [2] * STEPS
    assert all(p.grad is None for n, p in ours["model"].named_parameters()
               if not p.requires_grad), "a frozen weight gets no gradient"


def _fsdp_case(rank: int, world: int, recipe: str) -> dict:
    model = _lora_llama()
    out = {}
    for name, ctx in (("ours", contextlib.nullcontext), ("ref", _uncached)):
        with ctx():
            wrapped = wrap_model(copy.deepcopy(model), strategy="fsdp", fp8="torchao", torchao_recipe=recipe)
        trainable = {id(m.weight._local_tensor): m.weight.requires_grad for m in wrapped.modules()
                     if isinstance(m, Float8Linear)}
        tally = [{True: 0, False: 0, None: 0}]
        original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

        def counted(self, mesh):
            tally[-1][trainable.get(id(self))] += 1
            return original(self, mesh)

        shards = [m.weight._local_tensor for m in wrapped.modules() if isinstance(m, FrozenFloat8Linear)]
        kept = []

        def after_step():
            tally.append({True: 0, False: 0, None: 0})
            kept.append([s.__dict__["_fp8_shard"][1][0][0].data_ptr() for s in shards if "_fp8_shard" in s.__dict__])

        with _patched(WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", counted), FP8Gemms() as gemms:
            losses = train_losses(wrapped, rank, world, steps=STEPS, after_step=after_step)
            with torch.no_grad():  # frozen weights changed in place, as a load does: cast again, once
                for module in wrapped.modules():
                    if isinstance(module, Float8Linear) and not module.weight.requires_grad:
                        module.weight.mul_(0.5)
            with ctx():  # what the backend's after_load runs after a checkpoint load: the scales refreshed
                ao_backend._precompute(wrapped, None)
            losses += train_losses(wrapped, rank, world, steps=1, after_step=after_step)
        adapters = {n: p.detach().full_tensor() for n, p in wrapped.named_parameters() if "lora_" in n}
        grads = [n for n, p in wrapped.named_parameters() if not p.requires_grad and p.grad is not None]
        out[name] = dict(losses=losses, casts=tally[:STEPS + 1], kept=kept[:STEPS], adapters=adapters,
                         frozen=len(shards), grads=grads, gemms=gemms.count)
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp2_frozen_base_fp8_shard_is_cast_once(recipe):
    """FSDP2 on 2 ranks. Tensorwise (FP8 all-gather): each frozen base's FP8 shard is cast at the first all-gather
    and the same tensor is sent at every later one; the trainable FP8 weight's shard is cast at each all-gather
    (forward and the backward's re-gather); rowwise (bf16 all-gather): no shard casts. Both: no weight-gradient
    GEMM for a frozen weight (FP8 GEMMs counted), no gradient on it; losses and adapters == torchao without the
    frozen path."""
    for rank, r in enumerate(run_ranks(_fsdp_case, recipe)):
        ours, ref = r["ours"], r["ref"]
        assert ours["losses"] == ref["losses"], rank
        assert all(torch.equal(ours["adapters"][k], ref["adapters"][k]) for k in ref["adapters"])
        assert ours["grads"] == [] and ref["frozen"] == 0
        # no weight-gradient GEMM for the 10 frozen layers that run a backward (layer 0's k and v do not)
        assert ref["gemms"] - ours["gemms"] == 10 * (STEPS + 1)
        if recipe == "tensorwise":
            assert ours["frozen"] == 12
            assert [c[False] for c in ours["casts"]] == [12, 0, 0, 12]  # the last step: after the change
            assert [c[False] for c in ref["casts"]] == [24] * (STEPS + 1)
            assert [c[True] for c in ours["casts"]] == [c[True] for c in ref["casts"]] == [2] * (STEPS + 1)
            assert all(c[None] == 0 for c in ours["casts"] + ref["casts"])
            assert len(ours["kept"]) == STEPS and all(k == ours["kept"][0] for k in ours["kept"])
            assert len(ours["kept"][0]) == 12
        else:  # no FP8 all-gather: the weights gather in bf16 and are cast in the forward (not cached)
            assert ours["frozen"] == 12 and all(c == {True: 0, False: 0, None: 0} for c in ours["casts"])


def _engines_case(rank: int, world: int) -> dict:
    model = _lora_llama()
    out = {}
    for strategy in ("ddp", "fsdp1"):
        for name, ctx in (("ours", contextlib.nullcontext), ("ref", _uncached)):
            with ctx():
                wrapped = wrap_model(copy.deepcopy(model), strategy=strategy, fp8="torchao")
            casts = _WeightCasts(wrapped)
            with casts.counting(), FP8Gemms() as gemms:
                losses = train_losses(wrapped, rank, world, steps=STEPS, after_step=casts.step)
            names = [n for n, m in wrapped.named_modules() if isinstance(m, Float8Linear) and "lora_" not in n
                     and not n.endswith(TRAINABLE)]
            adapters = {n: p.detach().clone() for n, p in wrapped.named_parameters() if "lora_" in n}
            # "?": weights FSDP1 gathers into storage of its own, all counted there
            per_step = [sum(v for n, v in s.items() if n in names or n == "?") for s in casts.steps[:STEPS]]
            out[strategy, name] = dict(losses=losses, adapters=adapters, gemms=gemms.count, casts=per_step,
                                       frozen=sum(isinstance(m, FrozenFloat8Linear) for m in wrapped.modules()))
    return out


def test_ddp_and_fsdp1_frozen_base():
    """DDP on 2 ranks (each holds every weight): each frozen base's FP8 weight is cast once, at the first step.
    FSDP1: torchao's path, as ``frozen_weights`` says (its flat parameter requires a gradient as a whole, and so
    does the view each frozen weight is: measured here). Losses and adapters == torchao without the frozen path."""
    for rank, r in enumerate(run_ranks(_engines_case)):
        for strategy in ("ddp", "fsdp1"):
            ours, ref = r[strategy, "ours"], r[strategy, "ref"]
            assert ours["losses"] == ref["losses"], (rank, strategy)
            assert all(torch.equal(ours["adapters"][k], ref["adapters"][k]) for k in ref["adapters"])
            assert ref["frozen"] == 0
            if strategy == "ddp":
                assert ours["frozen"] == 12
                # no weight-gradient GEMM for the 10 frozen layers that run a backward (layer 0's k and v do not)
                assert ref["gemms"] - ours["gemms"] == 10 * STEPS
                assert (ours["casts"], ref["casts"]) == ([12, 0, 0], [22] * STEPS)
            else:  # FSDP1's flat parameters require a gradient as a whole, their views too: torchao's path, as said
                assert ours["frozen"] == 0 and ours["gemms"] == ref["gemms"] == 39 * STEPS  # 13 layers x 3 GEMMs
                assert ours["casts"] == ref["casts"] == [26] * STEPS  # each in the forward and the backward


@pytest.mark.parametrize("options, cached, gemm, words", [
    (dict(strategy="fsdp"), 1, False, "FP8 shard cast once"),
    (dict(strategy="ddp"), 1, False, "FP8 weight cast once"),
    (dict(strategy="none"), 1, False, "FP8 weight cast once"),
    (dict(strategy="fsdp", torchao_recipe="rowwise"), 0, False, "two layouts"),
    (dict(strategy="fsdp", fp8_all_gather=False), 0, False, "unsharded FP8 copy on every rank"),
    (dict(strategy="fsdp1"), 0, True, "a view of a flat parameter that needs a gradient"),
    (dict(strategy="deepspeed"), 0, False, "the engine manages the parameters"),
    (dict(strategy="ddp", torchao_api="weight_wrapper"), 0, True, "weight wrapper casts a frozen weight every step"),
])
def test_frozen_weights_say_what_a_frozen_base_costs(options, cached, gemm, words):
    """What the estimate and the report read: bytes per element of the kept FP8 copy (and its fp32 scale), whether
    the weight-gradient GEMM still runs, and why a frozen weight is recast where it is."""
    from fp8dist.config.resolve import resolve_config
    from fp8dist.config.rules import facts_of
    from fp8dist.fp8 import NO_FP8, get_backend

    cfg = resolve_config(fp8="torchao", **options)
    got = get_backend("torchao").frozen_weights(cfg, facts_of(cfg, 2))
    assert (got.cached_bytes, got.scale_bytes, got.grad_weight_gemm) == (cached, 4 * cached, gemm)
    assert words in got.how
    assert NO_FP8.frozen_weights(cfg, facts_of(cfg, 2)).cached_bytes == 0  # the default: as a trainable weight


def _hand_frozen(strategy: str, seed: int = 0):
    """Tiny Llama with its attention projections frozen by hand (no PEFT: any Linear whose weight needs no
    gradient), wrapped with torchao, and its optimizer."""
    model = build_llama("tiny", seed=seed)
    for name, param in model.named_parameters():
        param.requires_grad_(not name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")))
    wrapped = wrap_model(model, strategy=strategy, fp8="torchao")
    return wrapped, torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)


def _resume_case(rank: int, world: int, root: str) -> dict:
    from fp8dist import load_checkpoint, save_checkpoint
    from helpers import optimizer_losses

    out = {}
    for strategy in ("fsdp", "ddp"):
        model, opt = _hand_frozen(strategy)
        straight = optimizer_losses(model, opt, rank, world, 2)
        save_checkpoint(f"{root}/{strategy}", model, opt, step=2)
        straight += optimizer_losses(model, opt, rank, world, 2, start=2)
        model, opt = _hand_frozen(strategy, seed=1)  # other frozen weights, cast and kept: the load must replace them
        optimizer_losses(model, opt, rank, world, 1, start=5)
        state = load_checkpoint(f"{root}/{strategy}", model, opt)
        resumed = optimizer_losses(model, opt, rank, world, 2, start=state.step)
        out[strategy] = dict(straight=straight[2:], resumed=resumed,
                             frozen=sum(isinstance(m, FrozenFloat8Linear) for m in model.modules()))
    return out


def test_frozen_base_checkpoint_resumes_exactly(tmp_path):
    """FSDP2 (FP8 shards kept) and DDP (FP8 weights kept), on 2 ranks, attention frozen by hand: a run resumed
    from a checkpoint into a model of other weights, whose frozen casts are already kept, repeats the straight
    run's losses exactly: the load's in-place copy makes the frozen weights cast again."""
    for rank, r in enumerate(run_ranks(_resume_case, str(tmp_path))):
        for strategy in ("fsdp", "ddp"):
            assert r[strategy]["frozen"] == 7, strategy  # 8 projections but the first Linear (kept high precision)
            assert r[strategy]["resumed"] == r[strategy]["straight"], (rank, strategy)
