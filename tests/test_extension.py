"""A new engine is one file: a sharding strategy, an FP8 backend and a memory level defined here alone (subclasses
of fp8dist's public ``Strategy``, ``FP8Backend`` and ``MemoryLevel``), registered through the public registries,
run through everything a user touches — ``wrap_model``, training steps, ``no_sync`` and ``clip_grad_norm_``,
``save_checkpoint`` / ``load_checkpoint``, the precision report, the memory estimate, the plan and the CLI's choices
(``plan``, ``bench``), a backend knob as a keyword and a flag — with no edit to any fp8dist module.

- The strategy is torch's composable ``replicate`` (DDP without a wrapper module: the model stays itself), the one
  the issue names as the next engine; its losses must equal the same engine wired by hand.
- The backend runs every converted Linear's forward GEMM as a real FP8 GEMM (``torch._scaled_mm`` on e4m3 operands
  with per-tensor scales, as on a GPU), gradients in the compute dtype; a counter proves the FP8 GEMMs ran.
- The memory level builds the optimizer itself (plain SGD: no optimizer state, as the estimate then says) and
  records that it saw the model before and after conversion.

Registration happens inside the rank processes (and a child process for the CLI), so the suite's own registries
never see these values.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_harness import run_ranks

HERE = Path(__file__).parent
GEMMS = {"fp8": 0}
"""FP8 GEMMs run in this process (the backend's proof that it ran FP8)."""
CALLS: list[str] = []
"""What the memory level was asked, in order."""
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


# ---------------------------------------------------------------------------------------------- the FP8 backend
def _to_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (t.detach().abs().amax().float().clamp(min=1e-12) / E4M3_MAX)
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


class _FP8Matmul(torch.autograd.Function):
    """``x @ w.T`` as one FP8 GEMM forward; the gradients in the compute dtype."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        x8, sx = _to_e4m3(x.reshape(-1, x.shape[-1]))
        w8, sw = _to_e4m3(w)
        out = torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)
        GEMMS["fp8"] += 1
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = (g2 @ w.to(grad.dtype)).reshape(x.shape)
        grad_w = (g2.t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(w.dtype)
        return grad_x, grad_w


class ScaledLinear(nn.Linear):
    """An nn.Linear whose forward GEMM runs in FP8."""

    def forward(self, x):
        out = _FP8Matmul.apply(x, self.weight.to(x.dtype) if x.dtype != self.weight.dtype else self.weight)
        return out + self.bias.to(out.dtype) if self.bias is not None else out


def define_axes():
    """The three new axis values, registered; returns them."""
    from fp8dist import FP8Backend, MemoryLevel, Strategy, register_backend, register_level, register_strategy
    from fp8dist.config.axis import StrategyFacts
    from fp8dist.strategies import Sharded, ShardingInfo

    class Scaled(FP8Backend):
        name = "scaled"

        @dataclass(kw_only=True, frozen=True)
        class Config:
            scaled_margin: int = 0
            """A knob of this backend alone: its conversion records it."""

        def hardware_reason(self, cfg, hardware):
            return None  # torch._scaled_mm runs FP8 GEMMs on a CPU too

        def converted_class(self, module, cfg, hardware):
            return "ScaledLinear"

        def convert(self, model, plan, cfg):
            names, GEMMS["margin"] = {e.name for e in plan.fp8}, cfg.precision.knobs("scaled").scaled_margin
            for fqn, module in model.named_modules():
                if fqn in names:
                    module.__class__ = ScaledLinear  # same parameters, an FP8 forward

    class Replicate(Strategy):
        """torch's composable replicate: DDP's all-reduce on the model itself, no wrapper module."""

        name = "replicate"

        def facts(self, cfg, world_size=None):
            return StrategyFacts(autocast_forward=True, broadcasts_weights=True,
                                 shard_degree=None if world_size is None else 1)

        def shard(self, model, job):
            from torch.distributed._composable import replicate

            model.to(job.env.device)
            replicate(model)
            forward = model.forward
            model.forward = lambda x: _autocast(forward, x)  # fp32 parameters, bf16 compute (the default)
            return Sharded(model, ShardingInfo(self.name, (), "replicated (composable replicate)",
                                               autocast=torch.bfloat16))

    class SGDLevel(MemoryLevel):
        name = "sgd"
        summary = "plain SGD, built by the level: no optimizer states"
        builds_optimizer = True
        estimate_optimizer = "sgd"

        def before_convert(self, model):
            CALLS.append("before_convert")

        def after_convert(self, model):
            CALLS.append("after_convert")

        def build_optimizer(self, spec, params, device):
            CALLS.append("build_optimizer")
            return torch.optim.SGD(list(params), lr=spec["lr"])

    return register_strategy(Replicate()), register_backend(Scaled()), register_level(SGDLevel())


# ------------------------------------------------------------------------------------------------- the run
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 64))


def _batches(rank: int, steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(8, 64, generator=g) for _ in range(steps)]


def _train(model, opt, rank) -> list[float]:
    losses = []
    for x in _batches(rank):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _hand_wired(rank: int) -> list[float]:
    """The same engine and FP8 GEMMs wired by hand: replicate, the Linears swapped, SGD, autocast bf16."""
    from torch.distributed._composable import replicate

    model = _model()
    for m in model:
        if isinstance(m, nn.Linear):
            m.__class__ = ScaledLinear
    replicate(model)
    forward = model.forward
    model.forward = lambda x: _autocast(forward, x)
    return _train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank)


def _autocast(forward, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return forward(x)


def _rank(rank: int, world: int, ckpt: str) -> dict:
    import fp8dist

    strategy, backend, level = define_axes()
    hand = _hand_wired(rank)
    GEMMS["fp8"] = 0
    CALLS.clear()
    model, opt = fp8dist.wrap_model(_model(), strategy="replicate", fp8="scaled", memory="sgd", scaled_margin=1,
                                    optimizer={"type": "SGD", "lr": 0.1}, check_ranks="off")
    plan = fp8dist.get_plan(model)
    losses = _train(model, opt, rank)
    out = {"hand": hand, "ours": losses, "gemms": GEMMS["fp8"], "margin": GEMMS["margin"], "calls": list(CALLS),
           "opt": type(opt).__name__,
           "plan_fp8": [e.name for e in plan.fp8], "plan_backend": plan.backend, "plan_strategy": plan.strategy,
           "classes": sorted({type(m).__name__ for m in model.modules()})}
    with fp8dist.no_sync(model, last=False):  # the base's answer: nothing to skip, every micro-batch reduced
        model(_batches(rank)[0]).float().pow(2).mean().backward()
    out["norm"] = fp8dist.clip_grad_norm_(model, 1e-3).item()
    out["norm_by_hand"] = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    opt.zero_grad()
    saved = fp8dist.save_checkpoint(ckpt, model, opt, step=3)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = fp8dist.load_checkpoint(saved, model, opt)
    out["restored"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    out["step"] = state.step
    rep = fp8dist.report(model, opt)
    out["report"] = str(rep)
    est = fp8dist.estimate_memory(_model(), strategy="replicate", fp8="scaled", memory="sgd", world_size=world,
                                  micro_batch_size=8, seq_len=1)
    out["estimate"], out["estimate_bytes"], out["estimate_dtypes"] = str(est), est.bytes, est.dtypes
    dist.barrier()
    return out


def test_a_new_strategy_backend_and_memory_level_run_through_everything(tmp_path):
    results = run_ranks(_rank, str(tmp_path / "ckpt"), world_size=2)
    for rank, r in enumerate(results):
        assert r["ours"] == r["hand"], rank  # the same engine wired by hand: equal losses, step for step
        assert r["plan_strategy"] == "replicate" and r["plan_backend"] == "scaled"
        assert r["plan_fp8"] == ["0", "2", "4"]  # the three Linears, none kept out by a rule it does not have
        assert r["gemms"] == 3 * 3  # three steps x three FP8 forward GEMMs: the plan's FP8 ran FP8
        assert r["margin"] == 1  # the backend's own knob, given as a wrap_model keyword, reached its conversion
        assert "ScaledLinear" in r["classes"]
        assert r["calls"] == ["before_convert", "after_convert", "build_optimizer"] and r["opt"] == "SGD"
        assert r["restored"] and r["step"] == 3
        assert "replicate" in r["report"]
        assert "replicate" in r["estimate"] and "scaled" in r["estimate"]
        numel = sum(p.numel() for p in _model().parameters())
        # replicated (the strategy's default layout), fp32 weights and gradients, no optimizer state (the level's)
        assert r["estimate_bytes"]["parameters"] == r["estimate_bytes"]["gradients"] == 4 * numel
        assert r["estimate_bytes"]["optimizer_states"] == 0 and r["estimate_dtypes"]["optimizer_states"] == "none"
    assert results[0]["norm"] == results[1]["norm"] > 1e-3  # the all-reduced gradients' norm, before clipping
    assert all(abs(r["norm_by_hand"] - 1e-3) < 1e-6 for r in results)  # ... and clipped to 1e-3 on every rank
    assert results[0]["ours"] != results[1]["ours"]  # each rank its own batches, one model: gradients all-reduced


def test_the_cli_lists_registered_values_among_its_choices():
    """``fp8dist plan --help`` in a process where the three values are registered lists them as choices of
    --strategy, --fp8 and --memory; ``fp8dist bench --help`` among the strategies and backends it runs."""
    code = ("import sys; sys.path.insert(0, %r); import test_extension as t; t.define_axes(); "
            "from fp8dist.cli import main; main(sys.argv[1:])" % str(HERE))
    shown = subprocess.run([sys.executable, "-c", code, "plan", "--help"], capture_output=True, text=True,
                           check=True).stdout
    flat = " ".join(shown.split())
    assert "--strategy {none,ddp,fsdp,fsdp1,deepspeed,replicate}" in flat
    assert "--fp8 {te,torchao,msamp,scaled,none}" in flat
    assert "--memory {standard,lean,sgd}" in flat
    assert "--scaled-margin N" in flat  # the new backend's own knob is a flag
    bench = subprocess.run([sys.executable, "-c", code, "bench", "--help"], capture_output=True, text=True,
                           check=True).stdout
    flat = " ".join(bench.split())
    assert "from none, ddp, fsdp, fsdp1, deepspeed, replicate" in flat and "msamp, scaled;" in flat


def test_a_registration_that_cannot_work_is_refused_with_the_way_out():
    """Nothing is registered by these (the registries of this process stay as they were)."""
    from fp8dist import FP8Backend, Strategy, register_backend, register_strategy
    from fp8dist.config.axis import STRATEGIES

    before = STRATEGIES.names()

    class Fsdp(Strategy):
        name = "fsdp"

    class Nameless(Strategy):
        pass

    class NoFP8(FP8Backend):
        name = "none"

    cases = [(lambda: register_strategy(Fsdp()), ValueError, "strategy='fsdp' is already a sharding strategy (FSDP2)"),
             (lambda: register_strategy(Fsdp), TypeError, "pass an instance of"),
             (lambda: register_strategy(object()), TypeError, "subclass fp8dist's Strategy"),
             (lambda: register_strategy(Nameless()), ValueError, "needs a name"),
             (lambda: register_backend(NoFP8()), ValueError, "not 'none'")]
    for call, error, text in cases:
        with pytest.raises(error, match=None) as caught:
            call()
        assert text in str(caught.value), str(caught.value)
    assert STRATEGIES.names() == before


# ------------------------------------------- a backend with its own speed recipes and its own cast emulation
def _fused(passes: float) -> tuple:
    """One operand's cast kernels: ``passes`` bytes read + written per element, the first pass in its producer."""
    from fp8dist.fp8.speed_recipe import kernels

    return kernels(0, passes, fused_first=True)


class GridCast:
    """The new backend's own cast emulation (no scaling kind fp8dist knows): a uniform grid of ``2 ** bits`` steps
    per tensor amax, nearest rounding; nothing clamps. A :class:`fp8dist.fp8.casts.CastEmulation`."""

    per_dim, fp4 = False, False

    def __init__(self, bits: int) -> None:
        self.bits, self.floored = bits, None

    def describe(self) -> str:
        return f"grid of 2^{self.bits} per amax"

    def emulator(self) -> GridCast:
        return GridCast(self.bits)

    def __call__(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = x.abs().amax().clamp(min=1e-30) / 2 ** self.bits
        return torch.round(x / step) * step, torch.zeros_like(x, dtype=torch.bool)


def define_casted():
    """A backend declaring two speed recipes (its casts fused into their producers, or three extra passes over each
    operand) and its own cast emulation, a knob choosing each; returns the backend class."""
    from fp8dist import FP8Backend
    from fp8dist.fp8 import SELECTION_OPTIONS, HealthCasts
    from fp8dist.fp8.casts import USES, CastSpec
    from fp8dist.fp8.speed_recipe import Recipe

    class Casted(FP8Backend):
        name = "casted"
        options = SELECTION_OPTIONS  # fp8_select, its margin and the tokens, as every backend with a speed model
        speed_recipes = tuple(Recipe(f"casted_{kind}", f"casted, {kind} casts", (True, True, True),
                                     compiled=(_fused(passes),) * 3, eager=(_fused(passes),) * 3)
                              for kind, passes in (("fused", 1), ("slow", 24)))

        @dataclass(kw_only=True, frozen=True)
        class Config:
            casted_kernels: str = "fused"
            """Which of its speed recipes it runs (casted_fused or casted_slow)."""
            casted_bits: int = 3
            """Grid steps per amax, as a power of 2, of its casts."""

        def hardware_reason(self, cfg, hardware):
            return None  # plans for any target, and probes on this CPU

        def speed_recipe(self, cfg, hardware, *, grouped=False):
            return f"casted_{cfg.precision.knobs('casted').casted_kernels}", ""

        def numerics_casts(self, cfg, facts, hardware, *, grouped=False):
            return {use: GridCast(cfg.precision.knobs("casted").casted_bits) for use in USES}

        def health_casts(self, module):
            """Its layers stay nn.Linear (it converts nothing): sampled as e4m3 tensorwise, gradients e5m2."""
            if type(module) is not nn.Linear:
                return None
            e4m3, e5m2 = CastSpec(torch.float8_e4m3fn, "tensorwise"), CastSpec(torch.float8_e5m2, "tensorwise")
            return HealthCasts(input=e4m3, weight=e4m3, grad_output=e5m2)

    return Casted


@pytest.fixture
def casted(monkeypatch):
    """The backend registered for this test only: the registry's table is a copy, put back after."""
    from fp8dist.config.axis import BACKENDS

    BACKENDS.names()  # the built-ins registered first
    monkeypatch.setattr(BACKENDS, "_values", dict(BACKENDS._values))
    monkeypatch.setattr(BACKENDS, "_known", {name: dict(known) for name, known in BACKENDS._known.items()})
    from fp8dist import register_backend

    return register_backend(define_casted()())


def test_a_backend_s_own_speed_recipe_and_cast_emulation_drive_the_plan_the_probe_and_the_cli(casted, capsys):
    """``fp8_select="auto"`` for an H100 decides each Linear by the backend's own recipe (its numbers, not a
    built-in's: fused casts pay on every Linear of the medium Llama at 65,536 tokens, the slow ones on none), the
    probe measures the backend's own casts (the SQNR its grid gives, 6 dB a bit), FP8Telemetry samples its layers
    through its health_casts, and ``fp8dist plan`` / ``estimate`` run with it. In-process; 4.6 s measured here (2
    shared cores at load 5; 13.6 s at load 18)."""
    import fp8dist
    from fp8dist.cli import main
    from fp8dist.plan.speed import predict_linear
    from fp8dist.runtime.hardware import TARGETS
    from fp8dist.train.models import build_llama

    with torch.device("meta"):
        model = build_llama("medium")
    linears = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    tokens, fp8 = 32 * 2048, {}
    for kind in ("fused", "slow"):
        cfg = fp8dist.resolve_config(fp8="casted", fp8_select="auto", casted_kernels=kind, micro_batch_size=32,
                                     seq_len=2048)
        plan = fp8dist.plan_precision(model, cfg, device=TARGETS["h100"])
        compile = next(e for e in plan if e.predicted).predicted[0].compile
        expected = {n: predict_linear(tokens, k, m, target="h100", recipe=f"casted_{kind}", compile=compile).speedup
                    for n, (k, m) in linears.items()}
        assert {e.name: e.predicted[0].recipe for e in plan if e.predicted} == dict.fromkeys(linears, f"casted_{kind}")
        assert {e.name: round(e.speedup, 9) for e in plan if e.predicted} == {n: round(s, 9) for n, s in expected.items()}
        fp8[kind] = {e.name for e in plan.fp8}
        assert fp8[kind] == {n for n, s in expected.items() if s >= 1}
    assert fp8["fused"] == set(linears) and fp8["slow"] == set()  # the recipe's numbers alone move the decision

    measured = {}
    for bits in (3, 7):
        tiny, batch = build_llama("tiny", seed=0), torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        report = fp8dist.measure_fp8_numerics(tiny, [batch], fp8="casted", casted_bits=bits, fp8_exclude=["lm_head"])
        seen = {}
        first = report.layers[0]
        handle = tiny.get_submodule(first.name).register_forward_hook(lambda m, a, o: seen.setdefault("x", a[0]))
        tiny(input_ids=batch, labels=batch)
        handle.remove()
        x = seen["x"].detach().reshape(-1, seen["x"].shape[-1]).float()  # as the probe casts it
        back, _ = GridCast(bits).emulator()(x, -1)
        own = 10 * torch.log10(x.double().square().sum() / (x.double() - back.double()).square().sum()).item()
        cast = next(c for c in first.casts if c.role == "input")
        assert cast.cast == f"grid of 2^{bits} per amax"  # its describe(), in the report
        assert cast.sqnr_db == pytest.approx(own, rel=1e-9), (cast.sqnr_db, own)  # measured: its own emulation's
        measured[bits] = cast.sqnr_db
    assert 4 * 6.02 - 2 < measured[7] - measured[3] < 4 * 6.02 + 2  # four more bits: ~24 dB (measured 23.9)

    from fp8dist.numerics import FP8Telemetry

    torch.manual_seed(0)
    wrapped = fp8dist.wrap_model(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), strategy="none",
                                 fp8="casted", check_ranks="off")
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    telemetry, x = FP8Telemetry(wrapped, every=1, optimizer=opt), torch.randn(8, 32)
    wrapped(x).float().pow(2).mean().backward()
    opt.step()
    assert casted.health_telemetry and set(telemetry.records[0]["layers"]) == {"0", "2"}
    assert telemetry.records[0]["layers"]["0"]["input"]["amax"] == pytest.approx(x.abs().max().item(), rel=1e-6)
    telemetry.close()

    flags = ["--model-size", "medium", "--target", "h100", "--fp8", "casted", "--micro-batch-size", "32",
             "--seq-len", "2048"]
    assert main(["plan", *flags, "--fp8-select", "auto", "--casted-kernels", "slow"]) == 0
    out = capsys.readouterr().out
    assert "casted_slow" in out and "fp8=casted" in out.replace("'", ""), out
    assert main(["estimate", *flags, "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "casted" in out, out
