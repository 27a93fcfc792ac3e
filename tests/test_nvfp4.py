"""NVFP4 on a CPU: the numerics probe's NVFP4 cast (e2m1 values in 1x16 blocks, e4m3 block scales, an fp32 tensor
scale; 16x16 blocks for Transformer Engine's weights) against torchao's own ``nvfp4_quantize``, its per-layer
verdicts on a Llama, and the plan keeping the last blocks and the head out of FP4 (``keep_last_blocks_share``)."""

from __future__ import annotations

import re

import pytest
import torch

import fp8dist
from fp8dist.fp8.casts import CastSpec, nvfp4_casts
from fp8dist.runtime.hardware import TARGETS
from fp8dist.numerics import Thresholds
from fp8dist.numerics.casts import Cast
from fp8dist.plan.precision import FP8UnavailableError
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama

E2M1 = torch.float4_e2m1fn_x2


def _torchao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """torchao's NVFP4 quantization of ``x`` (rows of 1x16 blocks, two-level scales), dequantized to fp32."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    tensor_scale = per_tensor_amax_to_scale(x.abs().max())
    block_scales, packed = nvfp4_quantize(x, 16, tensor_scale)
    values = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(x.shape[0], -1, 16)
    return (values * (block_scales.float() * tensor_scale).unsqueeze(-1)).reshape(x.shape)


def test_the_probes_nvfp4_cast_is_torchaos_nvfp4_quantization_along_the_contraction_dim():
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-2, 2, 96)  # columns spanning four decades: blocks scale apart
    cast = Cast(CastSpec(E2M1, "nvfp4"))
    back, saturated = cast(x, -1)
    assert torch.equal(back, _torchao_nvfp4(x)) and not saturated.any()  # bit for bit
    assert not cast.floored.any()  # every block's scale within e4m3's normal range (down to 1/28,672 of the amax)
    wider = torch.randn(64, 96) * torch.logspace(-4, 2, 96)  # six decades: the smallest blocks' scales floor
    wide_back, _ = cast(wider, -1)
    floored = cast.floored
    assert torch.equal(wide_back, _torchao_nvfp4(wider)) and floored[:, :16].all() and not floored[:, -16:].any()
    along_rows, _ = Cast(CastSpec(E2M1, "nvfp4"))(x.t().contiguous(), 0)  # a weight's layout: blocks along dim 0
    assert torch.equal(along_rows.t(), back)
    assert (back - x).norm() / x.norm() < 0.12  # e2m1: measured 0.098 on Gaussian rows
    zeros, _ = Cast(CastSpec(E2M1, "nvfp4"))(torch.zeros(4, 32), -1)
    assert torch.equal(zeros, torch.zeros(4, 32))


def test_16x16_weight_blocks_cast_alike_for_either_gemm_and_pad_ragged_dims():
    torch.manual_seed(0)
    w = torch.randn(40, 24)  # neither dim a multiple of 16: zero-padded blocks
    tiled = CastSpec(E2M1, "nvfp4", tile=16)
    rows, _ = Cast(tiled)(w, -1)
    cols, _ = Cast(tiled)(w, 0)
    assert torch.equal(rows, cols) and rows.shape == w.shape  # one 16x16 block scale serves both layouts
    assert not tiled.per_dim and CastSpec(E2M1, "nvfp4").per_dim
    assert tiled.describe() == "e2m1 NVFP4 16x16 e4m3 + fp32 tensor scale"
    te = nvfp4_casts()
    assert {s.tile for (role, _), s in te.items() if role == "weight"} == {16}
    assert {s.tile for (role, _), s in te.items() if role != "weight"} == {1}


@pytest.fixture(scope="module")
def te_nvfp4_report():
    batches = [Batches(batch_size=2, seq_len=64, seed=1)[0]]
    return fp8dist.measure_fp8_numerics(build_llama("tiny"), batches, fp8="te", te_recipe="nvfp4", target="b200"), \
        batches


def test_the_probe_measures_te_nvfp4_per_layer_within_the_fp4_limits(te_nvfp4_report):
    """A healthy Llama passes NVFP4's own limits; the FP8 limits would have excluded every layer (e2m1 keeps two
    mantissa bits fewer than e4m3). The tail (the last of 2 blocks, the head) is not measured: the plan keeps it
    out of FP4."""
    report, _ = te_nvfp4_report
    names = [layer.name for layer in report.layers]
    assert names and all(n.startswith("model.layers.0.") for n in names)
    assert report.recommended_exclude == []
    assert all(c.fp4 and c.cast.startswith("e2m1 NVFP4") for layer in report.layers for c in layer.casts)
    weights = {c.cast for layer in report.layers for c in layer.casts if c.role == "weight"}
    assert weights == {"e2m1 NVFP4 16x16 e4m3 + fp32 tensor scale"}
    assert any("stochastic rounding" in note for note in report.notes)
    assert any(note.startswith("the last blocks and the output head not measured: the plan keeps them out of low "
                               "precision (keep_last_blocks_share=0.15, the default") for note in report.notes)
    fp8_limits = Thresholds(fp4_min_output_sqnr_db=20.0, fp4_min_rest_sqnr_db=15.0, fp4_max_flushed_share=0.01)
    assert all(fp8_limits.problems(layer) for layer in report.layers)
    assert "FP4 (NVFP4) GEMMs: output SQNR >= 10 dB" in str(report)


def test_an_outlier_channel_is_caught_under_nvfp4(te_nvfp4_report):
    """1e5 in one input channel (the calibration's planted outlier): NVFP4's 1x16 blocks confine it to its
    blocks, but the tensor scale it sets puts the other blocks' e4m3 scales under e4m3's range (measured: 99.9% of
    the input at initialization, against 0% in every healthy layer)."""
    _, batches = te_nvfp4_report
    model = build_llama("tiny")
    layer = model.model.layers[0].mlp.down_proj

    def plant(module, args):
        x = args[0].clone()
        x[..., 5] = 1e5
        return (x,)

    layer.register_forward_pre_hook(plant)
    report = fp8dist.measure_fp8_numerics(model, batches, fp8="te", te_recipe="nvfp4", target="b200")
    assert report.recommended_exclude == ["model.layers.0.mlp.down_proj"]
    problems = next(layer.problems for layer in report.layers if layer.name == "model.layers.0.mlp.down_proj")
    assert any(re.fullmatch(r"input \(output\): 9\d\.\d% in NVFP4 blocks whose e4m3 scale sat at its "
                            r"floor > 1% \(an outlier set the tensor scale\)", p) for p in problems), problems


def _kept(plan) -> dict[str, str]:
    return {e.name: e.reason for e in plan if e.module_type == "Linear" and e.precision != "fp8"}


def test_nvfp4_keeps_the_last_15_percent_of_blocks_and_the_head_out_of_fp4_by_default():
    model = build_llama("small")  # 4 blocks: ceil(0.15 x 4) = 1
    cfg = fp8dist.resolve_config(fp8="te", te_recipe="nvfp4", fp8_select="all")
    plan = fp8dist.plan_precision(model, cfg, device=TARGETS["b200"], check_installed=False)
    kept = _kept(plan)
    assert set(kept) == {"lm_head"} | {n for n in kept if n.startswith("model.layers.3.")} and len(kept) == 8
    assert kept["model.layers.3.mlp.down_proj"].startswith("in model.layers.3, one of the last 1 of 4 blocks, kept in "
                                                           "high precision (keep_last_blocks_share=0.15, the default "
                                                           "under an FP4 recipe (te_nvfp4)")
    assert kept["lm_head"].startswith("the output head (the last GEMM to run), kept in high precision")
    assert all(e.precision == "bf16" and e.converted_to is None for e in plan if e.name in kept)
    assert any("the last 1 of 4 blocks (model.layers.3) and the output head lm_head" in n for n in plan.notes)


@pytest.mark.parametrize("options,kept_blocks", [
    ({"fp8": "te", "te_recipe": "mxfp8"}, 0),  # FP8 recipes: off by default
    ({"fp8": "te", "te_recipe": "nvfp4", "keep_last_blocks_share": 0}, 0),  # turned off
    ({"fp8": "te", "te_recipe": "mxfp8", "keep_last_blocks_share": 0.5}, 2),  # asked for under FP8
])
def test_the_tail_rule_is_an_option(options, kept_blocks):
    model = build_llama("small")
    cfg = fp8dist.resolve_config(fp8_select="all", **options)
    plan = fp8dist.plan_precision(model, cfg, device=TARGETS["b200"], check_installed=False)
    kept = _kept(plan)
    assert {n.split(".")[2] for n in kept if n.startswith("model.layers.")} == {str(3 - i) for i in range(kept_blocks)}
    assert ("lm_head" in kept) == bool(kept_blocks)


def test_a_bad_share_is_refused_naming_the_value_and_the_choices():
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match=re.escape(f"keep_last_blocks_share={bad} must be a share of the blocks, "
                                                       "from 0 (none) to below 1")):
            fp8dist.resolve_config(fp8="te", te_recipe="nvfp4", keep_last_blocks_share=bad)


def test_torchao_nvfp4_is_planned_for_a_b200_and_refused_where_fp4_gemms_are_missing():
    """torchao 0.18's NVFP4 training (NVFP4TrainingConfig: nn.Linear -> NVFP4Linear) runs Triton kernels only: planned
    on a B200 (dims multiples of 128, the tail and head kept out), refused on an H100 and on this CPU naming the
    capability and the ways out."""
    model = build_llama("small")  # hidden 256, MLP 768: multiples of 128
    cfg = fp8dist.resolve_config(fp8="torchao", torchao_recipe="nvfp4", fp8_select="all")
    plan = fp8dist.plan_precision(model, cfg, device=TARGETS["b200"])
    fp4 = {e.name for e in plan if e.converted_to == "NVFP4Linear"}
    assert fp4 and all(e.precision == "fp8" for e in plan if e.name in fp4)
    assert "model.layers.2.mlp.down_proj" in fp4 and not any(n.startswith("model.layers.3.") for n in fp4)
    assert "module_swap" in plan.detail
    for where in (TARGETS["h100"], torch.device("cpu")):
        with pytest.raises(FP8UnavailableError, match=re.escape(
                "torchao_recipe='nvfp4' needs FP4 tensor cores (CUDA sm_100+), not ") + ".*Triton kernels only.*"
                + re.escape("Plan for it with --target b200")):
            fp8dist.plan_precision(model, cfg, device=where)
    narrow = fp8dist.plan_precision(build_llama("tiny"), cfg, device=TARGETS["b200"])
    assert any("not divisible by 128 (torchao's NVFP4 training GEMM" in e.reason for e in narrow)


def test_torchao_nvfp4_has_no_weight_wrapper():
    with pytest.raises(ValueError, match=re.escape("torchao_api='weight_wrapper' with torchao_recipe='nvfp4': "
                                                   "torchao's NVFP4 training swaps nn.Linear for NVFP4Linear")):
        fp8dist.wrap_model(build_llama("small"), strategy="none", fp8="torchao", torchao_recipe="nvfp4",
                           torchao_api="weight_wrapper")


def test_torchao_nvfp4_swaps_exactly_the_planned_linears_with_one_hadamard_sign_vector(monkeypatch):
    """The swap itself runs on a CPU (its FP4 GEMM does not: the proof is stubbed here, and runs for real in the gpu
    test below): the planned Linears become NVFP4Linear with their own weights, the others stay."""
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

    from fp8dist.fp8 import mx_linear

    monkeypatch.setattr(mx_linear, "_fp4_gemms", lambda: 1)
    model = build_llama("small")
    weight = model.model.layers[0].mlp.up_proj.weight
    mx_linear.convert_nvfp4(model, {"model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"})
    swapped = {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert swapped == {"model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"}
    assert model.model.layers[0].mlp.up_proj.weight is weight
    assert model.model.layers[0].mlp.up_proj.rht_sign_vector == model.model.layers[1].mlp.up_proj.rht_sign_vector
    monkeypatch.setattr(mx_linear, "_fp4_gemms", lambda: 0)
    with pytest.raises(RuntimeError, match="NVFP4Linear ran no FP4 GEMM, although the plan calls them FP4"):
        mx_linear.convert_nvfp4(build_llama("small"), {"model.layers.0.mlp.up_proj"})


def test_the_probe_measures_torchao_nvfp4_with_its_16x16_weight_blocks():
    batches = [Batches(batch_size=2, seq_len=64, seed=1)[0]]
    report = fp8dist.measure_fp8_numerics(build_llama("small"), batches, fp8="torchao", torchao_recipe="nvfp4",
                                          target="b200")
    casts = {c.cast for layer in report.layers for c in layer.casts}
    assert casts == {"e2m1 NVFP4 1x16 e4m3 + fp32 tensor scale", "e2m1 NVFP4 16x16 e4m3 + fp32 tensor scale"}
    assert report.layers and not any(layer.name.startswith("model.layers.3.") for layer in report.layers)
    assert any("stochastic rounding" in note for note in report.notes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (10, 0),
                    reason="needs a CUDA GPU with FP4 tensor cores (sm_100+)")
def test_torchao_nvfp4_trains_on_a_blackwell_gpu_with_fp4_gemms():
    model = fp8dist.wrap_model(build_llama("small").cuda(), strategy="none", fp8="torchao", torchao_recipe="nvfp4",
                               fp8_select="all", param_dtype="bf16")
    ids = torch.randint(0, 256, (2, 128), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_the_fp4_gemm_counter_sees_f_scaled_mm_on_fp4_operands():
    """The proof convert_nvfp4 runs on a GPU counts what F.scaled_mm becomes (torch._scaled_mm_v2), FP4 operands
    only; here on a CPU, which has no FP4 kernel, the mode counts the call before it is refused."""
    import torch.nn.functional as F

    from fp8dist.fp8.mx_linear import FP4Gemms

    fp4 = torch.zeros(32, 16, dtype=torch.uint8).view(E2M1)
    fp8 = torch.zeros(32, 32, dtype=torch.float8_e4m3fn)
    with FP4Gemms() as gemms:
        for a in (fp4, fp8):  # FP8's runs on a CPU too
            try:
                F.scaled_mm(a, a.t(), scale_a=torch.ones(()), scale_recipe_a=F.ScalingType.TensorWise,
                            scale_b=torch.ones(()), scale_recipe_b=F.ScalingType.TensorWise,
                            output_dtype=torch.bfloat16)
            except (RuntimeError, NotImplementedError, ValueError):  # no FP4 here: counted before it refused
                assert a is fp4
    assert gemms.count == 1  # the FP4 call only
