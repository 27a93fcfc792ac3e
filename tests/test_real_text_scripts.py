"""The convergence study's scripts in benchmarks/real_text. combine.py merges the result files of one study: runs of one
seed each (whose cell names carry no seed) merge with multi-seed runs, each FP8 cell's held-out gap paired with the
bf16 cell of its own seed, and a configuration run twice for one seed is refused. control.py pairs compiled bf16 cells
with the study's eager bf16 cells by seed (the noise floor)."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {"text": {"data": ["corpus.jsonl"]}, "strategies": ["fsdp"], "sizes": ["small"], "steps": 4,
            "batch_size": 4, "seq_len": 128, "nproc": 2, "lr": 1e-3, "lr_schedule": "cosine", "compile": [False],
            "activation_checkpointing": ["none"]}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"real_text_{name}", ROOT / "benchmarks" / "real_text" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(fp8: str | None, seed: int, held_out: list[float], *, label_seed: bool, compile: bool = False) -> dict:
    name = f"fsdp/{fp8 or 'bf16'}{'+compile' if compile else ''}/small" + (f"/seed{seed}" if label_seed else "")
    return {"name": name, "strategy": "fsdp", "fp8": fp8, "variant": "tensorwise" if fp8 else None,
            "size": "small", "wiring": "fp8dist", "compile": compile, "activation_checkpointing": "none",
            "memory": "standard", "seed": seed, "label_seed": label_seed, "losses": [9.0, 8.0, 7.5, 7.0],
            "eval_losses": [[2, held_out[0]], [4, held_out[1]]]}


def _doc(cells: list[dict]) -> dict:
    return {"settings": dict(SETTINGS, seeds=sorted({c["seed"] for c in cells})), "cells": cells,
            "command": "fp8dist bench ...", "date": "2026-11-25T00:00:00Z", "wall_s": 1.0, "load_average": []}


def test_one_seed_runs_merge_with_a_multi_seed_run_and_pair_gaps_by_seed():
    combine = _script("combine").combine
    held = {("bf16", 0): [8.0, 7.0], ("torchao", 0): [8.1, 7.02], ("bf16", 1): [8.2, 7.1], ("torchao", 1): [8.0, 7.13],
            ("bf16", 2): [8.3, 7.3], ("torchao", 2): [8.3, 7.26]}
    one_seed = [_doc([_cell(None, s, held["bf16", s], label_seed=False),
                      _cell("torchao", s, held["torchao", s], label_seed=False)]) for s in (0, 1)]
    two_seeds = _doc([_cell(None, 2, held["bf16", 2], label_seed=True),
                      _cell("torchao", 2, held["torchao", 2], label_seed=True)])
    merged = combine([*one_seed, two_seeds])

    assert sorted(c["name"] for c in merged["cells"]) == sorted(
        f"fsdp/{b}/small/seed{s}" for b in ("bf16", "torchao") for s in (0, 1, 2))
    assert merged["settings"]["seeds"] == [0, 1, 2]
    fp8 = next(e for e in merged["convergence"] if e["config"] == "fsdp/torchao/small")
    assert fp8["seeds"] == [0, 1, 2] and fp8["bf16_config"] == "fsdp/bf16/small"
    gaps = [held["torchao", s][1] - held["bf16", s][1] for s in (0, 1, 2)]  # +0.02, +0.03, -0.04 at step 4
    assert fp8["gap_vs_bf16"][-1]["values"] == pytest.approx(gaps)
    assert fp8["gap_vs_bf16"][-1]["std"] == pytest.approx(statistics.stdev(gaps))


def test_a_configuration_run_twice_for_one_seed_is_refused():
    combine = _script("combine").combine
    run = _doc([_cell(None, 0, [8.0, 7.0], label_seed=False)])
    again = _doc([_cell(None, 0, [8.0, 7.0], label_seed=True)])
    with pytest.raises(ValueError, match=r"cell fsdp/bf16/small/seed0 is in two files"):
        combine([run, again])


def test_a_committed_study_split_into_one_seed_runs_merges_back_to_the_same_figures(tmp_path):
    """The committed 2026-11-24 study (4 configurations x seeds 0-3), cut into one file per seed as one-seed runs
    write them (names without the seed), merges back into its own convergence figures, written by the command into
    a folder it creates, with no temporary file left beside them."""
    study = json.loads((ROOT / "benchmarks/results/convergence_2026-11-24_python-docs_cpu-x2.json").read_text())
    runs = []
    for seed in sorted({c["seed"] for c in study["cells"]}):
        cells = [dict(c, name=c["name"].removesuffix(f"/seed{seed}"), label_seed=False)
                 for c in study["cells"] if c["seed"] == seed]
        path = tmp_path / f"seed{seed}.json"
        path.write_text(json.dumps(dict(study, cells=cells)))
        runs.append(str(path))
    out = tmp_path / "not" / "yet"
    assert _script("combine").main([*runs, "--out", str(out), "--name", "study"]) == 0
    merged = json.loads((out / "study.json").read_text())
    # the committed file names the backend's variant by torchao's option, written before the bench said "variant"
    expected = [{("variant" if k == "torchao_recipe" else k): v for k, v in e.items()} for e in study["convergence"]]
    assert len(runs) == 4 and merged["convergence"] == expected
    assert sorted(p.name for p in out.iterdir()) == ["study.json", "study.png"]


def test_control_pairs_each_compiled_bf16_cell_with_the_study_bf16_cell_of_its_seed():
    control = _script("control").control
    eager = {0: [8.0, 7.0], 1: [8.2, 7.1], 2: [8.3, 7.3]}
    compiled = {0: [8.01, 7.004], 1: [8.19, 7.097], 2: [8.3, 7.306]}
    study = _doc([_cell(fp8, s, eager[s] if fp8 is None else [0.0, 0.0], label_seed=True)
                  for s in eager for fp8 in (None, "torchao")])
    runs = [dict(_doc([_cell(None, s, compiled[s], label_seed=False, compile=True)]), device="cpu", versions={})
            for s in (2, 0, 1)]
    doc = control(study, runs)
    assert doc["seeds"] == [2, 0, 1] and doc["steps"] == [2, 4]
    deltas = [compiled[s][1] - eager[s][1] for s in (2, 0, 1)]  # +0.006, +0.004, -0.003 at step 4
    assert doc["delta"][-1]["values"] == pytest.approx(deltas)
    assert doc["delta"][-1]["std"] == pytest.approx(statistics.stdev(deltas))

    with pytest.raises(ValueError, match=r"fsdp/bf16\+compile/small \(seed 3\) has no bf16 cell of its seed"):
        control(study, [dict(_doc([_cell(None, 3, [8.0, 7.0], label_seed=False, compile=True)]), device="cpu",
                             versions={})])
    with pytest.raises(ValueError, match="differs from the study in steps"):
        control(study, [dict(runs[0], settings=dict(SETTINGS, steps=8))])
