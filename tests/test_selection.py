"""FP8 only where it pays (issue 26): the plan converts an eligible layer where the speed model predicts it faster
than bf16 on the plan's GPU at this run's tokens (``fp8_select='auto'``, the default on a GPU), every eligible
layer on a CPU (``'all'``: CPU tests keep their meaning), and keeps a layer a numerics probe measured unsafe. The
expected decisions are computed here from ``predict_linear`` on the model's own shapes, never read from the plan."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import fp8dist
from fp8dist.cli import main
from fp8dist.runtime.hardware import TARGETS, Hardware
from fp8dist.train.models import build_llama
from fp8dist.plan.speed import compare_recipes, predict_linear

pytest.importorskip("torchao", reason="torchao is not installed")

H100 = TARGETS["h100"]


def _meta_llama(size: str) -> nn.Module:
    with torch.device("meta"):
        return build_llama(size)


def _eligible(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in, out) of every Linear torchao converts by default: all but the first and the last."""
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    return {n: (m.in_features, m.out_features) for n, m in linears[1:-1]}


def _rows(out: str) -> dict[str, tuple[str, str]]:
    """The plan table's rows: module -> (precision, reason)."""
    rows = {}
    for line in out.splitlines():
        cells = line.split(maxsplit=4)
        if len(cells) == 5 and cells[2] in ("fp8", "bf16", "fp32"):
            rows[cells[0]] = (cells[2], cells[4])
    return rows


def _expected(model: nn.Module, tokens: int, recipe: str, compile: bool = True) -> dict[str, float]:
    return {n: predict_linear(tokens, k, m, target="h100", recipe=recipe, compile=compile).speedup
            for n, (k, m) in _eligible(model).items()}


def test_plan_for_h100_keeps_in_bf16_the_layers_predicted_slower_and_converts_those_predicted_to_pay(capsys):
    """The issue's done-when, on this CPU: `fp8dist plan --model-size 1b --target h100 --micro-batch-size 4
    --seq-len 2048 --torchao-recipe rowwise`, then tensorwise, whose k/v projections (N = 512) alone stay bf16."""
    model = _meta_llama("1b")
    base = ["plan", "--model-size", "1b", "--target", "h100", "--micro-batch-size", "4", "--seq-len", "2048"]
    for recipe in ("rowwise", "tensorwise"):
        assert main([*base, "--torchao-recipe", recipe]) == 0
        out = capsys.readouterr().out
        rows, expected = _rows(out), _expected(model, 4 * 2048, recipe)
        for name, speedup in expected.items():
            precision, reason = rows[name]
            assert precision == ("fp8" if speedup >= 1.0 else "bf16"), (name, speedup, reason)
            basis = f"{recipe}, uncalibrated"  # rowwise is calibrated on h100-hbm2e, the 2.4 TB/s part torchao used
            figure = f"predicted {speedup:.2f}x on H100 at 8,192 tokens ({basis})"
            assert reason == (f"converted by torchao; {figure}" if speedup >= 1 else f"FP8 {figure}"), reason
        kept = {n for n, s in expected.items() if s < 1}
        if recipe == "rowwise":  # every 1b layer is predicted slower at 8,192 tokens (0.25x to 0.83x)
            assert kept == set(expected) and len(kept) == 24 * 7 - 1
        else:
            assert kept == {n for n in expected if n.endswith(("k_proj", "v_proj"))}  # 0.94x
        assert "FP8 selection: auto (the default where the plan's hardware is a GPU: H100 (sm_90))" in out
        assert "predicted at 8,192 tokens per rank per micro-batch (micro_batch_size 4 x seq_len 2048)" in out
        bf16 = sum(predict_linear(8192, k, n, target="h100", recipe=recipe).bf16_s
                   for k, n in _eligible(model).values())
        assert f"bf16 {bf16 * 1e3:.3f} ms" in out


def test_compare_recipes_prints_each_recipes_predicted_gemm_time(capsys):
    model = _meta_llama("medium")
    gemms = [(n, 65536, k, m) for n, (k, m) in _eligible(model).items()]
    argv = ["plan", "--model-size", "medium", "--target", "h100", "--micro-batch-size", "32", "--seq-len", "2048",
            "--compare-recipes"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    table = {line.split()[0]: line.split()[1:] for line in out[out.index(next(
        line for line in out if line.startswith("recipes compared on H100"))) + 3:]}
    expected = compare_recipes(gemms, target="h100", backend="torchao")
    assert list(table) == ["bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp"]
    assert table["bf16"][0] == f"{expected[0].bf16_s * 1e3:.3f}"
    for step in expected:
        assert table[step.recipe][0] == f"{step.chosen_s * 1e3:.3f}"
        assert table[step.recipe][2] == f"{step.all_fp8_s * 1e3:.3f}"
    # the medium preset at 65,536 tokens under tensorwise: the MLP pays (1.06x), attention does not (0.72x, 0.69x)
    assert expected[0].chosen_s < expected[0].bf16_s < expected[0].all_fp8_s
    for backend, target, recipes in (("te", "h100", ["te_delayed", "te_current", "te_blockwise"]),
                                     ("te", "b200", ["te_delayed", "te_current", "te_blockwise", "te_mxfp8",
                                                     "te_nvfp4"])):
        assert main(["plan", "--model-size", "tiny", "--fp8", backend, "--target", target, "--compare-recipes"]) == 0
        lines = capsys.readouterr().out.splitlines()
        start = lines.index(next(line for line in lines if line.startswith("recipes compared"))) + 3
        assert [line.split()[0] for line in lines[start:]] == ["bf16", *recipes]
    assert main(["plan", "--model-size", "tiny", "--compare-recipes"]) == 2  # on this CPU: nothing to predict for
    assert "--compare-recipes needs a GPU to predict for (cpu is not a GPU" in capsys.readouterr().err


def test_on_a_cpu_every_eligible_layer_converts_as_before():
    """The default on a CPU is 'all': the tiny Llama's 13 FP8 layers (15 Linears but the first and last), no
    figure, reasons unchanged; 'auto' asked for on a CPU says it cannot apply, and converts the same."""
    model = build_llama("tiny", seed=0)
    expected = _eligible(model)
    plan = fp8dist.plan_precision(model, fp8dist.resolve_config(fp8="torchao"), device=torch.device("cpu"))
    assert [e.name for e in plan.fp8] == list(expected) and len(expected) == 13
    assert all(e.reason == "converted by torchao" and e.predicted == () and e.speedup is None for e in plan.fp8)
    assert (plan.selection.mode, plan.selection.step, plan.notes) == ("all", None, ())
    assert "FP8 selection: all (the default on cpu: FP8 there is for numerics and tests, not speed)" in str(plan)
    asked = fp8dist.plan_precision(model, fp8dist.resolve_config(fp8="torchao", fp8_select="auto",
                                                                 fp8_select_margin=1.1), device=torch.device("cpu"))
    assert [e.name for e in asked.fp8] == list(expected)
    assert any(n.startswith("fp8_select='auto' on cpu: FP8 speed is predicted for CUDA GPUs only") for n in asked.notes)
    assert any(n.startswith("fp8_select_margin=1.1 has no effect") for n in asked.notes)
    # a bare capability names no GPU: its peaks are unknown, so 'auto' cannot predict there either
    bare = fp8dist.plan_precision(model, fp8dist.resolve_config(fp8="torchao", fp8_select="auto"),
                                  device=Hardware("cuda", (9, 0), "sm_90"), check_installed=False)
    assert len(bare.fp8) == 13 and bare.selection.mode == "all"
    assert any("sm_90 is a compute capability, not one GPU" in n for n in bare.notes)


def test_the_margin_and_the_tokens_move_the_decision():
    """medium preset (512 / 256 / 1536 widths), tensorwise on H100: at 65,536 tokens the MLP is predicted to pay
    (1.06x) and attention not; a margin of 1.1 keeps the MLP too; 2,048 tokens (the default seq_len, said) none."""
    model = _meta_llama("medium")
    cfg = dict(fp8="torchao", micro_batch_size=32, seq_len=2048)
    expected = _expected(model, 65536, "tensorwise")
    plan = fp8dist.plan_precision(model, fp8dist.resolve_config(**cfg), device=H100, check_installed=False)
    assert {e.name for e in plan.fp8} == {n for n, s in expected.items() if s >= 1} != set()
    assert {e.name: round(e.speedup, 9) for e in plan if e.predicted} == {n: round(s, 9) for n, s in expected.items()}
    step = plan.selection.step
    assert step.fp8_flop_share == pytest.approx(sum(6 * 65536 * k * n for name, (k, n) in _eligible(model).items()
                                                    if expected[name] >= 1) /
                                                sum(6 * 65536 * k * n for k, n in _eligible(model).values()))
    strict = fp8dist.plan_precision(model, fp8dist.resolve_config(**cfg, fp8_select_margin=1.1), device=H100,
                                    check_installed=False)
    assert strict.fp8 == [] and max(expected.values()) < 1.1
    assert "fp8='torchao' runs 0 of" in strict.low_coverage_warning()
    assert "FP8 predicted slower than bf16 (fp8_select='auto')" in strict.low_coverage_warning()
    default = fp8dist.plan_precision(model, fp8dist.resolve_config(fp8="torchao"), device=H100,
                                     check_installed=False)
    assert default.selection.tokens == 2048 and default.fp8 == []
    assert "micro_batch_size 1 x seq_len 2048, assumed: pass seq_len= (--seq-len) for this run's" in str(default)


def test_options_no_axis_reads_are_reported():
    def unread(**options):
        return fp8dist.resolve_config(**options).unread_notes()

    assert unread(fp8_select="auto") == ["fp8_select='auto' has no effect here (read only when fp8 in ['te', "
                                         "'torchao']; fp8=None)."]
    assert unread(fp8="torchao", fp8_select="all", fp8_select_margin=1.2) == [
        "fp8_select_margin=1.2 has no effect here (read only when fp8 in ['te', 'torchao'] and fp8_select in [None, "
        "'auto']; fp8='torchao', fp8_select='all')."]
    assert unread(strategy="ddp", fp8="msamp", seq_len=4096)[0].startswith("seq_len=4096 has no effect here")
    assert unread(strategy="fsdp", micro_batch_size=4)[0].startswith(
        "micro_batch_size=4 has no effect here (read only when strategy in ['deepspeed'] or fp8 in ['te', 'torchao']")
    assert unread(strategy="deepspeed", micro_batch_size=4) == []
    assert unread(fp8="te", fp8_select="auto", fp8_select_margin=1.2, seq_len=4096, micro_batch_size=2) == []
    # a job sets its batch only where something reads it (fp8dist train, the bench's cells)
    from fp8dist.plan.selection import with_read_options

    bf16 = with_read_options(fp8dist.resolve_config(strategy="fsdp"), micro_batch_size=4, seq_len=512)
    assert (bf16.parallel.micro_batch_size, bf16.parallel.seq_len, bf16.unread_notes()) == (1, None, [])
    fp8 = with_read_options(fp8dist.resolve_config(fp8="torchao"), micro_batch_size=4, seq_len=512)
    assert (fp8.parallel.micro_batch_size, fp8.parallel.seq_len) == (4, 512)


def test_estimate_prints_the_predicted_gemm_time_beside_the_memory(capsys):
    model = _meta_llama("small")
    gemm = sum(predict_linear(4 * 1024, k, n, target="h100", recipe="tensorwise").bf16_s
               for k, n in _eligible(model).values())
    argv = ["estimate", "--model-size", "small", "--micro-batch-size", "4", "--seq-len", "1024"]
    assert main([*argv, "--target", "h100"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("predicted GEMM time"))
    assert line.startswith(f"predicted GEMM time per micro-batch on H100 (tensorwise, compiled, uncalibrated; "
                           f"forward + backward, one rank, {len(_eligible(model))} eligible GEMMs): bf16 "
                           f"{gemm * 1e3:.3f} ms, as planned ")
    assert main([*argv, "--target", "h100", "--json"]) == 0
    speed = json.loads(capsys.readouterr().out)["speed"]
    assert (speed["gpu"], speed["tokens"], speed["gemm_s"]["bf16"]) == ("h100", 4096, pytest.approx(gemm))
    assert main(argv) == 0  # no target: memory only
    assert "predicted GEMM time" not in capsys.readouterr().out


def test_each_bench_cell_records_its_layers_predicted_speedup():
    """A GPU-bound cell's plan (the config the cell wraps with, planned for an H100) converts every eligible layer
    and records each one's predicted speedup at the cell's tokens, eager as the cell runs, and the GEMM time; a
    CPU cell records none."""
    from fp8dist.bench.cell import Cell, cell_config, predicted_figures

    cell = Cell(strategy="fsdp", fp8="torchao", size="small", batch_size=4, seq_len=256)
    model = build_llama("small", seed=0)
    plan = fp8dist.plan_precision(model, cell_config(cell), device=H100, world_size=2, check_installed=False)
    figures = json.loads(json.dumps(predicted_figures(plan)))
    expected = _expected(model, 4 * 256, "tensorwise", compile=cell.compile)
    assert cell.compile is False and figures["compile"] is False
    assert [(layer["name"], layer["fp8"]) for layer in figures["layers"]] == [(n, True) for n in expected]
    assert [layer["speedup"] for layer in figures["layers"]] == pytest.approx(list(expected.values()))
    assert figures["mode"] == "all" and figures["gemm_s"]["all_fp8"] == pytest.approx(figures["gemm_s"]["planned"])
    assert predicted_figures(fp8dist.plan_precision(model, cell_config(cell), device=torch.device("cpu"))) is None
    bf16 = cell_config(Cell(strategy="fsdp", fp8=None, size="small"))
    assert bf16.unread_notes() == [] and bf16.precision.fp8_select is None


def test_a_numerics_report_keeps_the_unsafe_layer_out_of_fp8():
    """A planted outlier channel (tests/test_numerics_probe.py) makes the probe flag one layer: planned for an
    H100 with a margin every layer clears, it alone stays bf16, with the probe's words; the others say both."""
    from test_numerics_probe import BAD, _batches, _plant_outlier

    model, threads = build_llama("tiny", seed=0), torch.get_num_threads()
    handle = _plant_outlier(model)
    torch.set_num_threads(1)  # several agents share two cores: one thread is several times faster here
    try:
        report = fp8dist.measure_fp8_numerics(model, _batches(), fp8="torchao")
    finally:
        torch.set_num_threads(threads)
    handle.remove()
    cfg = fp8dist.resolve_config(fp8="torchao", fp8_select_margin=0.01)
    for given in (report, json.loads(json.dumps(report.to_dict()))):  # the object, or the JSON fp8dist probe writes
        plan = fp8dist.plan_precision(model, cfg, device=H100, check_installed=False, numerics=given)
        bad = plan.by_name(BAD)
        assert (bad.precision, bad.converted_to) == ("bf16", None)
        assert bad.reason.startswith("FP8 unsafe: input (output+grad_weight): ") and bad.reason.endswith("(probe)")
        assert "flushed to zero > 1%" in bad.reason and bad.numerics
        others = [e for e in plan.fp8]
        assert len(others) == 12 and all(e.numerics == () for e in others)
        assert all(e.reason.startswith("converted by torchao; predicted ") and e.reason.endswith("numerics ok (probe)")
                   for e in others)
        assert "1 of the plan's FP8 candidates measured unsafe" in str(plan)
    other = build_llama("small", seed=0)
    names = report.to_dict()
    names["layers"][0]["name"] = "model.layers.9.mlp.up_proj"
    with pytest.raises(ValueError, match=r"names 1 module this model does not have \('model.layers.9.mlp.up_"
                                         r"proj'\): it was measured on another model"):
        fp8dist.plan_precision(other, cfg, device=torch.device("cpu"), numerics=names)


def test_fp8dist_env_prints_the_gpus_record(monkeypatch):
    """On a machine with an H100 (stood in: this one has none), env prints its record from fp8dist.runtime.gpus."""
    from fp8dist.cli.env import describe_environment
    from fp8dist.runtime.gpus import gpu_by_key

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    lines = describe_environment().splitlines()
    device = next(i for i, line in enumerate(lines) if line.startswith("cuda:0"))
    record = lines[device + 1].strip()
    assert record == gpu_by_key("h100").describe()
    assert record.startswith("H100 (h100): dense bf16 989.4 TFLOP/s, FP8 1978.9 TFLOP/s, 3.35 TB/s (NVIDIA H100 "
                             "Tensor Core GPU datasheet")


def test_moe_experts_are_decided_by_their_grouped_gemms_prediction():
    """A Mixtral's experts on H100 (FP8 rowwise grouped GEMMs): both grouped GEMMs predicted at tokens x top_k
    routed rows over the experts; an emulated recipe has no speed model, so they convert as under 'all', saying so."""
    from test_hardware_target import MIXTRAL, _mixtral

    model, tokens = _mixtral(), 64 * 2048
    hidden, inter, experts, top_k = (MIXTRAL[k] for k in ("hidden_size", "intermediate_size", "num_local_experts",
                                                          "num_experts_per_tok"))
    gemms = [predict_linear(tokens * top_k, k, n, target="h100", recipe="moe_fp8_rowwise", groups=experts)
             for k, n in ((hidden, 2 * inter), (inter, hidden))]
    expected = sum(g.bf16_s for g in gemms) / sum(g.fp8_s for g in gemms)
    plan = fp8dist.plan_precision(model, fp8dist.resolve_config(fp8="torchao", micro_batch_size=64, seq_len=2048),
                                  device=H100, check_installed=False)
    entry = plan.by_name("model.layers.0.mlp.experts")
    assert entry.speedup == pytest.approx(expected) and (entry.precision == "fp8") == (expected >= 1)
    assert f"predicted {expected:.2f}x on H100 at 131,072 tokens (moe_fp8_rowwise, 4 experts, 262,144 routed rows" \
        in entry.reason
    names = [c.name for c in plan.selection.step.layers if "experts" in c.name]
    assert names[:2] == ["model.layers.0.mlp.experts[gate_up_proj]", "model.layers.0.mlp.experts[down_proj]"]
    emulated = fp8dist.plan_precision(model, fp8dist.resolve_config(fp8="torchao", torchao_moe_recipe="mxfp8_emulated"),
                                      device=H100, check_installed=False).by_name("model.layers.0.mlp.experts")
    assert emulated.precision == "fp8" and emulated.predicted == ()
    assert emulated.reason.endswith("FP8 speed not predicted (no speed model for torchao_moe_recipe 'mxfp8_emulated'): "
                                    "converted as under fp8_select='all'")


def test_wrap_model_takes_the_probes_report():
    """wrap_model(numerics=report): the layer the probe flags (a planted outlier channel) trains in bf16 on this CPU
    too ("all" selects for speed only; safety applies under either selection), the rest in FP8."""
    from test_numerics_probe import BAD, _batches, _plant_outlier

    model = build_llama("tiny", seed=0)
    handle = _plant_outlier(model)
    report = fp8dist.measure_fp8_numerics(model, _batches(), fp8="torchao")
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = fp8dist.wrap_model(model, strategy="none", fp8="torchao", numerics=report)
    plan = fp8dist.get_plan(wrapped)
    assert plan.by_name(BAD).precision == "bf16" and type(wrapped.get_submodule(BAD)).__name__ == "Linear"
    assert len(plan.fp8) == 12 and all(type(wrapped.get_submodule(e.name)).__name__ == "Float8Linear"
                                       for e in plan.fp8)
