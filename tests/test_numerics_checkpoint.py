"""Acting on measured numerics without losing the run, on 2 real gloo ranks (fsdp + torchao): train with every
eligible layer in FP8, checkpoint, probe the exported weights, resume with the probe's exclusions (and the reverse:
a bf16 run resumed in FP8); the state loads exactly and the losses go on where the uninterrupted run's do. The
same spawn samples FP8Telemetry under fsdp and checks its reduced record against each rank's own numbers.

One spawn runs every case (a spawn costs seconds here)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from helpers import optimizer_losses

import fp8dist
from fp8dist import load_checkpoint, save_checkpoint, save_pretrained, wrap_model
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

pytest.importorskip("torchao", reason="torchao is not installed")

SAVED_AT, AFTER = 3, 2
BAD = "model.layers.1.mlp.down_proj"
WATCHED = "model.layers.0.mlp.up_proj"
# one layer's GEMMs in bf16 instead of FP8 (or FP8 instead of bf16 everywhere), the same weights: the loss moves by
# less than this (largest gap measured over the 2 steps after loading: 1.3e-3 one layer, 2.6e-3 all layers)
PLAN_TOL = 5e-3


def _build(fp8: str | None, exclude: list[str] = ()):
    model = wrap_model(build_llama("tiny", seed=0), strategy="fsdp", fp8=fp8, keep_first_last_linear=False,
                       fp8_exclude=list(exclude))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.to_local() if hasattr(t, "to_local") else t
    return getattr(t, "_tensor", t).detach().clone()  # torchao's FP8 all-gather wrapper holds the weight


def _state(model, opt) -> dict[str, list[torch.Tensor]]:
    """Every parameter's shard and its AdamW moments, by name."""
    inner = fp8dist.unwrap_model(model)
    return {name: [_local(p)] + [_local(opt.state[p][k]) for k in ("exp_avg", "exp_avg_sq")]
            for name, p in inner.named_parameters()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))


def _probe_exclusions(rank: int, export: str) -> list[str]:
    """Rank 0 probes the exported weights (a meta model filled from pretrained=) with an outlier channel planted
    in one layer's input; every rank gets its exclusions."""
    answer = [None]
    if rank == 0:
        with torch.device("meta"):
            model = build_llama("tiny")

        def outlier(module, args):
            x = args[0].clone()
            x[..., 5] = 1e5
            return (x,)

        model.get_submodule(BAD).register_forward_pre_hook(outlier)
        batches = [Batches(batch_size=4, seq_len=64, seed=1)[0]]
        answer = [fp8dist.measure_fp8_numerics(model, batches, fp8="torchao", pretrained=export,
                                               keep_first_last_linear=False).recommended_exclude]
    dist.broadcast_object_list(answer, src=0)
    return answer[0]


def _telemetry_by_hand(model) -> tuple[list, list]:
    """What each rank's WATCHED layer sees in the next step: its input and output gradient."""
    inputs, grads = [], []

    def hook(module, args, out):
        inputs.append(args[0].detach().clone())
        out.register_hook(lambda g: grads.append(g.detach().clone()))

    handle = fp8dist.unwrap_model(model).get_submodule(WATCHED).register_forward_hook(hook)
    return (inputs, grads), handle


def _cast_counts(x: torch.Tensor, amax: float, dtype: torch.dtype) -> tuple[int, int]:
    """Non-zero values of ``x`` and those that flush to zero under the scale fp8 max / ``amax``."""
    fmax = torch.finfo(dtype).max
    scale = (fmax / torch.tensor(amax, dtype=torch.float64)).float()
    q = (x.float() * scale).clamp(-fmax, fmax).to(dtype)
    return int((x != 0).sum()), int(((x != 0) & (q.float() == 0)).sum())


def _ranks(rank: int, world: int, tmp: str) -> dict:
    from fp8dist.numerics.telemetry import FP8Telemetry

    torch.set_num_threads(1)
    out = {}
    # 1. every eligible layer in FP8, 3 steps, checkpoint; then uninterrupted, with telemetry on its steps 0, 2
    a, opt_a = _build("torchao")
    out["fp8_layers"] = len(fp8dist.get_plan(a).fp8)
    losses_a = optimizer_losses(a, opt_a, rank, world, SAVED_AT)
    save_checkpoint(f"{tmp}/fp8", a, opt_a, step=SAVED_AT)
    saved_a = _state(a, opt_a)
    save_pretrained(a, f"{tmp}/export")
    out["exclude"] = _probe_exclusions(rank, f"{tmp}/export")
    telemetry = FP8Telemetry(a, every=3, step=SAVED_AT)
    (inputs, grads), handle = _telemetry_by_hand(a)
    losses_a += optimizer_losses(a, opt_a, rank, world, 1, start=SAVED_AT)
    handle.remove()
    telemetry.step()
    out["hooks_between_samples"] = len(telemetry._handles)
    losses_a += optimizer_losses(a, opt_a, rank, world, 1, start=SAVED_AT + 1)
    out["telemetry"] = telemetry.records
    out["by_hand"] = [(float(t.abs().max()), t) for t in (inputs[0], grads[0])]
    # 2. resumed with the probe's exclusions
    b, opt_b = _build("torchao", out["exclude"])
    out["b_fp8_layers"] = len(fp8dist.get_plan(b).fp8)
    out["b_step"] = load_checkpoint(f"{tmp}/fp8", b, opt_b).step
    out["b_exact"] = _same(saved_a, _state(b, opt_b))
    losses_b = optimizer_losses(b, opt_b, rank, world, AFTER, start=SAVED_AT)
    # 3. the reverse: bf16 for 3 steps, resumed with every eligible layer in FP8
    c, opt_c = _build(None)
    losses_c = optimizer_losses(c, opt_c, rank, world, SAVED_AT)
    save_checkpoint(f"{tmp}/bf16", c, opt_c, step=SAVED_AT)
    saved_c = _state(c, opt_c)
    losses_c += optimizer_losses(c, opt_c, rank, world, AFTER, start=SAVED_AT)
    d, opt_d = _build("torchao")
    load_checkpoint(f"{tmp}/bf16", d, opt_d)
    out["d_exact"] = _same(saved_c, _state(d, opt_d))
    losses_d = optimizer_losses(d, opt_d, rank, world, AFTER, start=SAVED_AT)
    out.update(a=losses_a, b=losses_b, c=losses_c, d=losses_d)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_ranks, str(tmp_path_factory.mktemp("numerics")), world_size=2)


def test_a_per_layer_plan_change_loads_exactly_and_training_goes_on(ranks):
    r0, r1 = ranks
    assert r0["exclude"] == r1["exclude"] == [BAD]  # the probe found the planted layer, and only it
    assert r0["b_fp8_layers"] == r0["fp8_layers"] - 1 == 14  # 15 Linears in FP8 before, all but BAD after
    for r in (r0, r1):
        assert r["b_step"] == SAVED_AT and r["b_exact"] and r["d_exact"]  # weights and AdamW moments, bit for bit
        resumed_fp8 = [abs(x - y) for x, y in zip(r["b"], r["a"][SAVED_AT:])]
        resumed_bf16 = [abs(x - y) for x, y in zip(r["d"], r["c"][SAVED_AT:])]
        assert max(resumed_fp8) < PLAN_TOL and max(resumed_bf16) < PLAN_TOL, (resumed_fp8, resumed_bf16)
        assert r["b"][0] < r["a"][0] - 0.1 and r["d"][0] < r["c"][0] - 0.1  # resumed, not restarted


def test_telemetry_under_fsdp_reduces_what_each_rank_measures_by_hand(ranks):
    r0, r1 = ranks
    assert r0["telemetry"] == r1["telemetry"] and len(r0["telemetry"]) == 1  # steps 3 and 4: 3 sampled (every 3)
    assert r0["hooks_between_samples"] == 0  # step 4 is not sampled: no hook runs
    record = r0["telemetry"][0]
    assert record["step"] == SAVED_AT
    watched = record["layers"][WATCHED]
    for i, (role, dtype) in enumerate((("input", torch.float8_e4m3fn), ("grad_output", torch.float8_e5m2))):
        amaxes = [r["by_hand"][i][0] for r in ranks]
        assert watched[role]["amax"] == max(amaxes)  # one MAX over the ranks
        # each rank casts its own activations with its own amax (torchao reduces no activation amax)
        counts = [_cast_counts(r["by_hand"][i][1], amax, dtype) for r, amax in zip(ranks, amaxes)]
        assert watched[role]["flushed_share"] == sum(f for _, f in counts) / sum(n for n, _ in counts)
        fmax = torch.finfo(dtype).max
        assert watched[role]["scale"] == pytest.approx(fmax / max(amaxes), rel=1e-6)
    assert watched["weight"]["amax"] > 0 and watched["weight"]["flushed_share"] is not None
