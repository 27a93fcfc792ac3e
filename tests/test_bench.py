"""``fp8dist bench``: the collective counter, a real (tiny) benchmark run on 2 gloo ranks, its flag errors, the
learning-rate schedule, and the 3b preset against fp8dist's own memory estimate (the bench's GPU pre-flight)."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import pytest
import torch
import torch.distributed as dist

from cli_helpers import run
from dist_harness import run_ranks
from fp8dist.bench.runner import default_strategies
from fp8dist.cli import main
from fp8dist.fp8 import BACKENDS
from fp8dist.strategies import STRATEGIES
from fp8dist.train.models import build_llama

STEPS = 5
SEQ = 32  # what the tests read (files, figures, twins, schedules) does not need the CPU default's 128 tokens


def _collectives(rank: int, world: int) -> dict:
    """Each collective type once, through torch.distributed, the functional API and DDP's C++ reducer."""
    import torch.distributed._functional_collectives as funcol
    from torch.nn.parallel import DistributedDataParallel

    from fp8dist.bench.comm import CommCounter

    with CommCounter() as comm:
        dist.all_reduce(torch.ones(1000))                                          # 4000 B
        out = torch.empty(1000, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, torch.ones(500, dtype=torch.bfloat16))   # 2000 B gathered
        dist.reduce_scatter_tensor(torch.empty(500), torch.ones(1000))             # 4000 B scattered
        dist.broadcast(torch.ones(10, dtype=torch.int64), src=0)                   # 80 B
        funcol.all_reduce(torch.ones(10), "sum", dist.group.WORLD).wait()          # 40 B
    with CommCounter() as ddp_comm:
        model = DistributedDataParallel(torch.nn.Linear(8, 8))  # its constructor broadcasts the state
        model(torch.ones(2, 8)).sum().backward()                # the reducer all-reduces 72 fp32 gradients
    return {"c10d": comm.counts.to_dict(), "ddp": ddp_comm.counts.to_dict()}


def test_comm_counter_sees_every_collective_at_its_full_buffer_size():
    counts = run_ranks(_collectives)
    assert counts[0] == counts[1]
    c10d = {k: (v["calls"], v["bytes"]) for k, v in counts[0]["c10d"].items()}
    assert c10d == {"all_reduce": (2, 4040), "all_gather": (1, 2000), "reduce_scatter": (1, 4000),
                    "broadcast": (1, 80)}
    assert counts[0]["c10d"]["all_gather"]["dtypes"] == ["bfloat16"]
    assert counts[0]["ddp"]["all_reduce"]["bytes"] == (64 + 8) * 4  # DDP's C++ reducer goes through c10d too


def _fsdp_cells(rank: int, world: int) -> list:
    """FSDP2 bf16 and FSDP2 + torchao (FP8 all-gather) on the tiny Llama, as fp8dist bench runs its cells."""
    from fp8dist.bench.cell import Cell, run_cell

    return [run_cell(Cell(strategy="fsdp", fp8=fp8, size="tiny", steps=STEPS, seq_len=SEQ))
            for fp8 in (None, "torchao")]


def _te_vs_raw_cell(rank: int, world: int):
    """FSDP2 + Transformer Engine through the STAND-IN (tests/standins: high-precision modules that record what
    autocast got; not TE): fp8dist's wiring beside TE wired by hand, as the bench's vs-raw cell runs them."""
    from standin import use_standins

    use_standins()
    import transformer_engine.pytorch as te

    from fp8dist.bench.cell import Cell, run_cell

    cell = run_cell(Cell(strategy="fsdp", fp8="te", size="tiny", steps=STEPS, wiring="vs-raw"))
    autocasts = [(enabled, type(recipe).__name__, group is dist.group.WORLD, name)
                 for enabled, recipe, group, name in te.AUTOCAST_CALLS]
    return cell, autocasts


def test_the_hand_wired_transformer_engine_cell_matches_fp8dists_wiring():
    """The TE overhead cell compares like with like: the hand-wired engine converts the same layers (every Linear
    of the tiny Llama, counted from the model) and gives the same losses; the step-time ratio is measured. The
    stand-in checks the wiring only: TE's speed and numerics need a GPU."""
    (cell, autocasts), (_, rank1_autocasts) = run_ranks(_te_vs_raw_cell)
    linears = [m for m in build_llama("tiny").modules() if type(m) is torch.nn.Linear]
    assert cell["raw"]["fp8_layers"] == cell["fp8_layers"] == len(linears)
    assert cell["raw"]["fp8_params"] == cell["fp8_params"] == sum(m.weight.numel() for m in linears)
    assert cell["losses"] == cell["raw"]["losses"]
    assert len(cell["step_times_s"]) == len(cell["raw"]["step_times_s"]) == STEPS
    # both wirings ran every forward under TE's autocast: DelayedScaling, amax over the world group
    assert autocasts == rank1_autocasts == [(True, "DelayedScaling", True, "autocast")] * (2 * STEPS)


@pytest.fixture(scope="module")
def fsdp_cells() -> list:
    return run_ranks(_fsdp_cells)[0]


def test_fp8_all_gather_moves_half_the_bytes_of_bf16_for_converted_weights(fsdp_cells):
    """torchao's FP8 all-gather sends 1 byte per converted weight element where bf16 sends 2; the scales are not
    gathered but made by one all-reduce of the FP8 layers' fp32 amaxes per step (the precompute after the step)."""
    bf16, fp8 = fsdp_cells
    n_fp8, layers, n_all = fp8["fp8_params"], fp8["fp8_layers"], fp8["params"]
    assert n_fp8 > 0.8 * n_all and layers == 13  # every Linear but the first and last
    gathered_bf16 = bf16["comm"]["all_gather"]["bytes"]
    # decoder blocks and the input embedding are gathered twice per step (forward, and again in backward:
    # reshard_after_forward); the final norm + lm_head unit once, kept gathered for backward
    tiny = build_llama("tiny")
    n_root = sum(p.numel() for n, p in tiny.named_parameters() if not n.startswith("model.layers."))
    n_embed = tiny.model.embed_tokens.weight.numel()
    twice, once = n_all - n_root + n_embed, n_root - n_embed
    assert gathered_bf16 == 2 * (2 * twice + once)
    other = 2 * (2 * (twice - n_fp8) + once)  # every non-FP8 weight: bf16 in both runs
    converted_bf16 = gathered_bf16 - other
    converted_fp8 = fp8["comm"]["all_gather"]["bytes"] - other
    gathers = 2  # every FP8 weight is in a block
    assert converted_fp8 == gathers * n_fp8  # exactly 1 byte per element per gather
    # blocks holding FP8 weights travel as bytes (FSDP2 packs mixed dtypes as uint8), the root group in bf16
    assert fp8["comm"]["all_gather"]["dtypes"] == ["bfloat16", "uint8"]
    # the non-finite step guard: a MAX all-reduce of one fp32 flag per parameter and one for the gradient norm, each
    # step, with FP8 or without
    guard = 4 * (len(list(tiny.parameters())) + 1)
    assert bf16["comm"]["all_reduce"]["bytes"] == guard
    scales = fp8["comm"]["all_reduce"]["bytes"] - guard
    assert scales == 4 * layers
    ratio = (converted_fp8 + scales) / converted_bf16
    assert ratio == pytest.approx(0.5 + 2 * layers / (gathers * n_fp8), rel=1e-9)
    assert fp8["comm"]["reduce_scatter"] == bf16["comm"]["reduce_scatter"]  # gradients reduce in fp32 either way
    assert bf16["lrs"] == fp8["lrs"] == [1e-3] * STEPS  # the default schedule: constant


def _check_cell(cell: dict, settings: dict) -> None:
    """The figures of a cell are what their definitions make them, from the cell's own step times."""
    from fp8dist.bench.cell import TIMING_WARMUP

    assert len(cell["losses"]) == len(cell["step_times_s"]) == STEPS
    assert cell["tokens_per_step"] == settings["batch_size"] * cell["world_size"] * settings["seq_len"]
    assert cell["median_step_s"] == statistics.median(cell["step_times_s"][TIMING_WARMUP:STEPS - 1])
    assert cell["tokens_per_s"] == cell["tokens_per_step"] / cell["median_step_s"]
    assert cell["losses"][-1] < cell["losses"][0], "it trains"
    # FSDP2 reduce-scatters every gradient once per step: fp32, or bf16 at the lean level
    assert cell["comm"]["reduce_scatter"]["bytes"] == (2 if cell["memory"] == "lean" else 4) * cell["params"]
    # FSDP2 over 2 ranks: each keeps half of the fp32 parameters, gradients and both Adam moments; lean: half of
    # the bf16 weights and gradients and of the 8-bit states (+ their scales, code maps and steps: 3.09)
    per_param = 3.09 if cell["memory"] == "lean" else 8.0
    assert cell["model_state"]["bytes_per_param"]["total"] == pytest.approx(per_param, rel=0.01)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """A real (tiny) run of the command: FSDP2 bf16 and torchao at both memory levels, 2 processes, the standard
    cells also against the hand-wired engine trained beside them; warm-up + cosine learning rate."""
    out = tmp_path_factory.mktemp("bench")
    proc = run(["fp8dist", "bench", "--strategies", "fsdp", "--fp8", "torchao", "--sizes", "tiny", "--steps",
                str(STEPS), "--seq-len", str(SEQ), "--nproc", "2", "--memory", "standard,lean", "--lr-schedule",
                "cosine", "--out", str(out)], timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


@pytest.mark.slow
def test_bench_writes_json_and_png_with_device_figures_and_overhead(bench_run):
    tmp_path, proc = bench_run
    (json_path,) = tmp_path.glob("bench_*_cpu-x2.json")
    doc = json.loads(json_path.read_text())
    assert doc["device"]["type"] == "cpu" and doc["device"]["nproc"] == 2 and doc["device"]["name"]
    assert doc["versions"]["torch"] == torch.__version__ and doc["versions"]["torchao"]
    assert json_path.name == f"bench_{doc['date'][:10]}_cpu-x2.json" and doc["command"].startswith("fp8dist bench")
    cells = {c["name"]: c for c in doc["cells"]}
    assert list(cells) == ["fsdp/bf16/tiny", "fsdp/torchao/tiny", "fsdp/bf16+lean/tiny", "fsdp/torchao+lean/tiny",
                           "fsdp/bf16/tiny/vs-raw", "fsdp/torchao/tiny/vs-raw"]
    for cell in cells.values():
        _check_cell(cell, doc["settings"])
        assert cell["predicted"] is None  # a CPU run: no GPU speed to predict (a GPU cell records its figures)
    for name in ("fsdp/bf16/tiny", "fsdp/torchao/tiny"):
        assert len(cells[name]["peak_memory_mib"]) == 2, "one peak per rank"
    vs_bf16 = cells["fsdp/torchao/tiny"]["vs_bf16"]
    assert vs_bf16["bf16_cell"] == "fsdp/bf16/tiny" and vs_bf16["bf16_losses"] == cells["fsdp/bf16/tiny"]["losses"]
    deltas = [abs(a - b) for a, b in zip(cells["fsdp/torchao/tiny"]["losses"], vs_bf16["bf16_losses"])]
    assert vs_bf16["max_abs_delta_loss"] == max(deltas) > 0, "FP8 is not bf16"
    for fp8 in ("bf16", "torchao"):
        pair = cells[f"fsdp/{fp8}/tiny/vs-raw"]
        assert pair["overhead"]["losses_identical"] and pair["losses"] == pair["raw"]["losses"]
        ratios = pair["overhead"]["step_time_ratios"]
        assert len(ratios) == STEPS - 3  # 2 warm-up steps, 1 counted
        assert pair["overhead"]["step_time_ratio"] == statistics.median(ratios)
        assert pair["raw"]["fp8_params"] == pair["fp8_params"]  # the hand-wired filter converts the same layers
    assert cells["fsdp/torchao/tiny/vs-raw"]["losses"] == cells["fsdp/torchao/tiny"]["losses"]
    png = json_path.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    assert sorted(p.name for p in tmp_path.iterdir()) == [json_path.name, json_path.with_suffix(".png").name]
    assert "| fsdp/torchao/tiny |" in proc.stdout and "fp8dist / raw" in proc.stdout
    assert doc["settings"]["lr_schedule"] == "cosine" and "AdamW lr 0.001 (warm-up + cosine decay)" in proc.stdout


def _cosine_lrs(steps: int, peak: float) -> list[float]:
    """fp8dist train's schedule written out for a run shorter than 20 steps (warm-up: 1 step, at the peak), then
    cosine from the peak toward a tenth of it."""
    assert steps < 20
    return [peak] + [peak * (0.1 + 0.45 * (1 + math.cos(math.pi * k / (steps - 1)))) for k in range(steps - 1)]


@pytest.mark.slow
def test_cosine_schedule_is_what_every_optimizer_stepped_with(bench_run, fsdp_cells):
    """--lr-schedule cosine: the learning rate each cell's optimizers (fp8dist's and the hand-wired twin's) held at
    each step is fp8dist train's schedule, it is recorded in the JSON, and it trains differently from constant."""
    tmp_path, _ = bench_run
    doc = json.loads(next(tmp_path.glob("bench_*.json")).read_text())
    expected = _cosine_lrs(STEPS, 1e-3)
    assert expected[2] < expected[1] == expected[0] == 1e-3 and expected[-1] > 1e-4
    for cell in doc["cells"]:
        assert cell["lr_schedule"] == "cosine"
        rel = 1e-7 if cell["memory"] == "lean" else 1e-15  # lean's torchao AdamW holds it in an fp32 tensor
        assert cell["lrs"] == pytest.approx(expected, rel=rel), cell["name"]
        if cell["wiring"] == "vs-raw":
            assert cell["raw"]["lrs"] == cell["lrs"]
    # the same cell at a constant rate (fsdp_cells: the same settings, seed and batches): the first three losses
    # come before any update at a lower rate, then the curves part
    cosine = next(c for c in doc["cells"] if c["name"] == "fsdp/bf16/tiny")["losses"]
    constant = fsdp_cells[0]["losses"]
    assert cosine[:3] == pytest.approx(constant[:3], abs=1e-5)
    assert abs(cosine[3] - constant[3]) > 1e-4


@pytest.mark.slow
def test_each_lean_cell_carries_and_plots_its_standard_twins_curve(bench_run):
    """A lean cell is compared with the fp32-master cell of the same strategy, FP8 backend, size and seed (its bf16
    counterpart is the lean bf16 cell): the JSON holds both curves, their gap and the last steps' means, the PNG's
    lean panel draws both curves and their difference, and the table has a row per lean cell."""
    from fp8dist.bench.plot import loss_panels

    tmp_path, proc = bench_run
    doc = json.loads(next(tmp_path.glob("bench_*.json")).read_text())
    cells = {c["name"]: c for c in doc["cells"]}
    panels = {p["title"]: p for p in loss_panels(doc)}
    fp8_panel = panels["loss, llama-tiny: FP8 (dashed) vs bf16 (solid), same seed and batches"]
    assert [c["cell"] for c in fp8_panel["curves"]] == ["fsdp/bf16/tiny", "fsdp/torchao/tiny"]
    lean_panel = panels["loss, llama-tiny: memory lean (dashed) vs standard fp32 master (solid)"]
    drawn = {(c["label"].split(" (")[0], c["dashed"]): c["losses"] for c in lean_panel["curves"]}
    for fp8 in ("bf16", "torchao"):
        lean, standard = cells[f"fsdp/{fp8}+lean/tiny"], cells[f"fsdp/{fp8}/tiny"]
        v = lean["vs_standard"]
        assert v["standard_cell"] == standard["name"] and v["standard_losses"] == standard["losses"]
        deltas = [a - b for a, b in zip(lean["losses"], standard["losses"])]
        assert v["max_abs_delta_loss"] == max(map(abs, deltas)) > 0, "8-bit states are not fp32 ones"
        assert v["final_delta_loss"] == deltas[-1] and v["tail_steps"] == STEPS
        assert v["tail_mean_loss"] == {"lean": statistics.fmean(lean["losses"]),
                                       "standard": statistics.fmean(standard["losses"])}
        assert abs(v["tail_relative_gap"]) < 0.01  # 5 steps: the curves have not parted
        assert drawn[(f"fsdp {fp8} standard", False)] == standard["losses"]
        assert drawn[(f"fsdp {fp8} lean", True)] == lean["losses"]
        assert [d["losses"] for d in lean_panel["deltas"] if d["label"] == f"fsdp {fp8}"] == [deltas]
        assert f"| fsdp/{fp8}+lean/tiny | fsdp/{fp8}/tiny |" in proc.stdout
        assert "lean" not in "".join(c["label"] for c in fp8_panel["curves"])
    assert cells["fsdp/torchao+lean/tiny"]["vs_bf16"]["bf16_cell"] == "fsdp/bf16+lean/tiny"
    assert "vs_standard" not in cells["fsdp/torchao/tiny"]


@pytest.mark.parametrize("flags, expected", [
    (["--strategies", "fsdp,zero3"], ["--strategies", "'zero3'", ", ".join(STRATEGIES),  # the registry's order
                                      f"e.g. --strategies {','.join(default_strategies('cuda'))}"]),
    (["--fp8", "fp4"], ["--fp8", "'fp4'", ", ".join(["none", *BACKENDS])]),
    (["--sizes", "tiny,huge"], ["--sizes", "'huge'", "tiny, small, medium"]),
    (["--sizes", ","], ["--sizes", "empty"]),
    (["--steps", "3"], ["--steps 3", "at least 4", "warm-up"]),
    (["--nproc", "0"], ["--nproc 0", "at least 1"]),
    (["--seq-len", "10000000"], ["--seq-len 10000000", "corpus"]),
    (["--strategies", "fsdp", "--fp8", "msamp"], ["msamp", "fsdp"]),
    (["--compile", "off,maybe"], ["--compile", "'maybe'", "off, on"]),
    (["--activation-checkpointing", "some"], ["--activation-checkpointing", "'some'", "none, full, selective"]),
    (["--lr-schedule", "linear"], ["--lr-schedule 'linear'", "constant, cosine", "e.g. --lr-schedule cosine"]),
    (["--lr-schedule", "constant,cosine"], ["--lr-schedule 'constant,cosine'", "one value"]),
    (["--strategies", "deepspeed", "--compile", "on"], ["cell deepspeed/bf16+compile/tiny: compile=True with "
                                                         "strategy='deepspeed'", "engine.compile()"]),
    (["--torchao-recipe", "blockwise"], ["--torchao-recipe", "'blockwise'", "tensorwise, rowwise, rowwise_with_gw_hp"]),
    (["--torchao-api", "swap"], ["--torchao-api", "'swap'", "auto, module_swap, weight_wrapper"]),
    (["--strategies", "fsdp1", "--fp8", "torchao", "--torchao-api", "weight_wrapper"],
     ["cell fsdp1/torchao-weight_wrapper/tiny: torchao_api='weight_wrapper' with strategy='fsdp1'",
      "Leave it out of --compile / --activation-checkpointing / --torchao-recipe / --torchao-api"]),
    (["--seed", "0,x"], ["--seed '0,x'", "e.g. --seed 0,1,2"]),
    (["--data", "docs.jsonl"], ["--data needs a tokenizer: pass --tokenizer DIR"]),
    (["--eval-every", "5"], ["eval_every needs data"]),
    (["--data", "/no/such/docs.jsonl", "--tokenizer", "/no/such/tokenizer"], ["data file '/no/such/docs.jsonl' does "
                                                                               "not exist"]),
])
def test_bad_flags_are_errors_naming_the_value_and_the_choices(flags, expected, capsys, tmp_path):
    assert main(["bench", *flags, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8dist bench: error: ")
    for text in expected:
        assert text in err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def _bench_args(*flags: str) -> argparse.Namespace:
    from fp8dist.cli import bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *flags])


def test_compile_and_checkpointing_are_matrix_dimensions():
    from fp8dist.bench.runner import plan_cells, resolve_settings

    args = _bench_args("--strategies", "fsdp", "--fp8", "torchao", "--sizes", "tiny", "--compile", "off,on",
                       "--activation-checkpointing", "none,full", "--no-raw")
    cells = plan_cells(resolve_settings(args, "cpu"))
    assert [c.name for c in cells] == [
        f"fsdp/{fp8}{blocks}/tiny" for blocks in ("", "+ac-full", "+compile", "+compile+ac-full")
        for fp8 in ("bf16", "torchao")]
    assert {(c.compile, c.activation_checkpointing) for c in cells} == {(False, "none"), (False, "full"),
                                                                         (True, "none"), (True, "full")}


def test_missing_matplotlib_is_an_error_before_anything_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # import matplotlib.pyplot raises ImportError
    assert main(["bench", "--sizes", "tiny", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'fp8dist[bench]'" in err and "--no-plot" in err
    assert not list(tmp_path.iterdir())


def test_lr_schedules_rise_then_decay_toward_a_tenth():
    """One schedule for fp8dist train and fp8dist bench: constant, or a linear warm-up over the first 10% of the
    steps to the peak, then a cosine decay that passes half-way (0.55) at the middle of the decay and ends a step
    short of a tenth."""
    from fp8dist.train.schedule import lr_schedule

    assert [lr_schedule("constant", 100)(s) for s in range(100)] == [1.0] * 100
    f = [lr_schedule("cosine", 100)(s) for s in range(101)]
    assert f[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert f[10] == 1.0 and f[55] == pytest.approx(0.55) and f[100] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(f[10:], f[11:]))
    with pytest.raises(ValueError, match="'linear' is not valid; choose one of: constant, cosine"):
        lr_schedule("linear", 100)


H100_USABLE = 78 * 2**30
"""What one 80 GB H100 leaves for training (its 79.6 GiB less the CUDA context and what the runtime holds)."""


def _meta_llama(size: str):
    from fp8dist.train.models import build_llama

    with torch.device("meta"):
        return build_llama(size)


def _llama_params(size: str) -> int:
    """Parameters of a preset from its widths: untied embedding and output over the byte vocabulary, the final norm,
    and per layer two norms, q/o (hidden^2), k/v (hidden x kv_heads x head_dim) and the gated MLP (3 matrices)."""
    from fp8dist.train.data import VOCAB_SIZE
    from fp8dist.train.config import LLAMA_SIZES

    hidden, inter, layers, heads, kv = LLAMA_SIZES[size]
    per_layer = 2 * hidden + 2 * hidden * hidden + 2 * hidden * kv * (hidden // heads) + 3 * hidden * inter
    return 2 * VOCAB_SIZE * hidden + hidden + layers * per_layer


def test_3b_preset_is_llama_3_2_3b_widths_over_the_byte_vocabulary():
    from fp8dist.train.config import LLAMA_SIZES

    assert LLAMA_SIZES["3b"] == (3072, 8192, 28, 24, 8)  # Llama 3.2 3B's hidden, MLP, layers, heads, kv heads
    n = sum(p.numel() for p in _meta_llama("3b").parameters())
    assert n == _llama_params("3b") and 2.5e9 < n < 3.5e9  # "about 3B"
    assert _llama_params("1b") < n  # the largest preset


@pytest.mark.parametrize("fp8", [None, "torchao"])
def test_3b_with_full_checkpointing_fits_one_h100_at_the_bench_gpu_batch(fp8):
    """fp8dist's own estimate: the 3b preset with full activation checkpointing, at the bench's GPU batch and
    sequence length, on one rank of each GPU strategy, holds fp32 weights, gradients and two Adam moments (16
    bytes/parameter) plus activations, within what an 80 GB H100 leaves, with the bench's margin to spare."""
    from fp8dist.bench.fits import MEMORY_FRACTION
    from fp8dist.bench.runner import DEFAULTS, default_strategies
    from fp8dist.accounting import estimate_memory

    _, _, batch, seq = DEFAULTS["cuda"]
    model, n = _meta_llama("3b"), _llama_params("3b")
    for strategy in default_strategies("cuda"):
        est = estimate_memory(model, strategy=strategy, fp8=fp8, activation_checkpointing="full", world_size=1,
                              micro_batch_size=batch, seq_len=seq)
        assert est.total_params == n and est.activations_modelled and est.offloaded == ()
        assert est.bytes["parameters"] == est.bytes["gradients"] == 4 * n
        assert est.bytes_per_param["total"] == pytest.approx(16, rel=1e-4)
        without = estimate_memory(model, strategy=strategy, fp8=fp8, world_size=1, micro_batch_size=batch,
                                  seq_len=seq)
        assert est.activation_bytes < without.activation_bytes  # one layer's saves instead of every layer's
        assert est.model_state_bytes + est.activation_bytes < MEMORY_FRACTION * H100_USABLE, strategy


def test_bench_gpu_defaults_run_3b_with_checkpointing_and_refuse_it_without():
    """On one H100 the bench's GPU defaults (batch, sequence, steps) run the 3b cells with --activation-checkpointing
    full --no-raw; DDP without checkpointing and the side-by-side hand-wired cells (two models in one process) are
    refused before anything starts, with the flag that makes them fit."""
    from fp8dist.bench.cell import TIMING_WARMUP
    from fp8dist.bench.fits import MEMORY_FRACTION, check_cells_fit
    from fp8dist.bench.runner import DEFAULTS, plan_cells, resolve_settings
    from fp8dist.train.data import make_corpus

    _, steps, batch, seq = DEFAULTS["cuda"]
    assert steps >= TIMING_WARMUP + 2 and seq < len(make_corpus())
    budget = int(MEMORY_FRACTION * H100_USABLE)
    settings = resolve_settings(_bench_args("--sizes", "3b", "--activation-checkpointing", "full", "--no-raw",
                                            "--nproc", "1", "--fp8", "none,torchao"), "cuda")
    assert (settings.steps, settings.batch_size, settings.seq_len) == (steps, batch, seq)
    cells = plan_cells(settings)
    assert [c.name for c in cells] == [f"{s}/{f}+ac-full/3b" for s in default_strategies("cuda")
                                       for f in ("bf16", "torchao")]
    assert sorted(default_strategies("cuda")) == ["ddp", "fsdp"]
    check_cells_fit(cells, 1, budget)
    plain = resolve_settings(_bench_args("--sizes", "3b", "--nproc", "1", "--fp8", "torchao"), "cuda")
    cells = plan_cells(plain)
    ddp = [c for c in cells if c.strategy == "ddp"]
    with pytest.raises(ValueError) as err:
        check_cells_fit(ddp, 1, budget)
    for text in ("cell ddp/bf16/3b will not fit", f"activations of {batch} x {seq} tokens",
                 "Pass --activation-checkpointing full (estimated", "--strategies fsdp",
                 f"fp8dist estimate --model-size 3b --strategy ddp --world-size 1 --seq-len {seq} "
                 f"--micro-batch-size {batch} --fp8 none --activation-checkpointing none"):
        assert text in str(err.value)
    raw = [c for c in cells if c.wiring == "vs-raw"]
    assert len(raw) == 2
    with pytest.raises(ValueError, match=r"cell fsdp/bf16/3b/vs-raw will not fit.*pass --no-raw"):
        check_cells_fit(raw, 1, budget)
    check_cells_fit(raw, 8, budget)  # eight GPUs: FSDP2 shards both models' states


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    from text_corpus import write_text_corpus

    return write_text_corpus(tmp_path_factory.mktemp("text"))


def test_bench_on_text_records_held_out_loss_and_its_spread_over_seeds(text, tmp_path):
    """--data: every cell trains on the text (a vocabulary of the tokenizer's size) and evaluates the same held-out
    windows at fixed steps; --torchao-recipe and --seed are matrix dimensions; the convergence summary gives each
    configuration's held-out loss over the seeds and its gap to bf16, paired by seed (strategy none: the cells run
    in this process, for real)."""
    import warnings

    from fp8dist.bench.cell import cell_config, run_cell
    from fp8dist.bench.plot import loss_panels
    from fp8dist.bench.results import convergence_table, results_document
    from fp8dist.bench.runner import check_text, plan_cells, resolve_settings

    args = _bench_args("--data", str(text.jsonl), "--tokenizer", str(text.tokenizer), "--data-cache",
                       str(tmp_path / "cache"), "--strategies", "none", "--fp8", "torchao", "--torchao-recipe",
                       "rowwise", "--sizes", "tiny", "--seed", "0,1", "--steps", "4", "--seq-len", "16",
                       "--batch-size", "2", "--eval-every", "2", "--eval-batches", "1", "--no-raw")
    settings = resolve_settings(args, "cpu")
    cells = plan_cells(settings)
    assert [c.name for c in cells] == ["none/bf16/tiny/seed0", "none/torchao-rowwise/tiny/seed0",
                                       "none/bf16/tiny/seed1", "none/torchao-rowwise/tiny/seed1"]
    assert cell_config(cells[1]).precision.torchao_recipe == "rowwise"
    assert "data: 1 file, 120 documents" in check_text(settings)  # tokenized here, once
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a bench rank on a shared CPU runs (fp8dist.runtime.env.share_cpu_threads)
    try:
        with warnings.catch_warnings():
            results = [run_cell(cell) for cell in cells]
    finally:
        torch.set_num_threads(threads)
    assert {r["params"] for r in results} == {sum(p.numel() for p in build_llama("tiny", vocab_size=320).parameters())}
    for r in results:
        assert [step for step, _ in r["eval_losses"]] == [2, 4] and r["losses"][-1] < r["losses"][0]
    assert results[0]["eval_losses"] != results[2]["eval_losses"], "another seed, another run"
    doc = results_document(results, settings, "cpu", command="test", load_average=[(0, 0, 0)] * 2, wall_s=1.0)
    bf16, fp8 = doc["convergence"]
    assert (bf16["config"], fp8["config"], fp8["seeds"], fp8["steps"]) == ("none/bf16/tiny",
                                                                         "none/torchao-rowwise/tiny", [0, 1], [2, 4])
    last = [results[1]["eval_losses"][-1][1], results[3]["eval_losses"][-1][1]]
    gaps = [last[0] - results[0]["eval_losses"][-1][1], last[1] - results[2]["eval_losses"][-1][1]]
    assert fp8["held_out"][-1] == {"mean": statistics.fmean(last), "std": statistics.stdev(last), "values": last}
    assert fp8["gap_vs_bf16"][-1]["values"] == gaps and fp8["bf16_config"] == "none/bf16/tiny"
    assert bf16["gap_vs_bf16"] is None
    row = (f"| none/torchao-rowwise/tiny | 2 | {statistics.fmean(last):.4f} ± {statistics.stdev(last):.4f} | "
           f"{statistics.fmean(gaps):+.4f} ± {statistics.stdev(gaps):.4f} |")
    assert row in convergence_table(doc)
    held = loss_panels(doc)[-1]
    assert held["title"] == "held-out loss, llama-tiny: mean over 2 seeds (± sample std at the last step)"
    assert [c["losses"][-1] for c in held["curves"]] == [bf16["held_out"][-1]["mean"], statistics.fmean(last)]


def test_torchao_api_is_a_matrix_dimension_recorded_in_each_cells_json_and_label(tmp_path):
    """--torchao-api module_swap,weight_wrapper: a cell per API, named, recorded and plotted as such, each wrapping
    with its API; both run the same torchao FP8 GEMMs, so their losses are equal (strategy none: in this process)."""
    import warnings

    from fp8dist.bench.cell import cell_config, run_cell
    from fp8dist.bench.plot import loss_panels
    from fp8dist.bench.results import markdown_table, results_document
    from fp8dist.bench.runner import plan_cells, resolve_settings

    args = _bench_args("--strategies", "none", "--fp8", "torchao", "--torchao-api", "module_swap,weight_wrapper",
                       "--sizes", "tiny", "--steps", "4", "--seq-len", "16", "--batch-size", "2")
    settings = resolve_settings(args, "cpu")
    cells = plan_cells(settings)
    names = ["none/bf16/tiny", "none/torchao-module_swap/tiny", "none/torchao-weight_wrapper/tiny"]
    assert [c.name for c in cells] == names, "strategy none has no hand-wired twin"
    assert [cell_config(c).precision.torchao_api for c in cells[1:]] == ["module_swap", "weight_wrapper"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            results = [run_cell(cell) for cell in cells]
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(json.dumps(results_document(results, settings, "cpu", command="test",
                                                 load_average=[(0, 0, 0)] * 2, wall_s=1.0)))
    bf16, swap, wrapper = doc["cells"]
    assert [c["more_variants"] for c in doc["cells"]] == [{}, {"torchao_api": "module_swap"},
                                                          {"torchao_api": "weight_wrapper"}]
    assert swap["fp8_layers"] == wrapper["fp8_layers"] and swap["fp8_layers"] > 0
    assert swap["losses"] == wrapper["losses"] != bf16["losses"], "the same FP8 GEMMs either way, not bf16's"
    assert wrapper["vs_bf16"]["bf16_cell"] == "none/bf16/tiny"
    curves = loss_panels(doc)[0]["curves"]
    assert [c["label"].split(" (")[0] for c in curves] == ["none bf16", "none torchao-module_swap",
                                                           "none torchao-weight_wrapper"]
    assert len({c["color"] for c in curves}) == 3, "each API a color of its own"
    assert "| none/torchao-weight_wrapper/tiny |" in markdown_table(doc)
