"""Peak memory of ``fp8dist train --pretrained DIR --lora-rank 4`` on an FP8 checkpoint against the same weights'
bf16 checkpoint (issue 55), each job in a fresh process, its peak RSS over the tiny preset's job: the FP8 base is
held at 1 byte per weight plus its scales, the bf16 base as fp32 parameters (4 bytes), each plus the checkpoint's
bytes, which the load memory-maps. The measurement is benchmarks/checkpoint/fp8_base_memory.py's (its docstring
says why the jobs run with glibc's fixed mmap threshold); its results file has both allocator settings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torchao", reason="a base held in FP8 runs under torchao")
pytest.importorskip("peft", reason="--lora-rank needs peft")

ROOT = Path(__file__).resolve().parent.parent


def _benchmark():
    spec = importlib.util.spec_from_file_location("fp8_base_memory", ROOT / "benchmarks" / "checkpoint" /
                                                  "fp8_base_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_lora_job_on_an_fp8_checkpoint_peaks_at_its_bytes_not_at_an_fp32_copy_of_the_base(tmp_path):
    """XX s on the 2-core machine (measured 2026-12-02): two exports, three jobs of 2 steps at once."""
    bench = _benchmark()
    paths = bench.export("medium", tmp_path)  # 25.4M parameters, 24.9M of them in the 55 FP8 Linears
    m = bench.measure(paths, bench.export(bench.BASELINE, tmp_path)["fp8"])
    assert "the frozen base came in FP8 from the checkpoint: 55 Linears (24,903,680 weights)" in m["log fp8"]
    # expected 49.6 MiB: 23.8 MiB of e4m3 bits, 55 scales, 2.3 MiB of fp32 embeddings, norms and the two Linears kept
    # out of FP8, 24.8 MiB of mapped file; measured 49.9-50.3 (2026-12-02). An fp32 copy of the FP8 weights would add
    # 95 MiB: FP8 health telemetry dequantizing the whole base at once measured +142 MiB.
    assert m["fp8"] == pytest.approx(m["fp8 expected"], abs=3), m
    # expected 144.6 MiB: 4 bytes a parameter and 48.5 MiB of mapped bf16 file; measured 143.9-146.6
    assert m["bf16"] == pytest.approx(m["bf16 expected"], abs=4), m
    assert m["fp8"] < 0.4 * m["bf16"], m  # measured 0.347
