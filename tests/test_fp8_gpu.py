"""Real FP8 on a CUDA GPU: torchao, Transformer Engine and MS-AMP, each where installed. Skipped, with the reason,
on machines without them (CI has no GPU): a skip here is never a pass."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from dist_harness import run_ranks

from fp8dist.config.resolve import resolve_config
from fp8dist.train.job import TrainConfig, run_training

pytestmark = pytest.mark.gpu

# mean of the last 5 of 40 steps, FP8 vs bf16, small Llama: measured 0.0071 on a CPU, where torchao's casts are the
# same arithmetic (same job, strategy none, 2026-11-24); not yet measured on a GPU: about twice the CPU gap, to be
# set from the first GPU run's figure
FP8_LOSS_TOLERANCE = 0.015


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)


needs_fp8_gpu = pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _needs(package: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed")


# FP8's numerics and wiring, not its speed: every eligible layer in FP8 (on a GPU, fp8_select's default 'auto'
# keeps these small models' layers in bf16, predicted slower there)
ALL = {"fp8_select": "all"}


def _losses(fp8: str | None, strategy: str = "none", **options) -> list[float]:
    job = TrainConfig(model_size="small", steps=40, seq_len=256, batch_size=8)
    options = {**(ALL if fp8 in ("torchao", "te") else {}), **options}
    return run_training(resolve_config(strategy=strategy, fp8=fp8, **options), job, log=lambda line: None).losses


def _close_to_bf16(fp8: str) -> None:
    bf16, ours = _losses(None), _losses(fp8)
    assert ours != bf16
    assert abs(sum(ours[-5:]) / 5 - sum(bf16[-5:]) / 5) < FP8_LOSS_TOLERANCE


@needs_fp8_gpu
def test_torchao_real_fp8_tracks_bf16():
    _close_to_bf16("torchao")


@needs_fp8_gpu
@_needs("transformer_engine")
def test_transformer_engine_real_fp8_tracks_bf16():
    _close_to_bf16("te")


def _te_amax_case(rank: int, world: int) -> list[torch.Tensor]:
    import transformer_engine.pytorch as te

    from fp8dist import wrap_model
    from fp8dist.train.data import Batches
    from fp8dist.train.models import build_llama

    model = wrap_model(build_llama("small", seed=0), strategy="ddp", fp8="te", **ALL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = Batches(batch_size=8, seq_len=128, rank=rank, world_size=world)[0].cuda()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    states = []
    for module in model.module.modules():
        if isinstance(module, te.Linear):
            meta = module.fp8_meta["scaling_fwd"]
            states += [meta.scale.detach().cpu(), meta.amax_history.detach().cpu()]
    return states


@needs_fp8_gpu
@needs_two
@_needs("transformer_engine")
def test_transformer_engine_amax_and_scales_identical_across_ranks():
    """The amax reduction over the world group makes every rank's FP8 scales identical after a step."""
    first, second = run_ranks(_te_amax_case, backend="nccl")
    assert first and all(torch.equal(a, b) for a, b in zip(first, second))


@needs_fp8_gpu
@_needs("msamp")
def test_msamp_real_fp8_trains():
    losses = _losses("msamp", opt_level="O2")
    assert losses[-1] < losses[0] - 1.0


# ---- written without a GPU (2026-11-23) for the first session that has one (issue 18): run, fix, keep

def _te_resume_case(rank: int, world: int, root: str) -> dict:
    import fp8dist
    from fp8dist.train.models import build_llama
    from helpers import optimizer_losses

    model = fp8dist.wrap_model(build_llama("small", seed=0), strategy="fsdp", fp8="te", **ALL)
    device = fp8dist.get_wrap_info(model).env.device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer_losses(model, opt, rank, world, 3, device=device, seq_len=256)
    fp8dist.save_checkpoint(root, model, opt, step=3)
    expected = optimizer_losses(model, opt, rank, world, 2, start=3, device=device, seq_len=256)
    fresh = fp8dist.wrap_model(build_llama("small", seed=1), strategy="fsdp", fp8="te", **ALL)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fp8dist.load_checkpoint(root, fresh, fresh_opt)
    return dict(expected=expected,
                resumed=optimizer_losses(fresh, fresh_opt, rank, world, 2, start=3, device=device, seq_len=256))


@needs_fp8_gpu
@_needs("transformer_engine")
def test_transformer_engine_fsdp2_checkpoint_resumes_bit_exact(tmp_path):
    """Real TE under FSDP2: a checkpoint after 3 steps (weights, AdamW, TE's _extra_state: scales and amax
    history) resumes to the same next two losses as the run that went on."""
    import json

    for result in run_ranks(_te_resume_case, str(tmp_path / "ckpt"), world_size=1, backend="nccl", timeout=600):
        assert result["resumed"] == result["expected"]
    meta = json.loads(next((tmp_path / "ckpt").glob("step_*/meta.json")).read_text())
    assert meta["fp8_state"], "TE's FP8 state (_extra_state) is in the checkpoint"


def _moe_case(rank: int, world: int, fp8: str | None) -> dict:
    import fp8dist
    from helpers import optimizer_losses
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2)
    model = fp8dist.wrap_model(MixtralForCausalLM(config), strategy="fsdp", fp8=fp8, **(ALL if fp8 else {}))
    plan = fp8dist.get_plan(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = optimizer_losses(model, opt, rank, world, 30, device=fp8dist.get_wrap_info(model).env.device,
                              seq_len=256)
    experts = [e for e in plan if e.grouped]
    return dict(losses=losses, experts=[(e.precision, e.converted_to) for e in experts])


@needs_fp8_gpu
@_needs("torchao")
def test_mixtral_experts_fp8_rowwise_grouped_gemms_track_bf16():
    """torchao_moe_recipe='auto' on sm_90: the experts run torchao's FP8 rowwise grouped GEMMs (real FP8, not
    the CPU's emulation); the last 5 of 30 losses within FP8_LOSS_TOLERANCE of bf16."""
    if torch.cuda.get_device_capability(0) < (9, 0):
        pytest.skip("FP8 rowwise grouped GEMMs need sm_90")
    (bf16,) = run_ranks(_moe_case, None, world_size=1, backend="nccl", timeout=600)
    (ours,) = run_ranks(_moe_case, "torchao", world_size=1, backend="nccl", timeout=600)
    assert ours["experts"] == [("fp8", "torchao MoE: FP8 rowwise grouped GEMM")] * 2
    assert abs(sum(ours["losses"][-5:]) / 5 - sum(bf16["losses"][-5:]) / 5) < FP8_LOSS_TOLERANCE


@needs_fp8_gpu
@_needs("torchao")
def test_lean_memory_uses_adamwfp8_on_an_fp8_gpu():
    """memory='lean' on sm_89+: torchao's AdamWFp8 (e4m3 states), as fp8dist.report reads them, and it trains."""
    import fp8dist
    from fp8dist.train.data import Batches
    from fp8dist.train.models import build_llama

    model, opt = fp8dist.wrap_model(build_llama("small", seed=0), fp8="torchao", memory="lean", **ALL,
                                    optimizer={"type": "AdamW", "lr": 1e-3})
    ids = Batches(batch_size=8, seq_len=256, rank=0, world_size=1)[0].cuda()
    losses = []
    for step in range(20):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        if step == 19:
            states = {row.optimizer_states for row in fp8dist.report(model, opt).rows}
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert any(s.startswith("fp8 e4m3 x2") for s in states), states
    assert losses[-1] < losses[0] - 1.0


@needs_fp8_gpu
@_needs("torchao")
def test_a_plan_for_this_gpus_target_equals_the_plan_made_on_it():
    """``fp8dist plan --target GPU`` on a login node promises the plan this GPU makes: every entry equal (FP8
    speed predictions included), for a Mixtral (the experts' recipe depends on the capability) under torchao. The
    target is this GPU's name in fp8dist's table, else its capability (sm_XY: no speed figures, 'all')."""
    from transformers import MixtralConfig, MixtralForCausalLM

    import fp8dist
    from fp8dist.runtime.hardware import find_gpu, hardware_of, parse_target

    config = MixtralConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           tie_word_embeddings=False)
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    cfg = fp8dist.resolve_config(strategy="fsdp", fp8="torchao")
    major, minor = torch.cuda.get_device_capability(0)
    here = fp8dist.plan_precision(model, cfg, device=torch.device("cuda", 0))
    known = find_gpu(hardware_of(torch.device("cuda", 0))).spec
    target = known.key if known is not None else f"sm_{major}{minor}"
    there = fp8dist.plan_precision(model, cfg, device=parse_target(target), check_installed=False)
    assert list(here) == list(there) and (here.compile, here.compile_reason) == (there.compile, there.compile_reason)


SPEED_SHAPES = ((8192, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 16384))
SPEED_TOLERANCE = 0.30  # |measured / predicted - 1| per shape; the largest error on the published H100 table is 0.25


def _measured_rig_speedup(m: int, k: int, n: int, recipe: str) -> float:
    """What torchao's table measures (LayerNorm -> Linear -> Sigmoid, forward + backward, compiled, bf16 / FP8),
    timed as the prepared GPU check times it (benchmarks/gpu/linear.py)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "linear.py"
    spec = importlib.util.spec_from_file_location("gpu_check_linear", path)
    linear = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(linear)
    return linear.measured_rig_speedup((m, k, n), recipe, torch.device("cuda"))


@needs_fp8_gpu
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_speed_model_predicts_the_measured_linear_speedup_on_this_gpu(recipe, monkeypatch):
    """The speed model's figure for this GPU (calibrated on the H100 rowwise table; other GPUs and tensorwise are
    datasheet-scaled predictions) against a measurement here of the quantity the table measures. Within
    SPEED_TOLERANCE per shape, and on the same side of 1 wherever the prediction is outside 0.9-1.1."""
    from pathlib import Path

    from fp8dist.runtime.hardware import find_gpu, hardware_of

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks" / "speed_model"))
    from agreement import rig_speedup

    lookup = find_gpu(hardware_of(torch.device("cuda", 0)))
    if lookup.spec is None:
        pytest.skip(lookup.reason)
    rows = [(shape, rig_speedup(*shape, lookup.spec, recipe), _measured_rig_speedup(*shape, recipe))
            for shape in SPEED_SHAPES]
    report = "; ".join(f"{s}: predicted {p:.2f}, measured {q:.2f}" for s, p, q in rows)
    print(f"{lookup.spec.label} {recipe}: {report}")
    for _, predicted, measured in rows:
        assert abs(measured / predicted - 1) <= SPEED_TOLERANCE, report
        if not 0.9 <= predicted <= 1.1:
            assert (predicted > 1) == (measured > 1), report


# ---- issue 42, written without a GPU (2026-11-26): TE's block-scaled recipes and quantized weights under FSDP2

# NVFP4's last-5-step gap to bf16: not measured anywhere yet, a guess (FP4 values, stochastic rounding) to be set from
# the first B200 run's figure
NVFP4_LOSS_TOLERANCE = 0.05


def _te_recipe_reason(recipe: str) -> str | None:
    from fp8dist.fp8 import get_backend

    cfg = resolve_config(fp8="te", te_recipe=recipe)
    te = get_backend("te")
    return te.unavailable_reason(cfg, torch.device("cuda", 0)) if torch.cuda.is_available() else "needs a CUDA GPU"


@needs_fp8_gpu
@_needs("transformer_engine")
@pytest.mark.parametrize("recipe", ["blockwise", "nvfp4"])
def test_transformer_engine_block_scaled_recipes_track_bf16_and_are_not_per_tensor_fp8(recipe):
    """Float8BlockScaling (sm_90+, CUDA >= 12.9) and NVFP4BlockScaling (sm_100+): the losses are neither bf16's
    nor per-tensor current scaling's (so the block-scaled GEMMs ran), and track bf16."""
    if (reason := _te_recipe_reason(recipe)) is not None:
        pytest.skip(reason)
    bf16, current, ours = _losses(None), _losses("te", te_recipe="current"), _losses("te", te_recipe=recipe)
    assert ours != bf16 and ours != current
    tolerance = NVFP4_LOSS_TOLERANCE if recipe == "nvfp4" else FP8_LOSS_TOLERANCE
    assert abs(sum(ours[-5:]) / 5 - sum(bf16[-5:]) / 5) < tolerance


def _te_fp8_weights_case(rank: int, world: int) -> dict:
    import warnings

    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    import fp8dist
    from fp8dist.train.models import build_llama
    from helpers import optimizer_losses

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the optimizer note, followed below
        model = fp8dist.wrap_model(build_llama("small", seed=0), strategy="fsdp", fp8="te", fp8_weights=True, **ALL)
    quantized = [isinstance(m.weight.to_local(), QuantizedTensor) for m in model.modules() if isinstance(m, te.Linear)]
    opt = te.optimizers.FusedAdam(model.parameters(), lr=1e-3, master_weights=True,
                                  master_weight_dtype=torch.float32)
    losses = optimizer_losses(model, opt, rank, world, 20, device=fp8dist.get_wrap_info(model).env.device,
                              seq_len=256)
    return dict(quantized=quantized, losses=losses)


@needs_fp8_gpu
@_needs("transformer_engine")
def test_transformer_engine_fp8_weights_are_quantized_dtensor_shards_under_fsdp2_and_train():
    """fp8_weights under FSDP2 with real TE (>= 2.10): every te.Linear's local shard is a QuantizedTensor, and it
    trains with TE's FusedAdam keeping fp32 master weights (as TE's FSDP2 example)."""
    if (reason := _te_recipe_reason("current")) is not None:
        pytest.skip(reason)
    for result in run_ranks(_te_fp8_weights_case, world_size=1, backend="nccl", timeout=600):
        assert result["quantized"] and all(result["quantized"])
        assert result["losses"][-1] < result["losses"][0] - 1.0
