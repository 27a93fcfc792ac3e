"""The probe's limits, each tested where it bites: planted data sits close to a limit on both sides, so a limit
loosened or tightened 2x fails a test (every other probe test plants a 1e5 outlier, far past any limit). The
expected verdicts come from the documented limits and hand computations, never from the probe's own output.

- the flush-to-zero limit of inputs and weights (1%): one layer's input flushes 1.6%, another's 0.8%;
- the backward GEMMs (input and weight gradient) are measured as a hand computation says, and a gradient spike
  that delayed scaling clamps is flagged by their SQNR alone;
- under rowwise scaling an outlier in the output gradient of 8% of the tokens (8% flushed, far under the 50%
  gradient limit that healthy layers need) is flagged by the SQNR beside each row's largest value, while a long tail
  of tiny gradient values flushed in the same share is not (it carries nothing)."""

from __future__ import annotations

import math

import pytest
import torch

import fp8dist
from fp8dist.train.data import Batches
from fp8dist.train.models import build_llama
from helpers import one_thread  # noqa: F401  (the fixture, for pytestmark)

pytestmark = pytest.mark.usefixtures("one_thread")

pytest.importorskip("torchao", reason="torchao is not installed")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FLUSH_LIMIT = 0.01
"""The documented limit on an input's or a weight's share flushed to zero (README, thresholds.py): pinned here,
so that moving it in the library fails this file."""
REST_LIMIT = 15.0
"""The documented limit on an operand's SQNR beside each row's largest value, in dB."""
GRAD_LIMIT = 10.0
"""The documented limit on the backward GEMMs' SQNR, in dB."""




def _batch() -> list[torch.Tensor]:
    return [Batches(batch_size=4, seq_len=64, seed=0)[0]]


def _hand_tensorwise(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 round trip by hand: scale = fp8 max / amax (in float64, then fp32, as torchao), clamp, cast, back."""
    fmax = torch.finfo(dtype).max
    scale = (fmax / x.abs().max().double()).float()
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype).float() / scale


def _flushed(x: torch.Tensor, back: torch.Tensor) -> float:
    return int(((x != 0) & (back == 0)).sum()) / int((x != 0).sum())


def _sqnr(exact: torch.Tensor, approx: torch.Tensor) -> float:
    exact, approx = exact.double(), approx.double()
    return 10 * math.log10(float(exact.square().sum() / (exact - approx).square().sum()))


def _capture(model, name: str, seen: dict) -> None:
    """Keep ``name``'s input and output gradient (as the probe's hooks see them) in ``seen``."""
    def hook(module, args, out):
        seen["x"] = args[0].detach().reshape(-1, args[0].shape[-1])
        out.register_hook(lambda g: seen.__setitem__("g", g.detach().reshape(-1, g.shape[-1])))

    model.get_submodule(name).register_forward_hook(hook)


def _scale_input_channels(model, name: str, channels: slice, factor: float) -> None:
    def hook(module, args):
        x = args[0].clone()
        x[..., channels] *= factor
        return (x,)

    model.get_submodule(name).register_forward_pre_hook(hook)


def test_the_flush_limit_sits_between_a_share_just_over_it_and_one_just_under_it():
    """Two of 128 input channels scaled to 1e-7 flush 1.6% of a layer's input under tensorwise e4m3, one channel
    0.8%: the first is flagged, the second not. A limit loosened 2x passes the first, tightened 2x flags the
    second."""
    over, under = "model.layers.1.mlp.up_proj", "model.layers.1.self_attn.q_proj"
    model = build_llama("tiny")
    _scale_input_channels(model, over, slice(0, 2), 1e-7)
    _scale_input_channels(model, under, slice(0, 1), 1e-7)
    seen_over, seen_under = {}, {}
    _capture(model, over, seen_over)
    _capture(model, under, seen_under)
    report = fp8dist.measure_fp8_numerics(model, _batch(), fp8="torchao")

    share_over = _flushed(seen_over["x"], _hand_tensorwise(seen_over["x"], E4M3))
    share_under = _flushed(seen_under["x"], _hand_tensorwise(seen_under["x"], E4M3))
    assert FLUSH_LIMIT < share_over < 2 * FLUSH_LIMIT  # 1.57% measured
    assert FLUSH_LIMIT / 2 < share_under < FLUSH_LIMIT  # 0.79% measured
    layers = {layer.name: layer for layer in report.layers}
    assert layers[over].worst("input").flushed_share == share_over
    assert layers[under].worst("input").flushed_share == share_under
    assert report.recommended_exclude == [over]
    assert layers[over].problems == (f"input (output+grad_weight): {100 * share_over:.1f}% flushed to zero > 1%",)


def _plant_gradient(model, name: str, plant) -> None:
    """``plant(g)`` returns the output gradient ``name`` receives (2-D view: tokens x channels), before the probe's
    hook sees it: hooks on a tensor run in the order registered, each on what the one before returned."""
    def hook(module, args, out):
        out.register_hook(lambda g: plant(g.clone().reshape(-1, g.shape[-1])).reshape(g.shape))

    model.get_submodule(name).register_forward_hook(hook)


LAYER = "model.layers.1.mlp.up_proj"


def test_the_backward_gemms_equal_a_hand_computation_and_a_clamped_gradient_spike_is_flagged():
    model = build_llama("tiny")
    seen = {}
    _capture(model, LAYER, seen)
    report = fp8dist.measure_fp8_numerics(model, _batch(), fp8="torchao")  # tensorwise: e4m3 x and W, e5m2 g
    layer = next(l for l in report.layers if l.name == LAYER)
    x, g, w = seen["x"], seen["g"], model.get_submodule(LAYER).weight.detach()
    x8, g8, w8 = _hand_tensorwise(x, E4M3), _hand_tensorwise(g, E5M2), _hand_tensorwise(w, E4M3)
    assert layer.grad_input.sqnr_db == pytest.approx(_sqnr(g @ w, g8 @ w8), abs=1e-6)  # 24.5 dB measured
    assert layer.grad_weight.sqnr_db == pytest.approx(_sqnr(g.t() @ x, g8.t() @ x8), abs=1e-6)
    assert report.recommended_exclude == []

    # Transformer Engine's delayed scaling casts the second batch's gradient with the first one's amax: a spike of
    # 40 values (0.03% of the gradient over both batches, under the 0.1% saturation limit) is clamped, and the
    # gradients the GEMMs compute lose what the spike carried. Planted in the first FP8 layer: a spike planted in a
    # later one reaches every layer before it through backpropagation, and they are flagged alike.
    first = "model.layers.0.self_attn.q_proj"
    calls = []

    def spike(g):
        calls.append(1)
        if len(calls) == 2:
            rows = torch.arange(40)
            g[rows, rows * 3] *= 1000
        return g

    model = build_llama("tiny")
    _plant_gradient(model, first, spike)
    batches = [Batches(batch_size=4, seq_len=64, seed=0)[i] for i in range(2)]
    te = fp8dist.measure_fp8_numerics(model, batches, fp8="te", te_recipe="delayed")
    layer = next(l for l in te.layers if l.name == first)
    grad = next(c for c in layer.casts if c.role == "grad_output")
    assert grad.saturated >= 40 and grad.saturated_share < 0.001  # 41 measured: one value of the batch besides
    assert layer.grad_input.sqnr_db < GRAD_LIMIT and layer.grad_weight.sqnr_db < GRAD_LIMIT  # 0.0 dB measured
    assert te.recommended_exclude == [first]
    assert [p.split(" SQNR")[0] for p in layer.problems] == ["grad_input", "grad_weight"]


def _hand_rowwise_pow2(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torchao's rowwise e4m3 cast by hand: one scale per row along ``dim``, fp8 max / amax rounded down to a
    power of 2."""
    amax = x.abs().amax(dim, keepdim=True).double().clamp(min=1e-12)  # torchao clamps an all-zero row alike
    scale = torch.exp2(torch.floor(torch.log2((448.0 / amax).float())))
    return (x * scale).clamp(-448, 448).to(E4M3).float() / scale


def _rest_sqnr(x: torch.Tensor, back: torch.Tensor, dim: int) -> float:
    """SQNR over the values beside each row's largest (rows along ``dim``), by hand."""
    rest = torch.ones_like(x, dtype=torch.bool).scatter_(dim, x.abs().argmax(dim, keepdim=True), False)
    return _sqnr(x[rest], back[rest])


@pytest.mark.parametrize("kind", ["outlier in 8% of the tokens", "tiny long tail"])
def test_under_rowwise_a_gradient_outlier_in_8_percent_of_the_tokens_is_flagged_and_a_tiny_tail_is_not(kind):
    """Healthy layers flush up to 35% of their output gradient under rowwise scaling (a softmax gradient's tail):
    the 50% limit on the share cannot see 8%. What tells the two apart is whether the flushed values were ordinary
    ones swamped by an outlier of their row (the rows lose everything beside it: the rest SQNR falls) or tiny
    beside their row's ordinary values (nothing lost that counts)."""
    tokens = torch.arange(256) % 12 == 0  # 22 of 256 tokens: 8.6%

    def plant(g):
        if kind == "tiny long tail":
            g[:, :31] *= 1e-7  # 31 of 384 channels: 8.1%
        else:
            g[tokens, 5] = 1e5 * g.abs().max()
        return g

    model = build_llama("tiny")
    _plant_gradient(model, LAYER, plant)
    seen = {}
    _capture(model, LAYER, seen)
    report = fp8dist.measure_fp8_numerics(model, _batch(), fp8="torchao", torchao_recipe="rowwise")
    layer = next(l for l in report.layers if l.name == LAYER)
    cast = next(c for c in layer.casts if c.role == "grad_output" and c.gemms == "grad_input")  # rows: tokens
    g = seen["g"]
    back = _hand_rowwise_pow2(g, -1)
    share, rest = _flushed(g, back), _rest_sqnr(g, back, -1)
    assert 0.05 < share < 0.1 and cast.flushed_share == pytest.approx(share)  # 8.7% / 8.1% measured
    assert cast.rest_sqnr_db == pytest.approx(rest, abs=1e-6)
    if kind == "tiny long tail":
        assert rest > 2 * REST_LIMIT and report.recommended_exclude == []  # 31.5 dB measured
    else:
        assert REST_LIMIT / 2 < rest < REST_LIMIT and report.recommended_exclude == [LAYER]  # 10.6 dB measured
        assert layer.problems == (f"grad_output (grad_input): SQNR beside each row's largest {rest:.1f} dB "
                                  f"< {REST_LIMIT:g} dB (an outlier swamps the rest)",)
